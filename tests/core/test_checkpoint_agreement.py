"""What the ranks of a save or load compare (chunkzero.checkpoint.agreement), with the standard library:
records that differ in any field raise one error naming the field, the rank and both values."""

from __future__ import annotations

import pytest

from chunkzero.checkpoint.agreement import check_agreement, failed_ranks, layout_digest, load_outcome, save_target
from chunkzero.errors import CheckpointError
from chunkzero.layout import ChunkLayout, TensorSpec

LAYOUT = ChunkLayout.build([TensorSpec("a", (5, 7)), TensorSpec("b", (13,))], 30, 2)


def test_equal_records_agree(tmp_path):
    records = [save_target(tmp_path / "ck", 3, LAYOUT, max_to_keep=2) for _ in range(3)]
    check_agreement(records, "save")
    assert records[0]["directory"] == str((tmp_path / "ck").resolve()) and records[0]["step"] == 3


@pytest.mark.parametrize("field, other, words", [
    ("directory", "/elsewhere", "directory"),
    ("step", 4, "step"),
    ("max_to_keep", None, "max_to_keep"),
])
def test_a_differing_field_is_named_with_both_values(tmp_path, field, other, words):
    a = save_target(tmp_path, 3, LAYOUT, max_to_keep=2)
    b = {**a, field: other}
    with pytest.raises(CheckpointError, match=rf"ranks disagree on the {words} of the save: rank 0 has {a[field]!r}, "
                                              rf"rank 2 has {other!r}; .*\(nothing was written\)"):
        check_agreement([a, a, b], "save")


def test_layouts_compare_by_digest(tmp_path):
    other = ChunkLayout.build([TensorSpec("a", (5, 7)), TensorSpec("b", (13,))], 40, 2)
    assert layout_digest(LAYOUT) == layout_digest(ChunkLayout.from_dict(LAYOUT.to_dict())) != layout_digest(other)
    with pytest.raises(CheckpointError, match=r"disagree on the chunk layout \(SHA-256\) of the save"):
        check_agreement(
            [save_target(tmp_path, 1, LAYOUT, max_to_keep=None), save_target(tmp_path, 1, other, max_to_keep=None)],
            "save",
        )


def test_load_outcomes(tmp_path):
    ok, bad = load_outcome(tmp_path / "1", None), load_outcome(None, CheckpointError("truncated"))
    assert failed_ranks([ok, bad, ok]) == [(1, "CheckpointError: truncated")] and failed_ranks([ok, ok]) == []
    with pytest.raises(CheckpointError, match=rf"step directory of the load: rank 0 has '{tmp_path / '1'}', rank 1 has "
                                              rf"'{tmp_path / '2'}'"):
        check_agreement(
            [{"step_dir": ok["step_dir"]}, {"step_dir": load_outcome(tmp_path / "2", None)["step_dir"]}], "load"
        )
