"""The command line's argument parser: a usage error is one line on stderr, exit code 1.

argparse prints the whole usage block and exits 2 on a bad argument. Every
stripefs command instead prints one line saying what is wrong and where the
help is, and exits 1 ("usage or config error", as every other user error of
the command line: common/errors.py ``QuietError``). Subcommand parsers inherit
the class (``add_subparsers`` makes its parsers of the parent's type).
"""

from __future__ import annotations

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's hook for every usage error
        print(f"{self.prog}: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(1)
