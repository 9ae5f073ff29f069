"""``chunkzero train`` with an ``on_step_end`` hook, as a script (run directly, or by ``torchrun`` in place of
``-m chunkzero.cli``): ``python tests/e2e/hooked_train.py HOOK train [options]``, where ``HOOK`` is

- ``kill:RANK:STEP``: rank ``RANK`` sends itself SIGKILL at the end of step ``STEP``;
- ``exit-probe:DIR``: at the end of step 1 every rank installs :func:`exit_probe.install_exit_probe`'s markers
  in ``DIR`` (named by rank), to see how the worker processes end.
"""

from __future__ import annotations

import os
import signal
import sys

from exit_probe import install_exit_probe

from chunkzero.cli import build_parser, cmd_train


class KillAfter:
    """Rank ``rank`` sends itself SIGKILL at the end of step ``step``."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def __call__(self, end) -> None:
        if end.rank == self.rank and end.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class ExitProbe:
    """Every rank installs the exit probe's markers ``<marker_dir>/<rank>.*`` at the end of step 1."""

    def __init__(self, marker_dir: str):
        self.marker_dir = marker_dir

    def __call__(self, end) -> None:
        if end.step == 1:
            install_exit_probe(self.marker_dir, str(end.rank))


def make_hook(spec: str):
    kind, _, value = spec.partition(":")
    if kind == "kill":
        return KillAfter(*(int(v) for v in value.split(":")))
    if kind == "exit-probe":
        return ExitProbe(value)
    raise SystemExit(f"hooked_train.py: unknown hook {spec!r} (kill:RANK:STEP or exit-probe:DIR)")


def main(argv: list[str]) -> int:
    return cmd_train(build_parser().parse_args(argv[1:]), on_step_end=[make_hook(argv[0])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
