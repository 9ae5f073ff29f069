"""``chunkzero export`` / ``chunkzero inspect`` and weight import, end to end on a tiny Hugging Face GPT-2:
train with ZeroDDP, save a chunk checkpoint, export to safetensors (single file, sharded, bf16) and
load it with ``transformers`` ``from_pretrained``; export to an Orbax parameter tree and restore it
with ``StandardCheckpointer``; import weights back into ZeroDDP from safetensors and state dicts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from tiny_models import hf_gpt2_config

from chunkzero.cli import main as cli
from chunkzero.errors import CheckpointError, ConfigError, ShapeMismatchError

transformers = pytest.importorskip("transformers")


def _zero(seed, chunk_size=3000):
    from torch_backend import ZeroDDP, ZeroOptimizer

    torch.manual_seed(seed)
    model = ZeroDDP(transformers.GPT2LMHeadModel(hf_gpt2_config()), chunk_size=chunk_size)
    return model, ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(checkpoint root, full fp32 state dict)`` of a tiny GPT-2 after two ZeroDDP steps."""
    from torch_backend.checkpoint.sharded import save_checkpoint

    model, optim = _zero(0)
    for i in range(2):
        x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(i))
        optim.backward(model(x, labels=x).loss)
        optim.step()
        optim.zero_grad()
    root = tmp_path_factory.mktemp("export") / "ckpt"
    save_checkpoint(root, model, optim, step=2)  # model_config: the HF config, taken from the module
    return root, model.state_dict()


def _assert_hf_equal(hf, want, dtype=torch.float32):
    got = hf.state_dict()
    for k, v in want.items():
        assert k in got, k
        assert torch.equal(got[k], v.to(dtype)), k
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # re-tied


def test_safetensors_export_loads_with_from_pretrained(trained, tmp_path, capsys):
    root, want = trained
    out = tmp_path / "hf"
    assert cli(["export", str(root), "--format", "safetensors", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # tied: saved once
    hf = transformers.GPT2LMHeadModel.from_pretrained(out)
    _assert_hf_equal(hf, want)
    x = torch.randint(0, 96, (1, 8))
    ref = transformers.GPT2LMHeadModel(hf_gpt2_config())
    ref.load_state_dict(want)
    hf.eval(), ref.eval()
    # bitwise: the same weights through the same attention kernel on both sides
    assert hf.config._attn_implementation == ref.config._attn_implementation
    assert torch.equal(hf(x).logits, ref(x).logits)

    sharded = tmp_path / "hf-sharded"
    assert cli(["export", str(root), "--format", "safetensors", str(sharded), "--max-shard-size", "20KB"]) == 0
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((sharded / f).is_file() for f in files)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for k, v in want.items() if k != "lm_head.weight")
    _assert_hf_equal(transformers.GPT2LMHeadModel.from_pretrained(sharded), want)

    half = tmp_path / "hf-bf16"
    assert cli(["export", str(root), "--format", "safetensors", str(half), "--dtype", "bfloat16"]) == 0
    _assert_hf_equal(transformers.GPT2LMHeadModel.from_pretrained(half, dtype=torch.bfloat16), want, torch.bfloat16)

    capsys.readouterr()
    assert cli(["export", str(root), "--format", "safetensors", str(out)]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err
    assert cli(["export", str(tmp_path / "missing"), "--format", "safetensors", str(tmp_path / "x")]) == 2
    assert cli(["export", str(root), "--format", "safetensors", str(tmp_path / "y"), "--step", "9"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "no committed step 9" in err and len(err.strip().splitlines()) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()

    blocker = tmp_path / "a-file"  # an output that cannot be created: one line each, exit 2, nothing left
    blocker.write_text("")
    for fmt in ("safetensors", "orbax-params"):
        assert cli(["export", str(root), "--format", fmt, str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("a-file/sub' cannot be written" in line for line in err), err
    assert blocker.read_text() == "" and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    # an output inside the checkpoint directory, where a run's --keep would delete it with an old step
    inside = [root / "2" / "hf", root / "hf"]
    for out_dir in inside:
        assert cli(["export", str(root), "--format", "safetensors", str(out_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("is inside the checkpoint directory" in line for line in err), err
    assert not (root / "2" / "hf").exists() and not (root / "hf").exists()


def test_orbax_params_export_restores_with_standard_checkpointer(trained, tmp_path):
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    root, want = trained
    out = tmp_path / "params"
    assert cli(["export", str(root), "--format", "orbax-params", str(out)]) == 0
    tree = ocp.StandardCheckpointer().restore(out.absolute())
    assert sorted(tree) == ["transformer"]  # lm_head.weight is tied to transformer.wte.weight: saved once
    layer = tree["transformer"]["h"]["1"]["mlp"]["c_fc"]["weight"]
    assert isinstance(layer, np.ndarray) and np.array_equal(layer, want["transformer.h.1.mlp.c_fc.weight"].numpy())
    flat = {".".join(str(k.key) for k in path): v for path, v in jax.tree_util.tree_leaves_with_path(tree)}
    assert sorted(flat) == sorted(k for k in want if k != "lm_head.weight")
    assert all(np.array_equal(v, want[k].numpy()) for k, v in flat.items())

    mesh = Mesh(np.array(jax.devices()), ("dp",))  # 8 simulated devices: shard the first axis where it divides
    def target(a):
        spec = P("dp") if a.shape and a.shape[0] % mesh.size == 0 else P()
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
    sharded = ocp.StandardCheckpointer().restore(out.absolute(), jax.tree.map(target, tree))
    wte = sharded["transformer"]["wte"]["weight"]
    assert isinstance(wte, jax.Array) and wte.sharding.spec == P("dp") and len(wte.addressable_shards) == mesh.size
    assert np.array_equal(np.asarray(wte), want["transformer.wte.weight"].numpy())


def test_export_streams_one_chunk_at_a_time(trained, tmp_path, monkeypatch):
    from torch_backend.checkpoint import sharded as ck
    from torch_backend.checkpoint.export import export_checkpoint

    root, _ = trained
    reads = []
    original = ck.ChunkReader.read

    def counting(self, path, start=0, stop=None):
        reads.append(path)
        return original(self, path, start, stop)

    monkeypatch.setattr(ck.ChunkReader, "read", counting)
    for fmt in ("safetensors", "orbax-params"):
        reads.clear()
        report = export_checkpoint(root, tmp_path / fmt, format=fmt)
        meta = ck.read_meta(root)
        assert sorted(reads) == sorted(("params", f"chunk_{c.index:04d}") for c in meta.layout.chunks), fmt
        assert report.aliases == {"lm_head.weight": "transformer.wte.weight"}
    with pytest.raises(ConfigError, match="unknown export format"):
        export_checkpoint(root, tmp_path / "z", format="npz")
    with pytest.raises(ConfigError, match="export dtype must be one of"):
        export_checkpoint(root, tmp_path / "z", dtype="int8")


def test_export_of_a_corrupted_step_names_the_step_to_export_instead(tmp_path, capsys):
    """A flipped bit in the latest step's parameters: export refuses it in one line naming the array, the step
    and ``--step`` of the newest older one, writes nothing, and exports that older step when asked."""
    from torch_backend.checkpoint.sharded import save_checkpoint

    from .helpers import flip_saved_bit

    model, optim = _zero(0)
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        save_checkpoint(root, model, optim, step=step)
    flip_saved_bit(root / "3", ("params", "chunk_0000"))

    def refused(*args, fmt="safetensors"):
        capsys.readouterr()
        assert cli(["export", *args, "--format", fmt, str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists(), err
        assert "array 'params.chunk_0000'" in err and "is corrupted" in err, err
        return err

    err = refused(str(root))
    assert "error: step 3 cannot be exported: " in err and "/ckpt/3/state" in err, err
    assert refused(str(root), fmt="orbax-params") == err
    # as a user runs it: Orbax's save threads, which write the tree, logged the failed read with tracebacks
    import subprocess

    from .helpers import chunkzero_cmd, clean_env

    proc = subprocess.run(chunkzero_cmd("export", str(root), "--format", "orbax-params", str(tmp_path / "out")),
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == err, proc.stderr[-3000:]
    assert err.endswith("; to export step 2 instead, pass --step 2"), err  # the newest older step
    assert refused(str(root / "3")).endswith(f"pass --step 2 with the checkpoint root {str(root)!r}")
    flip_saved_bit(root / "1", ("params", "chunk_0000"))
    assert refused(str(root), "--step", "1").endswith("; to export step 3 instead, pass --step 3")  # none older
    assert cli(["export", str(root), "--step", "2", "--format", "safetensors", str(tmp_path / "out")]) == 0
    assert "exported step 2" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "out")
    for step in (2, 3):
        shutil.rmtree(root / str(step))
    assert refused(str(root)).endswith("no other committed step is saved to export instead")


def test_import_into_zero_ddp(trained, tmp_path):
    from torch_backend.checkpoint.export import export_checkpoint, load_pretrained

    root, want = trained
    export_checkpoint(root, tmp_path / "st", format="safetensors", max_shard_size="30KB")

    model, _ = _zero(1, chunk_size=5000)  # another chunk size: weights map by name
    report = load_pretrained(model, tmp_path / "st")
    assert report.missing_keys == [] and report.unexpected_keys == [] and report.loaded == len(model.layout.tensors)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())

    # a full torch state dict file (weights_only), under a prefix, with only the tied alias present
    wrapped = {f"model.{k}": v for k, v in want.items() if k != "transformer.wte.weight"}
    wrapped["other.head.weight"] = torch.zeros(3)  # outside the prefix: ignored
    torch.save(wrapped, tmp_path / "full.pt")
    model, _ = _zero(2)
    report = load_pretrained(model, tmp_path / "full.pt", prefix="model.")
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())

    # strict: missing and unexpected keys are reported and nothing is loaded
    partial = {k: v for k, v in want.items() if not k.startswith("transformer.h.1.")}
    partial["transformer.h.9.attn.c_proj.bias"] = torch.zeros(32)
    model, _ = _zero(3)
    before = model.state_dict()
    with pytest.raises(
        CheckpointError,
        match=r"missing keys: transformer\.h\.1\..*unexpected keys: transformer\.h\.9\.attn\.c_proj\.bias",
    ):
        load_pretrained(model, partial)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    report = load_pretrained(model, partial, strict=False)
    assert "transformer.h.1.mlp.c_fc.weight" in report.missing_keys
    assert report.unexpected_keys == ["transformer.h.9.attn.c_proj.bias"]
    sd = model.state_dict()
    assert torch.equal(sd["transformer.h.0.mlp.c_fc.weight"], want["transformer.h.0.mlp.c_fc.weight"])
    assert torch.equal(sd["transformer.h.1.mlp.c_fc.weight"], before["transformer.h.1.mlp.c_fc.weight"])

    bad = dict(want)
    bad["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(32, 64)
    with pytest.raises(
        ShapeMismatchError, match=r"'transformer.h.0.mlp.c_fc.weight': expected \(32, 128\), got \(32, 64\)"
    ):
        load_pretrained(model, bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(model, tmp_path / "nothing.safetensors")
    (tmp_path / "pickled.pt").write_bytes(b"\x80\x04\x95not a weights-only file")
    with pytest.raises(CheckpointError, match="weights-only torch state dict"):
        load_pretrained(model, tmp_path / "pickled.pt")


def test_inspect(trained, tmp_path, capsys):
    root, want = trained
    capsys.readouterr()
    assert cli(["inspect", str(root)]) == 0
    text = capsys.readouterr().out
    assert "step 2" in text and "world size 1" in text and "torch.optim.AdamW" in text
    assert "transformer.wte.weight" in text and "(= lm_head.weight)" in text
    assert cli(["inspect", str(root / "2"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 2 and info["world_size"] == 1 and info["steps"] == [2]
    assert info["parameters"] == sum(v.numel() for k, v in want.items() if k != "lm_head.weight")
    assert {t["name"]: tuple(t["shape"]) for t in info["tensors"]}["transformer.h.0.attn.c_attn.weight"] == (32, 96)
    assert info["optimizer"]["state_keys"] == ["exp_avg", "exp_avg_sq"] and info["model_config"]["model_type"] == "gpt2"
    run = tmp_path / "run"  # a `chunkzero train` run folder: its checkpoints/ are inspected
    run.mkdir()
    (run / "checkpoints").symlink_to(root, target_is_directory=True)
    assert cli(["inspect", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    assert cli(["export", "--format", "safetensors", str(run), str(tmp_path / "from-run")]) == 0
    assert "exported step 2" in capsys.readouterr().out
    assert cli(["inspect", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_train_save_interval_resume_and_export(tmp_path):
    """``chunkzero train --save-interval`` writes checkpoints; ``--resume`` continues bitwise from the
    latest (steps 5-6 after resuming at 4 equal the uninterrupted run's); ``chunkzero export`` reads them."""
    from .helpers import SMALL, make_corpus, read_metrics, run_train

    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    args = ["--data", str(corpus), *SMALL, "--steps", "6", "--eval-interval", "6", "--nproc", "2", "--out", str(out)]
    first = run_train(*args, "--save-interval", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    from torch_backend.checkpoint.sharded import checkpoint_steps, read_meta

    assert checkpoint_steps(out / "checkpoints") == [2, 4, 6]
    meta = read_meta(out / "checkpoints")
    assert meta.world_size == 2 and meta.data_position["sampler"]["index"] == 6
    uninterrupted = {r["step"]: r["loss"] for r in read_metrics(out)[0]}

    import shutil

    shutil.rmtree(out / "checkpoints" / "6")  # as if the run had died after step 4's checkpoint
    (out / "loss.png").unlink()
    second = run_train(*args, "--save-interval", "2", "--resume", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "re-stretched" not in second.stderr  # same --steps/--warmup/--lr: no schedule warning
    assert "BasePyTreeCheckpointHandler" not in second.stderr + (out / "train.log").read_text()
    train_records, val_records = read_metrics(out)
    # The earlier session's records after the checkpoint (steps 5-6, val 6) are replaced by the resumed run's.
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in train_records[4:]] == [uninterrupted[5], uninterrupted[6]]
    val_steps = [r["step"] for r in val_records]
    assert len(val_steps) == len(set(val_steps)) and val_steps[0] == 0, val_steps
    assert checkpoint_steps(out / "checkpoints") == [2, 4, 6]
    summary = (out / "summary.txt").read_text()
    assert f"{train_records[0]['loss']:.4f} (step 1) → " in summary
    assert f"{val_records[0]['val_loss']:.4f} (step 0) → " in summary, summary
    assert (out / "loss.png").stat().st_size > 0

    assert cli(["export", str(out / "checkpoints"), "--format", "safetensors", str(tmp_path / "exported")]) == 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "exported" / "model.safetensors"), framework="pt") as f:
        assert "transformer.wte.weight" in f.keys()
    bad = run_train("--data", str(corpus), *SMALL, "--steps", "2", "--nproc", "2", "--out", str(tmp_path / "fresh"),
                    "--resume", cwd=tmp_path)
    assert bad.returncode == 2 and "holds no checkpoint" in bad.stderr


def test_resume_says_what_happens_to_the_lr_schedule(caplog):
    """``--resume`` with a larger ``--steps``: ``--schedule keep`` follows the saved schedule (an info line naming
    the choice, no LR jump); ``--schedule stretch`` re-stretches the cosine (a warning with the LR jump); another
    ``--lr`` warns either way; the same settings say nothing."""
    import dataclasses
    import logging

    from chunkzero.train_config import TrainConfig, lr_at, warn_schedule_change

    saved = {"steps": 200, "warmup": 10, "lr": 3e-3}
    keep = TrainConfig(steps=300, warmup=10, lr=3e-3, schedule="keep", schedule_steps=200)
    stretch = dataclasses.replace(keep, schedule="stretch", schedule_steps=300)
    with caplog.at_level(logging.INFO, logger="chunkzero.train"):
        warn_schedule_change({**saved, "steps": 300}, "checkpoint 200", stretch, 200)
        assert not caplog.records
        warn_schedule_change(saved, "checkpoint 200", keep, 200)
        warn_schedule_change(saved, "checkpoint 200", stretch, 200)
        warn_schedule_change(saved, "checkpoint 200", dataclasses.replace(keep, lr=1e-3), 200)
    kept, stretched, other_lr = caplog.records
    before = lr_at(199, TrainConfig(steps=200, warmup=10, lr=3e-3))
    assert lr_at(200, keep) == lr_at(299, keep) == before  # the saved schedule's final LR, constant
    assert kept.levelno == logging.INFO and "--steps 300 (was 200)" in kept.getMessage()
    assert "--schedule keep" in kept.getMessage() and "--schedule stretch would" in kept.getMessage()
    assert f"{before:.3g} at step 200 to {before:.3g} at step 201" in kept.getMessage()
    text = stretched.getMessage()
    assert stretched.levelno == logging.WARNING and "--schedule stretch" in text and "checkpoint 200" in text
    assert f"{before:.3g} at step 200 to {lr_at(200, stretch):.3g} at step 201" in text
    assert lr_at(200, stretch) > 3 * before
    assert other_lr.levelno == logging.WARNING and "--lr 0.001 (was 0.003)" in other_lr.getMessage()
    # a smaller --steps under keep: the run ends before the saved decay does (said before as an info line)
    caplog.clear()
    shrunk = TrainConfig(steps=130, warmup=10, lr=3e-3, schedule="keep", schedule_steps=2000)
    with caplog.at_level(logging.INFO, logger="chunkzero.train"):
        warn_schedule_change({**saved, "steps": 2000}, "checkpoint 120", shrunk, 120)
    (short,) = caplog.records
    assert short.levelno == logging.WARNING and "--steps 130 (was 2000)" in short.getMessage()
    assert f"ends at step 130 with the LR still at {lr_at(129, shrunk):.3g}" in short.getMessage()
    assert lr_at(129, shrunk) > 0.9 * 3e-3  # still near the peak: the decay over 2000 steps has barely begun
