"""Command-line parsing that reports bad input in one line (argparse prints usage + error)."""

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one ``error: ...`` line and exit code 2."""

    def error(self, message):
        print(f"error: {self.prog}: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)
