"""Reinforcement learning on verifiable rewards (GRPO), one idea per module.

- ``tasks``: prompt records; the embedded arithmetic task and offline reasoning-gym tasks.
- ``sampling`` / ``rollout``: sampling ``G`` completions per prompt from the current policy.
- ``rewards``: a registry of ``reward(prompt_record, completion_text) -> float``.
- ``advantages``: GRPO group-normalized advantages.
- ``losses``: the token-level clipped surrogate, KL-to-reference estimators, and log-probs /
  entropy / KL on vocab-parallel logits.

Modules are imported by their full names (``from logra_megatron.rl.losses import ...``) so that
importing one does not pull in the others' dependencies (reasoning-gym takes seconds to load).
"""
