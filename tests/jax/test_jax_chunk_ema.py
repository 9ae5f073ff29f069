"""``jax_backend.ChunkEMA``, the JAX engine's EMA of the master chunks, against independent references:
torch's ``AveragedModel`` with ``get_ema_multi_avg_fn`` (no warm-up) and a numpy EMA with the warm-up, both
over the full parameters after each step of a ZeRO-3 run on 4 devices (shard boundaries inside tensors,
a keep-gathered chunk, a frozen one); and its checkpoint: the ``ema`` item torch's ``ZeroEMA`` loads, and
that JAX restores on another device count."""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from zero_utils import ADAMW, BATCH, CHUNK_SIZE, SEQ, WORLD, tiny_program

import jax_backend as jb
from chunkzero import ChunkLayout
from chunkzero.checkpoint import EMA_KEY, chunk_key, orbax_store, read_meta
from jax_backend.blocks import random_batch

STEPS = 4
EMA_ATOL = 2e-6
"""fp32 noise of 4 lerps of weights of magnitude ~0.1-1 (the parameters themselves are the same arrays)."""
FROZEN, WHOLE = "transformer.wpe.weight", "transformer.ln_f.weight"


def _trainer():
    program = tiny_program()
    specs = [dataclasses.replace(s, requires_grad=s.name != FROZEN, keep_gathered=s.name == WHOLE)
             for s in program.specs]
    layout = ChunkLayout.build(specs, CHUNK_SIZE, WORLD)
    assert any(not c.requires_grad for c in layout.chunks) and any(c.keep_gathered for c in layout.chunks)
    return program, jb.ZeroTrainer(program, layout, jb.make_mesh(WORLD), optax.adamw(**ADAMW),
                                   optimizer_meta=jb.adamw_meta(**ADAMW))


@pytest.fixture(scope="module")
def run():
    """``(trainer, state, {"plain": EMA 0.8, "warm": EMA 0.9 with warm-up}, [full params at the start and
    after each step])``."""
    program, trainer = _trainer()
    state = trainer.init(program.init(0))
    emas = {"plain": jb.ChunkEMA(trainer, state, 0.8), "warm": jb.ChunkEMA(trainer, state, 0.9, warmup=True)}
    seen = [trainer.full_params(state)]
    for i in range(STEPS):
        state, _ = trainer.step(state, random_batch(program, BATCH, SEQ, seed=i))
        for ema in emas.values():
            ema.update(state)
        seen.append(trainer.full_params(state))
    return trainer, state, emas, seen


@pytest.fixture()
def plain(run):
    trainer, state, emas, seen = run
    return trainer, state, emas["plain"], seen


@pytest.fixture()
def warm(run):
    trainer, state, emas, seen = run
    return trainer, state, emas["warm"], seen


def _ema_params(trainer, state, ema) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in jb.unflatten(ema.weights(state), trainer.layout, nested=False).items()}


def _numpy_ema(seen, decay: float, warmup: bool) -> dict[str, np.ndarray]:
    """TensorFlow's ``ExponentialMovingAverage(num_updates=)`` in numpy (float64), from the first weights."""
    out = {k: v.astype(np.float64) for k, v in seen[0].items()}
    for n, params in enumerate(seen[1:]):
        d = min(decay, (1 + n) / (10 + n)) if warmup else decay
        out = {k: d * out[k] + (1 - d) * params[k] for k in out}
    return out


def _close(got, want) -> float:
    return max(float(np.abs(got[k] - want[k]).max()) for k in want)


def test_ema_equals_torchs_averaged_model(plain):
    trainer, state, ema, seen = plain
    decay = ema.decay
    assert ema.update_count == STEPS
    module = torch.nn.ParameterDict({k.replace(".", "/"): torch.nn.Parameter(torch.from_numpy(v.copy()))
                                     for k, v in seen[0].items()})
    averaged = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(decay))
    for params in seen:  # the first update copies the weights: the EMA starts at them
        with torch.no_grad():
            for k, v in params.items():
                module[k.replace(".", "/")].copy_(torch.from_numpy(np.array(v)))
        averaged.update_parameters(module)
    want = {k.replace("/", "."): p.detach().numpy() for k, p in averaged.module.named_parameters()}
    got = _ema_params(trainer, state, ema)
    assert _close(got, want) < EMA_ATOL
    np.testing.assert_array_equal(got[FROZEN], seen[0][FROZEN])  # frozen: the weights themselves
    # the test can fail: the EMA is far from the live weights, and from an EMA with the decay swapped
    assert _close(got, seen[-1]) > 100 * EMA_ATOL
    assert _close(got, _numpy_ema(seen, 1 - decay, False)) > 100 * EMA_ATOL


def test_ema_warmup_equals_a_numpy_ema(warm):
    trainer, state, ema, seen = warm
    decay = ema.decay
    got = _ema_params(trainer, state, ema)
    assert _close(got, _numpy_ema(seen, decay, True)) < EMA_ATOL
    assert ema.current_decay() == pytest.approx((1 + STEPS) / (10 + STEPS))
    assert _close(got, _numpy_ema(seen, decay, False)) > 100 * EMA_ATOL  # the warm-up ignored fails


def test_ema_checkpoint_loads_in_torch_and_in_jax_at_another_device_count(warm, tmp_path):
    """The ``ema`` item has the arrays torch's ZeroEMA writes (``ema.chunk_NNNN``, fp32, trainable chunks);
    torch's ``load_checkpoint`` puts them, bit for bit, in its ZeroEMA with the decay and update count, and
    JAX restores them on 3 devices."""
    from torch_backend import ZeroDDP, ZeroEMA, ZeroOptimizer, load_checkpoint
    from torch_backend.train.gpt import GPT, GPT_CONFIGS

    trainer, state, ema, _ = warm
    trainer.save_checkpoint(tmp_path / "c", state, step=STEPS, ema=ema,
                            model_config=GPT_CONFIGS["gpt-tiny"].to_dict())
    step_dir = tmp_path / "c" / str(STEPS)
    assert read_meta(step_dir).ema.to_dict() == {"decay": 0.9, "update_count": STEPS, "warmup": True}
    saved = {p: v for p, v in orbax_store.read_array_metadata(step_dir).items() if p[0] == EMA_KEY}
    assert saved == {(EMA_KEY, chunk_key(c.index)): ((c.size,), "float32")
                     for c in trainer.layout.chunks if c.requires_grad}
    want = _ema_params(trainer, state, ema)

    module = GPT(GPT_CONFIGS["gpt-tiny"])
    module.transformer.wpe.weight.requires_grad_(False)
    model = ZeroDDP(module, chunk_size=CHUNK_SIZE // 2)  # another chunk size and world size (1)
    optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3)
    torch_ema = ZeroEMA(optim, 0.5)
    load_checkpoint(tmp_path / "c", model, optim, load_rng=False)
    assert (torch_ema.decay, torch_ema.warmup, torch_ema.update_count) == (0.9, True, STEPS)
    with torch_ema.ema_weights():
        loaded = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for name in want:
        np.testing.assert_array_equal(loaded[name], want[name], err_msg=name)

    restored = jb.restore_checkpoint(tmp_path / "c", jb.make_mesh(3), item="ema")
    assert restored.layout.world_size == 3
    again = jb.unflatten(restored.chunks, restored.layout, nested=False)
    for name in want:
        np.testing.assert_array_equal(np.asarray(again[name]), want[name], err_msg=name)


def test_save_refuses_half_an_ema(plain, tmp_path):
    from chunkzero.errors import CheckpointError

    trainer, state, ema, _ = plain
    with pytest.raises(CheckpointError, match="ema_chunks and ema_meta go together"):
        jb.save_checkpoint(tmp_path / "c", trainer.chunks(state), trainer.layout, step=1, ema_chunks=ema.chunks)
