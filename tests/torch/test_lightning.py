"""``chunkzero.lightning.ZeroStrategy`` under Lightning's own Trainer and launcher.

- a tiny GPT LightningModule trained 3 steps at W = 2 (``devices=2, accelerator="cpu"``: Lightning's
  subprocess launcher re-runs ``lightning_run.py`` for rank 1), with 2 accumulated micro-batches per step,
  ``gradient_clip_val`` and a warm-up ``LambdaLR``, equals bit for bit the same micro-batches in a plain
  ZeroDDP + ZeroOptimizer loop (``no_sync``, ``max_norm``, the same scheduler);
- its ``Trainer.save_checkpoint`` is a chunkzero checkpoint: ``fit(ckpt_path=)`` at W = 1 restores the
  weights, optimizer step and LR exactly, and its next 2 steps equal a plain ZeroDDP loop that loads the
  same checkpoint with ``load_checkpoint``;
- ``ZeroStrategy(shard_group_size=2)`` at 4 devices takes Lightning's own sampler's batches and equals a
  single-process plain-torch run of the same global batches within fp32 noise over 5 steps (each micro-batch's
  loss and the final weights); its checkpoint records 2 replicas and resumes flat at 2 devices;
- in the same runs, ``ZeroEMACallback`` (a sharded EMA, under hybrid sharding and again after the flat resume)
  equals torch's ``AveragedModel`` with ``get_ema_multi_avg_fn`` on that plain-torch run; validation on the EMA
  weights gives the AveragedModel's losses, and training goes on from the live weights;
- the pieces without a Trainer: precision mapping, the optimizer conversion, Lightning's state as JSON.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("lightning")

from chunkzero.checkpoint import read_meta  # noqa: E402
from chunkzero.errors import CheckpointError, ConfigError  # noqa: E402
from torch_backend import ZeroDDP, ZeroOptimizer  # noqa: E402
from torch_backend._testing import run_distributed  # noqa: E402
from torch_backend.checkpoint.sharded import load_checkpoint  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import lightning_run as run  # noqa: E402


def _script(phase: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "lightning_run.py"), phase, str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _result(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    _script("train", out)
    return out, [_result(out, f"train_rank{r}") for r in (0, 1)]


class Holder(nn.Module):
    """The GPT under the LightningModule's attribute name, so the tensors have the same names."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = run.GPT(run.GPTConfig(**run.CFG))

    def forward(self, x):
        return self.model(x)


def _plain(max_norm=run.CLIP):
    model = ZeroDDP(Holder(), chunk_size=3000)
    decay = [p for p in model.module.parameters() if p.dim() >= 2]
    other = [p for p in model.module.parameters() if p.dim() < 2]
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=run.LR, eps=1e-6, max_norm=max_norm, param_groups=[
        {"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.LambdaLR(optim, run.warmup)
    return model, optim, sched


def _plain_steps(model, optim, sched, seen: list[list[int]]) -> list[float]:
    """One step per ``ACCUM`` micro-batches (sample ids), the first ones under ``no_sync``."""
    losses = []
    for s in range(0, len(seen), run.ACCUM):
        for j, ids in enumerate(seen[s : s + run.ACCUM]):
            x = torch.stack([run.sample(i) for i in ids])
            loss = F.cross_entropy(model(x).reshape(-1, 256), torch.roll(x, -1, 1).reshape(-1))
            losses.append(loss.item())
            if j < run.ACCUM - 1:
                with model.no_sync():
                    optim.backward(loss / run.ACCUM)
            else:
                optim.backward(loss / run.ACCUM)
        optim.step()
        optim.zero_grad()
        sched.step()
    return losses


def _plain_at_two(rank, world, seen_by_rank):
    torch.set_num_threads(1)
    model, optim, sched = _plain()
    losses = _plain_steps(model, optim, sched, seen_by_rank[rank])
    state = model.state_dict()  # collective: every rank gathers
    return {"losses": losses, "state": state if rank == 0 else None}


def test_zero_strategy_equals_a_plain_zeroddp_loop_at_world_size_two(trained):
    _, ranks = trained
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["global_step"] == 3
    assert ranks[0]["max_norm"] == run.CLIP and ranks[0]["mixed_precision"] == "fp32"
    seen = [r["seen"] for r in ranks]
    assert all(len(s) == 3 * run.ACCUM for s in seen)  # 3 steps of 2 micro-batches on each rank
    assert sorted(i for s in seen for b in s for i in b) == list(range(run.SAMPLES))  # a partition of the data
    ref = run_distributed(_plain_at_two, 2, seen, timeout=240)
    for r in (0, 1):
        assert ranks[r]["losses"] == ref[r]["losses"], r
    assert ranks[0]["lrs"][::run.ACCUM] == [run.LR * run.warmup(s) for s in range(3)]  # the scheduler kept
    got, want = ranks[0]["state"], ref[0]["state"]
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert torch.equal(ranks[1]["state"]["model.lm_head.weight"], got["model.lm_head.weight"])


def test_lightning_checkpoint_resumes_at_world_size_one(trained):
    out, ranks = trained
    _script("resume", out)
    res = _result(out, "resume_rank0")
    restored = res["restored"]
    assert res["world_size"] == 1 and restored["global_step"] == 3 and restored["optim_steps"] == 3
    assert restored["lr"] == [run.LR * run.warmup(3)] * 2
    for k, v in ranks[0]["state"].items():  # the weights of the W = 2 run at its end, exactly
        assert torch.equal(restored["state"][k], v), k
    assert res["global_step"] == 5 and len(res["seen"]) == 2 * run.ACCUM

    with _one_thread():  # the kernels' summation order of the script's rank
        model, optim, sched = _plain()  # the same checkpoint in a plain loop at W = 1
        for _ in range(3):  # the schedule at step 3 (load_checkpoint restores the groups' lr too)
            optim._opt_called = True  # noqa: SLF001 - silence torch's "scheduler before optimizer" warning
            sched.step()
        meta = load_checkpoint(out / "ckpt", model, optim)
        assert meta.step == 3 and optim.step_count == 3
        losses = _plain_steps(model, optim, sched, res["seen"])
    assert res["losses"] == losses
    want = model.state_dict()
    for k in want:
        assert torch.equal(res["state"][k], want[k]), k


# ------------------------------------------------------------------ hybrid sharding against one process


def _max_diff(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max(float((got[k] - want[k]).abs().max()) for k in want)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_hybrid")
    _script("hybrid4", out)
    return out, [_result(out, f"hybrid4_rank{r}") for r in range(4)]


@pytest.mark.slow
def test_hybrid_zero_strategy_equals_one_process_torch_at_four_devices(hybrid):
    """4 devices as 2 replicas of 2-rank shard groups against plain torch in one process over the same global
    batches (the gradient averaged over ranks and micro-batches is the full batch's): each rank's micro-batch
    losses and the weights after 5 steps; the EMA callback against ``AveragedModel`` over the same steps, and the
    validation at the epoch's end on the EMA weights, each rank's share of the validation samples."""
    out, zero = hybrid
    assert [z["world_size"] for z in zero] == [4] * 4 and [z["replicas"] for z in zero] == [2] * 4
    assert zero[0]["global_step"] == 5
    assert all(len(z["seen"]) == 5 * run.ACCUM for z in zero)
    assert sorted(i for z in zero for b in z["seen"] for i in b) == list(range(80))  # Lightning's sampler: a partition
    steps = _global_steps(zero)
    probes = [[b for z in zero for b in z["seen"][s * run.ACCUM:(s + 1) * run.ACCUM]] for s in range(len(steps))]
    with _one_thread():
        live, averaged, losses = _averaged_reference(steps, probes)
        validation = _check_validation([v for z in zero for v in z["vals"]], averaged, live)
    for rank, z in enumerate(zero):
        want = [losses[s][rank * run.ACCUM + m] for s in range(len(steps)) for m in range(run.ACCUM)]
        assert np.abs(np.subtract(z["losses"], want)).max() < 1e-5, (rank, z["losses"], want)
    assert _max_diff(zero[0]["state"], live.state_dict()) < 1e-5  # (validation left the live weights in place)
    assert _max_diff(zero[0]["state"], _initial_state()) > 1e-2  # the weights moved: the comparison can fail
    assert [z["ema_updates"] for z in zero] == [5] * 4
    assert _max_diff(zero[0]["ema_state"], averaged.state_dict()) < 1e-5
    assert _max_diff(zero[0]["ema_state"], live.state_dict()) > 1e-3  # the EMA is not the weights
    assert validation < 1e-5
    assert sorted(i for z in zero for ids, _ in z["vals"] for i in ids) == list(run.VAL_IDS)
    meta = read_meta(out / "hybrid_ckpt" / "5")
    assert meta.replicas == 2 and meta.layout.world_size == 2  # each shard once, by replica 0's 2 ranks


@pytest.mark.slow
def test_hybrid_checkpoint_resumes_flat_at_two_devices(hybrid):
    out, zero = hybrid
    _script("hybrid_resume2", out)
    res = [_result(out, f"hybrid_resume2_rank{r}") for r in (0, 1)]
    restored = res[0]["restored"]
    assert res[0]["world_size"] == 2 and res[0]["replicas"] == 1
    assert restored["global_step"] == 5 and restored["optim_steps"] == 5
    for k, v in zero[0]["state"].items():  # the 4-device hybrid run's weights (the live ones, not the EMA), exactly
        assert torch.equal(restored["state"][k], v), k
    assert res[0]["global_step"] == 6 and res[0]["ema_updates"] == 6
    with _one_thread():  # the EMA went on from the checkpoint's; trainer.validate after fit used it
        live, averaged, _ = _averaged_reference(_global_steps(zero) + _global_steps(res))
        assert _max_diff(res[0]["ema_state"], averaged.state_dict()) < 1e-5
        assert _check_validation(res[0]["vals"] + res[1]["vals"], averaged, live) < 1e-5


def _initial_state() -> dict:
    return Holder().state_dict()


# ------------------------------------------------------------------ the one-process reference, with the EMA


@contextlib.contextmanager
def _one_thread():
    """One torch thread, as each rank has: the references' reductions run in the ranks' order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _averaged_reference(steps: list[list[int]], probes: list[list[list[int]]] | None = None):
    """Plain torch, one process: AdamW over the same global batches (sample ids per step), clipping and
    schedule, and an ``AveragedModel`` with ``get_ema_multi_avg_fn`` updated after each step.

    Returns ``(model, averaged model, losses)``: ``losses[s]`` are the losses of the batches ``probes[s]``
    (lists of sample ids) at step ``s``'s weights, before its update (empty without ``probes``)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = Holder()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=run.LR, eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, run.warmup)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(run.DECAY), use_buffers=False)
    averaged.update_parameters(model)  # the first update copies: the EMA starts at the initial weights
    losses = []
    for s, ids in enumerate(steps):
        with torch.no_grad():
            losses.append([run.loss_of(model, torch.stack([run.sample(i) for i in b])).item()
                           for b in (probes[s] if probes else ())])
        run.loss_of(model, torch.stack([run.sample(i) for i in ids])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.CLIP)
        opt.step()
        opt.zero_grad()
        sched.step()
        averaged.update_parameters(model)
    return model, averaged.module, losses


def _global_steps(ranks: list[dict]) -> list[list[int]]:
    """Each optimizer step's samples over all ranks and micro-batches."""
    n = len(ranks[0]["seen"]) // run.ACCUM
    return [[i for r in ranks for b in r["seen"][s * run.ACCUM:(s + 1) * run.ACCUM] for i in b] for s in range(n)]


def _check_validation(vals, ema_model, live_model) -> float:
    """The validation losses against the EMA model's; returns the largest difference."""
    assert vals
    worst = 0.0
    with torch.no_grad():
        for ids, loss in vals:
            x = torch.stack([run.sample(i) for i in ids])
            want = run.loss_of(ema_model, x).item()
            assert abs(loss - run.loss_of(live_model, x).item()) > 1e-3  # not the live weights
            worst = max(worst, abs(loss - want))
    return worst


# ------------------------------------------------------------------ the pieces, without a Trainer


def test_public_name_and_precision_mapping():
    import chunkzero.lightning
    from torch_backend.lightning import ZeroStrategy, mixed_precision_of

    assert chunkzero.lightning.ZeroStrategy is ZeroStrategy
    assert [mixed_precision_of(p) for p in ("32-true", "bf16-mixed", "16-mixed")] == ["fp32", "bf16", "fp16"]
    for bad in ("bf16-true", "16-true", "64-true"):
        with pytest.raises(ConfigError, match=bad):
            mixed_precision_of(bad)


def test_optimizer_conversion_keeps_class_groups_and_scheduler_lr():
    from torch_backend.lightning import zero_optimizer_from

    model = ZeroDDP(Holder(), chunk_size=3000)
    decay = [p for p in model.module.parameters() if p.dim() >= 2]
    other = [p for p in model.module.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0, "lr": 3e-3}],
        lr=1e-2,
        eps=1e-6,
        betas=(0.8, 0.9),
    )
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)  # sets lr and initial_lr in the groups
    zero = zero_optimizer_from(model, opt, max_norm=0.25)
    assert type(zero.optimizer) is torch.optim.AdamW and zero.max_norm == 0.25
    assert zero.param_groups[0]["fused"] is True  # unset kernel flags take ZeroOptimizer's default
    for new, old in zip(zero.param_groups, opt.param_groups, strict=True):
        for k in ("lr", "initial_lr", "weight_decay", "betas", "eps"):
            assert new[k] == old[k], k
    assert [g["lr"] for g in zero.param_groups] == [5e-3, 1.5e-3]
    with pytest.raises(ConfigError):  # a group that leaves out trainable parameters
        zero_optimizer_from(model, torch.optim.AdamW(decay, lr=1e-2), max_norm=None)


def test_lightning_state_as_json_round_trip_and_refusals():
    import json

    from torch_backend.lightning_state import from_json, to_json

    state = {"epoch": 1, "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.25),
                                                                             "kth_value": torch.tensor(float("inf"))}},
             "loops": {"fit_loop": {"progress": (1, 2)}}, "hyper_parameters": {"lr": 1e-3, "name": "gpt"}}
    back = from_json(json.loads(json.dumps(to_json(state), allow_nan=False)))
    assert back["loops"] == {"fit_loop": {"progress": [1, 2]}} and back["hyper_parameters"] == state["hyper_parameters"]
    cb = back["callbacks"]["ModelCheckpoint{'monitor': None}"]
    assert torch.equal(cb["best_model_score"], torch.tensor(0.25)) and cb["kth_value"].item() == float("inf")
    with pytest.raises(ConfigError, match=r"hyper_parameters\.net"):
        to_json({"hyper_parameters": {"net": nn.Linear(1, 1)}})


def test_ckpt_path_that_is_not_a_chunkzero_checkpoint(tmp_path):
    from torch_backend.lightning import ZeroStrategy

    pickle_file = tmp_path / "last.ckpt"
    pickle_file.write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="last.ckpt"):
        ZeroStrategy().load_checkpoint(pickle_file)


def test_manual_optimization_takes_the_steps_of_automatic_optimization(tmp_path):
    _script("manual1", tmp_path)
    res = _result(tmp_path, "manual1_rank0")
    auto, manual = res["auto"], res["manual"]
    assert auto["global_step"] == manual["global_step"] == 4 and len(manual["losses"]) == 4
    assert manual["losses"] == auto["losses"] and manual["lrs"] == auto["lrs"]  # the same kernels: the same bits
    assert manual["losses"][0] != manual["losses"][-1]
    for k, v in auto["state"].items():
        assert torch.equal(manual["state"][k], v), k


def test_hybrid_and_several_optimizers_and_ema_refusals():
    from types import SimpleNamespace

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from chunkzero.lightning import ZeroEMACallback, ZeroStrategy
    from torch_backend.lightning import _check_divides

    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="shard_group_size"):
            ZeroStrategy(shard_group_size=bad)
    with pytest.raises(ConfigError, match=r"shard_group_size=4\) does not divide the 6 devices"):
        _check_divides(4, 6)
    _check_divides(3, 6)
    with pytest.raises(ConfigError, match="ZeroStrategy"):
        ZeroEMACallback(0.9).setup(SimpleNamespace(strategy=DDPStrategy()), None, "fit")
    for bad in (1.0, -0.1, "0.9"):
        with pytest.raises(ConfigError, match="decay"):
            ZeroEMACallback(bad)
    with pytest.raises(ConfigError, match="no EMA before trainer.fit"):
        ZeroEMACallback(0.9, validate_on_ema=True).on_validation_start(None, None)

    class TwoOptimizers(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
            self.automatic_optimization = False  # Lightning's condition for several optimizers

        def configure_optimizers(self):
            return torch.optim.AdamW(self.a.parameters()), torch.optim.SGD(self.b.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(), logger=False)
    module = TwoOptimizers()
    module.trainer = trainer
    trainer.strategy.connect(module)
    with pytest.raises(ConfigError, match="one optimizer .* returned 2"):
        trainer.strategy.setup_optimizers(trainer)
