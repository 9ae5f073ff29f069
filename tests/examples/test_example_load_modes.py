"""``examples/load_modes.py`` runs as it is (one process), then is checked against the checkpoint it wrote."""

from __future__ import annotations

from examples_runner import run_example

CHECKS = """
assert missing == ["cls_head.weight", "cls_head.bias"] and unexpected == [], (missing, unexpected)
want, got = pretrained.state_dict(), model.state_dict()
assert all(torch.equal(got[k], want[k]) for k in want)  # the pre-trained part exactly
assert set(got) - set(want) == {"cls_head.weight", "cls_head.bias"} and got["cls_head.weight"].abs().sum() > 0
print("EXAMPLE OK")
"""


def test_load_modes_example_runs(tmp_path):
    proc = run_example("load_modes.py", tmp_path, checks=CHECKS)
    assert "['cls_head.weight', 'cls_head.bias']" in proc.stdout
