"""``launch_processes(drop_stdout=...)``: the launched processes' stdout reaches the launcher's, line by line,
without the lines the pattern matches (a library's own prints, jaxlib's gloo in the JAX engine), the last
line too when it has no newline; without a pattern the processes' stdout is the launcher's, untouched."""

from __future__ import annotations

import re
import sys

from chunkzero.workers import launch_processes

CHILD = r"""
import os, sys
from chunkzero.workers import write_result
i = os.environ["JAX_PROCESS_ID"]
sys.stdout.write(f"kept {i}\n[Gloo] Rank {i} is connected to 1 peer ranks. Expected number of connected peer ranks "
                 f"is : 1\nalso kept {i}: [Gloo] Rank in the middle\nlast {i}, no newline")
sys.stdout.flush()
write_result({"status": "ok"})
"""
GLOO = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ")


def _stdout_lines(tmp_path, capfd, drop) -> list[str]:
    capfd.readouterr()
    results = launch_processes([sys.executable, "-c", CHILD], 2, tmp_path, drop_stdout=drop)
    assert results == [{"status": "ok"}] * 2
    out = capfd.readouterr().out
    return sorted(out.replace("newline", "newline\n").splitlines())


def test_dropped_lines_are_left_out_and_the_rest_forwarded(tmp_path, capfd):
    kept = [f"{what} {i}" for i in (0, 1) for what in ("kept", "also kept")]
    want = sorted([*kept, "last 0, no newline", "last 1, no newline"])
    want = sorted(w + (": [Gloo] Rank in the middle" if w.startswith("also") else "") for w in want)
    assert _stdout_lines(tmp_path, capfd, GLOO) == want
    everything = _stdout_lines(tmp_path, capfd, None)  # the pattern is what leaves the lines out
    assert sorted(set(everything) - set(want)) == [
        f"[Gloo] Rank {i} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1" for i in (0, 1)]
