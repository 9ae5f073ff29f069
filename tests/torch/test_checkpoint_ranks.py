"""The ranks of a save or load agree, or fail together: ranks given different directories or steps get
a typed error naming both values before anything is written (none is left waiting in Orbax), and a
load that fails on one rank — its part of the files truncated — or that resolves different steps on
two ranks raises on every rank and leaves every rank's model and optimizer bitwise unchanged."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from checkpoint_harness import assert_same_state, build, full_state, train_step

from chunkzero.errors import CheckpointError
from torch_backend._testing import run_distributed
from torch_backend.checkpoint.sharded import checkpoint_steps, load_checkpoint, save_checkpoint

AGREE_WITHIN_S = 90.0
"""A save the ranks disagree on must fail on every rank within this many seconds (no barrier wait)."""


def _failed_save(root: Path, **kwargs) -> dict:
    model, optim = kwargs.pop("model")
    t0 = time.monotonic()
    try:
        save_checkpoint(root, model, optim, timeout_s=60, **kwargs)
    except CheckpointError as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"type": None}


def _disagreeing_saves(rank, world, root):
    model, optim = build()
    train_step(model, optim, 1, rank)
    root = Path(root)
    out = {
        "directory": _failed_save(root / f"rank{rank}", step=1, model=(model, optim)),
        "step": _failed_save(root / "shared", step=1 + rank, model=(model, optim)),
    }
    save_checkpoint(root / "shared", model, optim, step=1, timeout_s=60)  # the group is still usable
    return out


def test_ranks_saving_to_different_directories_or_steps_fail_fast(tmp_path):
    out = run_distributed(_disagreeing_saves, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(out):
        d, s = r["directory"], r["step"]
        assert d["type"] == "CheckpointError" and s["type"] == "CheckpointError", (rank, r)
        assert d["seconds"] < AGREE_WITHIN_S and s["seconds"] < AGREE_WITHIN_S, (rank, r)
        assert f"rank 0 has '{tmp_path / 'rank0'}', rank 1 has '{tmp_path / 'rank1'}'" in d["message"], d["message"]
        assert "disagree on the directory of the save" in d["message"] and "nothing was written" in d["message"]
        assert "disagree on the step of the save: rank 0 has 1, rank 1 has 2" in s["message"], s["message"]
    assert not (tmp_path / "rank0").exists() and not (tmp_path / "rank1").exists()
    assert checkpoint_steps(tmp_path / "shared") == [1]


# ------------------------------------------------------------------ loads: fail together, change nothing


def _save_three_steps(rank, world, root):
    model, optim = build()
    states = {}
    for step in (1, 2, 3):
        train_step(model, optim, step, rank)
        save_checkpoint(root, model, optim, step=step)
        states[step] = full_state(model, optim)
    return states[2] if rank == 0 else None


def _failing_loads(rank, world, root, want2):
    model, optim = build(seed=11)
    train_step(model, optim, 1, rank)  # live optimizer state: there is something to leave unchanged
    before = full_state(model, optim)
    out = {}
    for case, kwargs in (("truncated", {}), ("other_steps", {"step": 1 + rank})):
        try:
            load_checkpoint(root, model, optim, **kwargs)
            out[case] = None
        except CheckpointError as e:
            out[case] = str(e)
        after = full_state(model, optim)
        out[f"{case}_unchanged"] = sorted(after) == sorted(before) and all(
            np.array_equal(after[k], before[k]) for k in before
        )
    load_checkpoint(root, model, optim, step=2)  # a good step still loads, on both ranks
    state = full_state(model, optim)
    if rank == 0:
        assert_same_state(state, want2, "step 2 after the failed loads")
    return out


def _truncate_rank_data(step_dir: Path, process: int) -> Path:
    """Cut in half the largest data file that process ``process`` wrote (only its own shards live there)."""
    files = [
        p for p in (step_dir / "state" / f"ocdbt.process_{process}").rglob("*") if p.is_file() and p.parent.name == "d"
    ]
    assert files, sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*"))
    f = max(files, key=lambda p: p.stat().st_size)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f


def test_a_load_failing_on_one_rank_fails_on_all_and_changes_no_model(tmp_path):
    root = tmp_path / "ckpt"
    want2 = run_distributed(_save_three_steps, 2, str(root))[0]
    _truncate_rank_data(root / "3", 1)
    out = run_distributed(_failing_loads, 2, str(root), want2)
    r0, r1 = out
    assert "cannot read elements" in r1["truncated"] and f"{root / '3' / 'state'}" in r1["truncated"], r1
    assert (
        r0["truncated"].startswith("rank 1 failed to read the checkpoint under")
        and "no rank's model was changed" in r0["truncated"]
    )
    for r in out:
        assert "ranks disagree on the step directory of the load" in r["other_steps"], r["other_steps"]
        assert f"rank 0 has '{root / '1'}', rank 1 has '{root / '2'}'" in r["other_steps"]
        assert r["truncated_unchanged"] and r["other_steps_unchanged"], r


# ------------------------------------------------------------------ saves: ranks that hold different optimizer state


def _save_with_a_stateless_rank(rank, world, root):
    """One chunk of 16 elements at W = 2: rank 0's half is ``idle`` (a module's own parameters come before
    its children's), which never gets a gradient (``find_unused_parameters``), so rank 0 holds no
    optimizer state at all; rank 1's half is ``used.weight``."""
    import torch

    from torch_backend import ZeroDDP, ZeroOptimizer

    class Half(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(4, 2, bias=False)
            self.idle = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    model = ZeroDDP(Half(), chunk_size=16, find_unused_parameters=True)
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-6)
    assert len(model.chunks) == 1 and model.layout.owned_range("idle", rank=0) == (0, 8)
    optim.backward(model(torch.randn(3, 4)).square().sum())
    optim.step()
    save_checkpoint(root, model, optim, step=1, timeout_s=60)
    again = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, eps=1e-6)
    meta = load_checkpoint(root, model, again, load_rng=False)
    return {"keys": meta.optimizer.state_keys, "step": meta.optimizer.step, "tensor_steps": meta.optimizer.tensor_steps,
            "exp_avg": [float(v) for v in again.shard_state(0).get("exp_avg", [])]}


def test_a_rank_without_optimizer_state_saves_with_the_others(tmp_path):
    """Each rank saves the same arrays and metadata although only rank 1 holds AdamW state: the state keys
    and the step are agreed, and rank 0's part of ``exp_avg`` is zeros (no state, as torch keeps none)."""
    out = run_distributed(_save_with_a_stateless_rank, 2, str(tmp_path / "c"), timeout=300)
    assert out[0]["keys"] == out[1]["keys"] == ["exp_avg", "exp_avg_sq"], out
    assert out[0]["step"] == out[1]["step"] == 1 and out[0]["tensor_steps"] == {"idle": 0}, out
    assert any(v != 0 for v in out[1]["exp_avg"]) and out[0]["exp_avg"] in ([], [0.0] * 8), out
