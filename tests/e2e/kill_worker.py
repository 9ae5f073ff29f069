"""``chunkzero train`` in which one worker kills itself with SIGKILL after one optimizer step, through
an ``on_step_end`` hook: ``python tests/e2e/kill_worker.py RANK:STEP train [options]`` (run by
``torchrun`` in place of ``-m chunkzero.cli``)."""

from __future__ import annotations

import os
import signal
import sys

from chunkzero.cli import build_parser, cmd_train


class KillAfter:
    """The hook: rank ``rank`` sends itself SIGKILL at the end of step ``step``."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def __call__(self, end) -> None:
        if end.rank == self.rank and end.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    rank, step = (int(v) for v in argv[0].split(":"))
    return cmd_train(build_parser().parse_args(argv[1:]), on_step_end=[KillAfter(rank, step)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
