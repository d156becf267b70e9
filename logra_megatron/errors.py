"""User-facing errors: bad input ends a command with one clear line on stderr, not a traceback."""

import functools
import os
import sys


class UserError(Exception):
    """An error caused by the user's input (a flag, a file, a layout) with a message that says
    what to change. Entry points turn it into one line on stderr and exit code 2. ``printed``: the
    line was printed already (by rank 0, before the ranks went down together)."""

    printed = False


def one_line(message) -> str:
    """``message`` as one line: a message that quotes a file name or a library's error can hold
    line breaks, and the contract of an entry point is exactly one ``error:`` line."""
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return text or "invalid input (no details)"


def _says_errors() -> bool:
    """Under torchrun every rank of a node finds the same error; one line is enough: global rank 0's,
    and on every other node its first rank's (another node may find what node 0 does not: a --load
    path missing there; its log is the one that says why it stopped)."""
    if os.environ.get("RANK", "0") == "0":
        return True
    return os.environ.get("LOCAL_RANK") == "0" and os.environ.get("GROUP_RANK", "0") != "0"


def exit_on_user_error(main):
    """Decorate an entry point so that a :class:`UserError` prints ``error: <message>`` and exits
    with status 2 instead of raising a traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            if _says_errors() and not error.printed:
                print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper
