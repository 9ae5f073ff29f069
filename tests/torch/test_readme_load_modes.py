"""The README's load-mode example runs as written: its python block (after "### Load modes"), executed
verbatim in a fresh interpreter (one process), then checked against the checkpoint it wrote."""

from __future__ import annotations

from readme_blocks import python_block_after, run_example


CHECKS = """
assert missing == ["cls_head.weight", "cls_head.bias"] and unexpected == [], (missing, unexpected)
want, got = pretrained.state_dict(), model.state_dict()
assert all(torch.equal(got[k], want[k]) for k in want)  # the pre-trained part exactly
assert set(got) - set(want) == {"cls_head.weight", "cls_head.bias"} and got["cls_head.weight"].abs().sum() > 0
print("EXAMPLE OK")
"""


def test_readme_load_mode_example_runs(tmp_path):
    proc = run_example(python_block_after("### Load modes") + CHECKS, tmp_path)
    assert "['cls_head.weight', 'cls_head.bias']" in proc.stdout
