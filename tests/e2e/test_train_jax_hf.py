"""``chunkzero train --backend jax`` on a Hugging Face GPT-2 directory, against the torch engine.

Both engines train the directory's weights under Hugging Face's own tensor names and ``Conv1D`` ``(in, out)``
shapes, so their losses agree to fp32 noise and a checkpoint of either resumes in the other.
"""

from __future__ import annotations

import re
import shutil

import pytest

from .helpers import SMALL, describe, make_corpus, run_train, run_train_pooled
from .test_train_jax import LOSS_TOL, _losses

transformers = pytest.importorskip("transformers")

WEIGHT_RTOL = 1e-3
"""Normwise, per tensor, after 3 steps of the two fp32 engines (measured 5.5e-5): Adam's first steps divide
near-zero gradients by their own size, so summation-order noise moves a few elements by a whole step; a
weight read the wrong way round or a lost update is off by order 1."""
NO_DROPOUT = {"embd_pdrop": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0}
"""The JAX program has no dropout; torch trains with the config's, so the test model has none."""


def _hf_dir(path, **overrides):
    import torch

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, **{**NO_DROPOUT, **overrides})
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def _args(corpus, model):
    small = list(SMALL)
    small[small.index("--model") + 1] = str(model)
    return [*small, "--data", str(corpus), "--steps", "3", "--nproc", "2", "--eval-interval", "3",
            "--save-interval", "2"]


def test_hf_program_is_hf_gpt2(tmp_path):
    """The JAX program of an HF GPT-2 (HF names and shapes) has HF's loss and gradients on HF's own
    weights: a projection read the wrong way round (``c_proj`` is square here) moves its gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from jax_backend.blocks import gpt_program
    from jax_backend.convert import hf_gpt2_config

    model = transformers.GPT2LMHeadModel.from_pretrained(_hf_dir(tmp_path / "hf")).float()
    program = gpt_program(hf_gpt2_config(model.config), "hf", hf_conv1d=True)
    idx = np.random.default_rng(0).integers(0, 256, (2, 17))
    x, y = idx[:, :-1], idx[:, 1:]
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)).logits.reshape(-1, 256),
                                             torch.from_numpy(y).reshape(-1))
    loss.backward()
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    assert [(s.name, s.shape) for s in program.specs] == [(n, tuple(v.shape)) for n, v in params.items()]
    batch = {"idx": jnp.asarray(x, jnp.int32), "targets": jnp.asarray(y, jnp.int32)}
    j_loss, j_grads = jax.value_and_grad(program.loss)(params, batch)
    assert float(j_loss) == pytest.approx(loss.item(), abs=1e-5)
    for n, p in model.named_parameters():
        g = p.grad.numpy()
        assert np.linalg.norm(np.asarray(j_grads[n]) - g) <= 1e-4 * np.linalg.norm(g) + 1e-7, n


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jax_hf")
    common = _args(make_corpus(tmp / "corpus"), _hf_dir(tmp / "hf-model"))
    outs = {}
    for backend in ("torch", "jax"):
        outs[backend] = tmp / backend
        p = run_train_pooled(*common, "--backend", backend, "--out", str(outs[backend]), cwd=tmp)
        assert p.returncode == 0, describe(p)
    return tmp, common, outs


@pytest.mark.slow
def test_jax_trains_hf_gpt2_as_torch_does(runs):
    _, _, outs = runs
    (t_train, t_val), (j_train, j_val) = _losses(outs["torch"]), _losses(outs["jax"])
    assert sorted(j_train) == [1, 2, 3] and sorted(j_val) == [0, 3]
    for s in j_train:
        assert j_train[s] == pytest.approx(t_train[s], abs=LOSS_TOL), (s, j_train[s], t_train[s])
    for s in j_val:
        assert j_val[s] == pytest.approx(t_val[s], abs=LOSS_TOL), (s, j_val[s], t_val[s])
    assert (outs["jax"] / "sample.txt").is_file()


@pytest.mark.slow
def test_zero_trainer_restores_hf_checkpoints(runs):
    """The library path: ``ZeroTrainer.from_checkpoint`` of either run's HF checkpoint builds the HF program
    from its saved config (``Conv1D`` ``(in, out)`` shapes), and the two engines' weights after 3 steps agree."""
    import numpy as np

    from jax_backend import ZeroTrainer, make_mesh
    from jax_backend.layout import unflatten

    _, _, outs = runs
    weights = {}
    for backend in ("torch", "jax"):
        trainer, state = ZeroTrainer.from_checkpoint(outs[backend] / "checkpoints", make_mesh(1))
        assert trainer.source.step == 3
        assert {s.name: s.shape for s in trainer.program.specs}["transformer.h.0.attn.c_attn.weight"] == (32, 96)
        weights[backend] = {k: np.asarray(v) for k, v in
                            unflatten(trainer.chunks(state), trainer.layout, nested=False).items()}
    assert sorted(weights["jax"]) == sorted(weights["torch"])
    for name, w in weights["torch"].items():
        assert np.linalg.norm(weights["jax"][name] - w) <= WEIGHT_RTOL * np.linalg.norm(w), name


@pytest.mark.slow
@pytest.mark.parametrize("source,backend", [("torch", "jax"), ("jax", "torch")])
def test_hf_checkpoint_resumes_in_the_other_engine(runs, source, backend):
    """Step 3 resumed by the other engine from step 2's checkpoint: the uninterrupted run's loss."""
    tmp, common, outs = runs
    out = tmp / f"{source}-to-{backend}"
    shutil.copytree(outs[source], out)
    shutil.rmtree(out / "checkpoints" / "3")
    p = run_train_pooled(*common, "--backend", backend, "--resume", "--out", str(out), cwd=tmp)
    assert p.returncode == 0, describe(p)
    (r_train, r_val), (s_train, s_val) = _losses(outs[source]), _losses(out)
    assert s_train[3] == pytest.approx(r_train[3], abs=LOSS_TOL), (s_train[3], r_train[3])
    assert s_val[3] == pytest.approx(r_val[3], abs=LOSS_TOL), (s_val[3], r_val[3])


def test_hf_models_jax_cannot_train_are_refused_by_name(tmp_path):
    dropout = _hf_dir(tmp_path / "dropout", resid_pdrop=0.1)
    transformers.GPTNeoXConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, max_position_embeddings=64).save_pretrained(tmp_path / "neox")
    for model, message in ((dropout, "--backend jax trains without dropout; --model .* sets resid_pdrop=0.1"),
                           (tmp_path / "neox", "is a 'gpt_neox' model, which only --backend torch trains")):
        p = run_train("--backend", "jax", "--model", str(model), "--seq-len", "32", "--out", str(tmp_path / "o"),
                      cwd=tmp_path)
        assert p.returncode == 2, describe(p)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("chunkzero train: error: "), p.stderr
        assert re.search(message, lines[0]), lines[0]
        assert not (tmp_path / "o").exists()
