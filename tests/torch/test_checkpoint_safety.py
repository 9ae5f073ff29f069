"""Bad input: every broken checkpoint, wrong step or mismatched model gives a typed error naming the
file or tensor, and a failed load changes nothing — neither on disk nor in the model. Loading never
unpickles."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_harness import TINY, build, full_state, train_step

from chunkzero.errors import (
    CheckpointError,
    CheckpointFormatError,
    ConfigError,
    ShapeMismatchError,
)
from torch_backend.checkpoint.sharded import load_checkpoint, read_meta, save_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint root with steps 1 and 2 (world size 1, AdamW state, frozen and keep-gathered chunks)."""
    root = tmp_path_factory.mktemp("safety") / "ckpt"
    model, optim = build()
    for step in (1, 2):
        train_step(model, optim, step, 0)
        save_checkpoint(root, model, optim, step=step, data_position={"step": step})
    return root


def _snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    } | {"dirs": sorted(str(p) for p in root.rglob("*") if p.is_dir())}


def _copy(saved, tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root


def _data_files(step_dir: Path) -> list[Path]:
    return sorted(
        (p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: -p.stat().st_size,
    )


def _assert_fails_cleanly(root, exc, pattern, *, step=None, model=None, optim="same", staged=False, model_intact=True):
    """The load raises ``exc`` matching ``pattern``; files are untouched, and so is the model unless the
    failure came while reading array data into the live shards (``model_intact=False``)."""
    model_, optim_ = build(seed=11)
    train_step(model_, optim_, 1, 0)  # live optimizer state: the in-place path
    model = model or model_
    optim = optim_ if optim == "same" else optim
    before_disk = _snapshot(root) if root.exists() else None
    before_model = full_state(model_, optim_) if model is model_ else None
    with pytest.raises(exc, match=pattern) as info:
        load_checkpoint(root, model, optim, step=step, staged=staged)
    if before_disk is not None:
        assert _snapshot(root) == before_disk, "a failed load changed files on disk"
    if before_model is not None and model_intact:
        after = full_state(model_, optim_)
        assert all(np.array_equal(after[k], before_model[k]) for k in before_model), "a failed load changed the model"
    assert ("partly overwritten" in str(info.value)) == (not model_intact)


def test_missing_directory_and_wrong_step(saved, tmp_path):
    _assert_fails_cleanly(tmp_path / "nowhere", CheckpointError, "does not exist")
    _assert_fails_cleanly(saved, CheckpointError, r"no committed step 7 .*steps held: 1, 2", step=7)
    (tmp_path / "empty").mkdir()
    _assert_fails_cleanly(tmp_path / "empty", CheckpointError, "no committed checkpoint step")
    meta = load_checkpoint(saved, *build(seed=12), step=1)  # the older step still loads
    assert meta.step == 1 and meta.data_position == {"step": 1}


@pytest.mark.parametrize("damage, exc, pattern", [
    ("truncate", CheckpointFormatError, r"meta/metadata: not valid JSON"),
    ("bad_field", CheckpointFormatError, r"meta/metadata: field 'step'"),
    ("other_step", CheckpointFormatError, r"meta/metadata: field 'step': 1 differs from the directory's step 2"),
    ("bad_layout", CheckpointFormatError, r"field 'layout\.tensors\[0\]\.shape'"),
    ("bad_checksum_list", CheckpointFormatError, r"field 'checksums.arrays.params/chunk_0000'"),
    ("delete", CheckpointError, r"meta/metadata' is missing"),
])
def test_corrupt_metadata(saved, tmp_path, damage, exc, pattern):
    root = _copy(saved, tmp_path)
    f = root / "2" / "meta" / "metadata"
    doc = json.loads(f.read_text())
    if damage == "truncate":
        f.write_text(f.read_text()[:200])
    elif damage == "bad_field":
        doc["step"] = "two"
        f.write_text(json.dumps(doc))
    elif damage == "other_step":
        doc["step"] = 1
        f.write_text(json.dumps(doc))
    elif damage == "bad_layout":
        doc["layout"]["tensors"][0]["shape"] = [-1]
        f.write_text(json.dumps(doc))
    elif damage == "bad_checksum_list":
        doc["checksums"]["arrays"]["params/chunk_0000"] = ["zz"]
        f.write_text(json.dumps(doc))
    else:
        f.unlink()
    _assert_fails_cleanly(root, exc, pattern)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize(
    "damage, exc, pattern",
    [
        (
            "flip_bit",
            CheckpointError,
            r"array '(params|optim)\.[a-z_.]*chunk_\d{4}' in '.*/2/state' is corrupted: elements \[\d+, \d+\) saved "
            r"by rank 0",
        ),
        ("truncate", CheckpointError, r"cannot read elements .* of array '.*chunk_\d{4}' in '.*/2/state'"),
        ("delete_array_metadata", CheckpointError, r"2/state/_METADATA' is missing"),
        (
            "drop_array",
            CheckpointFormatError,
            r"array 'params.chunk_0000' listed by the checkpoint metadata is not saved",
        ),
    ],
)
def test_corrupt_arrays(saved, tmp_path, damage, exc, pattern, staged):
    root = _copy(saved, tmp_path)
    step_dir = root / "2"
    if damage in ("flip_bit", "truncate"):
        f = _data_files(step_dir)[0]  # the largest data file
        b = bytearray(f.read_bytes())
        if damage == "flip_bit":
            b[len(b) // 2] ^= 0x01
        else:
            b = b[: len(b) // 2]
        f.write_bytes(bytes(b))
    elif damage == "delete_array_metadata":
        (step_dir / "state" / "_METADATA").unlink()
    else:
        md = step_dir / "state" / "_METADATA"
        doc = json.loads(md.read_text())
        del doc["tree_metadata"]["('params', 'chunk_0000')"]
        md.write_text(json.dumps(doc))
    # data errors surface while reading into the live shards; staged loads keep the model intact
    data_error = damage in ("flip_bit", "truncate")
    _assert_fails_cleanly(root, exc, pattern, staged=staged, model_intact=staged or not data_error)


def test_layout_not_matching_model(saved):
    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.train.gpt import GPT, GPTConfig

    wider = ZeroDDP(GPT(GPTConfig(**{**TINY, "n_embd": 64})), chunk_size=3000)
    with pytest.raises(ShapeMismatchError, match=r"'transformer.wte.weight': expected \(256, 64\), got \(256, 32\)"):
        load_checkpoint(saved, wider)
    deeper = ZeroDDP(GPT(GPTConfig(**{**TINY, "n_layer": 3})), chunk_size=3000)
    with pytest.raises(
        CheckpointError, match=r"lacks 12 tensor\(s\) of the model: 'transformer.h.2.ln_1.weight'.*pass mode='finetune'"
    ):
        load_checkpoint(saved, deeper)
    shallower = ZeroDDP(GPT(GPTConfig(**{**TINY, "n_layer": 1})), chunk_size=3000)
    with pytest.raises(CheckpointError, match=r"holds 12 tensor\(s\) the model lacks: 'transformer.h.1.ln_1.weight'"):
        load_checkpoint(saved, shallower)
    model, _ = build(seed=13)
    sgd = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    _assert_fails_cleanly(saved, CheckpointError, r"holds torch.optim.AdamW state, the optimizer is torch.optim.SGD",
                          model=model, optim=sgd)


def test_parameters_only_checkpoint(tmp_path):
    model, optim = build()
    train_step(model, optim, 1, 0)
    save_checkpoint(tmp_path / "p", model, None, step=1)
    assert read_meta(tmp_path / "p").optimizer is None
    _assert_fails_cleanly(tmp_path / "p", CheckpointError, "holds no optimizer state")
    other, _ = build(seed=14)
    load_checkpoint(tmp_path / "p", other)  # parameters only: fine
    want = {k: v for k, v in full_state(model, optim).items() if k.startswith("param/")}
    got = {k: v for k, v in full_state(other, _).items() if k.startswith("param/")}
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_bad_save_arguments_change_nothing(saved, tmp_path):
    root = _copy(saved, tmp_path)
    model, optim = build()
    before = _snapshot(root)
    with pytest.raises(CheckpointError, match="step 2 already exists"):
        save_checkpoint(root, model, optim, step=2)
    with pytest.raises(CheckpointError, match="step 0 is before the latest step 2"):
        save_checkpoint(root, model, optim, step=0)
    with pytest.raises(ConfigError, match="step must be a non-negative int"):
        save_checkpoint(root, model, optim, step=-1)
    with pytest.raises(ConfigError, match="extra must be JSON-serializable"):
        save_checkpoint(root, model, optim, step=3, extra={"x": object()})
    with pytest.raises(ConfigError, match="data_position must be JSON-serializable"):
        save_checkpoint(root, model, optim, step=3, data_position={"x": {1, 2}})
    assert _snapshot(root) == before


def test_bf16_model_and_frozen_chunk_roundtrip(tmp_path):
    """bf16 compute: fp32 masters and the frozen chunk (fp32, as it came in) come back exactly, into
    bf16 and fp32 models."""
    model, optim = build(mixed_precision="bf16")
    train_step(model, optim, 1, 0)
    save_checkpoint(tmp_path / "c", model, optim, step=1)
    meta = read_meta(tmp_path / "c")
    frozen = meta.layout.tensor("transformer.wpe.weight").chunk
    # a frozen chunk is saved in the dtype its tensors came in (fp32 here), not the compute dtype
    assert meta.mixed_precision == "bf16" and meta.expected_arrays()[("params", f"chunk_{frozen:04d}")][1] == "float32"
    want = full_state(model, optim)
    for mp in ("bf16", "fp32"):
        other, other_optim = build(mixed_precision=mp, seed=15)
        load_checkpoint(tmp_path / "c", other, other_optim)
        got = full_state(other, other_optim)
        assert all(np.array_equal(got[k], want[k]) for k in want), mp
        assert np.isfinite(train_step(other, other_optim, 2, 0))


def test_never_unpickles():
    """Static check of the checkpoint code: no pickle, no torch.load without weights_only=True."""
    paths = sorted((REPO / "chunkzero" / "checkpoint").glob("*.py")) + [REPO / "jax_backend" / "checkpoint.py"]
    paths += sorted((REPO / "torch_backend" / "checkpoint").glob("*.py")) + [
        REPO / "torch_backend" / "zero" / "collectives.py"
    ]
    assert len(paths) > 10 and all(p.exists() for p in paths)
    for path in paths:
        src = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle)\b", src, re.MULTILINE), path
        assert "allow_pickle=True" not in src, path
        for call in re.findall(r"torch\.load\(([^)]*)\)", src):
            assert "weights_only=True" in call, (path, call)
        assert "broadcast_object_list" not in src and "all_gather_object" not in src, path


def test_relative_paths_save_load_and_export(tmp_path, monkeypatch):
    """Users pass paths relative to their working directory; Orbax itself insists on absolute ones."""
    from torch_backend.checkpoint.export import export_checkpoint

    monkeypatch.chdir(tmp_path)
    model, optim = build()
    train_step(model, optim, 1, 0)
    save_checkpoint("runs/ck", model, optim, step=1)
    want = full_state(model, optim)
    model2, optim2 = build(seed=1)
    load_checkpoint("runs/ck", model2, optim2)
    got = full_state(model2, optim2)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    export_checkpoint("runs/ck", "runs/hf", format="safetensors")
    assert (tmp_path / "runs" / "hf" / "model.safetensors").is_file()
