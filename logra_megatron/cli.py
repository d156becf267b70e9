"""Command-line parsing that reports bad input in one line (argparse prints usage + error)."""

import argparse
import difflib
import sys

from logra_megatron.errors import one_line


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one ``error: ...`` line and exit code 2.

    Flags must be spelled out: argparse's prefix matching (``--micro 4`` for
    ``--micro-batch-size 4``) would let a typo or a truncated flag set another option silently,
    and an abbreviation that works today breaks when a flag with the same prefix is added."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        print(f"error: {one_line(f'{self.prog}: {message}')}{self._suggestion(message)} (see --help)",
              file=sys.stderr, flush=True)
        sys.exit(2)

    def _suggestion(self, message: str) -> str:
        """For an unknown flag, the closest real one."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        unknown = [word.split("=")[0] for word in message[len(prefix):].split() if word.startswith("-")]
        if not unknown:
            return ""
        typed = unknown[0].replace("_", "-")
        known = [flag for flag in self._option_string_actions if flag.startswith("--")]
        close = [flag for flag in known if flag.startswith(typed)]  # an abbreviation (not accepted)
        close = close if len(close) == 1 else difflib.get_close_matches(typed, known, n=1, cutoff=0.8)
        return f"; did you mean {close[0]}?" if close else ""
