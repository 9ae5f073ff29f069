"""``examples/hybrid.py`` runs as it is under torchrun at 4 ranks (2 shard groups of 2): every rank reports
S = 2, R = 2 and bytes sent on both levels, and the two shard groups send the same."""

from __future__ import annotations

import re

import pytest
from examples_runner import example_env, run_example


@pytest.mark.slow  # about 26 s on 2 cores
def test_hybrid_example_runs_under_torchrun(tmp_path):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]  # torchrun, on a free port
    proc = run_example("hybrid.py", tmp_path, env=example_env(OMP_NUM_THREADS="1"), launcher=launcher, timeout_s=300)
    lines = re.findall(r"rank (\d): S=(\d+) R=(\d+) intra ([\d,]+) B, inter ([\d,]+) B sent", proc.stdout)
    assert sorted(int(r) for r, *_ in lines) == [0, 1, 2, 3], proc.stdout
    assert {(s, r) for _, s, r, *_ in lines} == {("2", "2")}
    sent = {int(rank): (int(a.replace(",", "")), int(b.replace(",", ""))) for rank, _, _, a, b in lines}
    assert all(intra > 0 and inter > 0 for intra, inter in sent.values()), sent
    assert sent[0] == sent[2] and sent[1] == sent[3], sent  # rank r of each shard group does the same work
