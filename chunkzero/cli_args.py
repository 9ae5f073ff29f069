"""What every ``chunkzero`` command shares: exit codes, the one-line usage errors, ``type=`` checks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr and exit code 2."""

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(prog: str, message: str) -> int:
    """Print ``<prog>: error: <message>`` as one line on stderr; return exit code 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_BAD_INPUT


def value_type(kind: type, problem: Callable[[Any], str | None]) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses ``kind`` (int or float) and refuses a value ``problem`` objects to
    (it returns why, e.g. ``"must be >= 1, got 0"``, or ``None``)."""
    noun = "a whole number" if kind is int else "a number"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        why = problem(v)
        if why is not None:
            raise argparse.ArgumentTypeError(why)
        return v

    return parse


def at_least(kind: type, minimum: float) -> Callable[[str], int | float]:
    """An argparse ``type=`` that parses ``kind`` and refuses values below ``minimum``."""
    return value_type(kind, lambda v: None if v >= minimum else f"must be >= {minimum}, got {v}")


positive_int = at_least(int, 1)
nonneg_int = at_least(int, 0)
