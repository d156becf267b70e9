"""The held-out split every task source uses: a pure function of the problem text.

A problem is held out when a hash of ``(split_seed, prompt)`` falls below ``fraction``. So
membership needs no table of all problems (the arithmetic task and reasoning-gym generators draw
from spaces too large to list), it does not move with the run's ``--seed``, the world size or the
order problems are generated in, and a problem generated twice (two reasoning-gym indices, two
lines of a file) lands on the same side both times: a held-out problem is never trained on.
"""

import hashlib


def in_held_out_split(prompt: str, fraction: float, split_seed: int = 0) -> bool:
    """Whether ``prompt`` belongs to the held-out share ``fraction`` of its task."""
    digest = hashlib.sha256(f"{split_seed}|{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0**64
