"""``chunkzero train --backend jax`` on a Hugging Face Llama directory (2 layers, grouped-query attention,
untied head, a byte vocabulary and no tokenizer), against a plain PyTorch run (``--engine ddp``: DDP and
torch's AdamW on HF's own ``LlamaForCausalLM``).

The JAX engine trains the directory's safetensors weights (read with numpy) under HF's tensor names, so its
checkpoint resumes on the torch engine at another world size; 12 sequences per step at every world size,
so every run trains the same stream.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from .helpers import SMALL, describe, make_corpus, run_train, run_train_pooled
from .test_train_jax import GLOBAL_BATCH, LOSS_TOL, _losses

transformers = pytest.importorskip("transformers")

LLAMA = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}


def _args(corpus, model, world: int):
    small = list(SMALL)
    small[small.index("--model") + 1] = str(model)
    small[small.index("--batch-size") + 1] = str(GLOBAL_BATCH // world)
    return [*small, "--data", str(corpus), "--steps", "6", "--eval-interval", "6"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch

    tmp = tmp_path_factory.mktemp("jax_llama")
    torch.manual_seed(0)
    model = tmp / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(model)
    corpus = make_corpus(tmp / "corpus")
    outs = {"torch": tmp / "torch", "jax": tmp / "jax"}
    p = run_train_pooled(*_args(corpus, model, 2), "--engine", "ddp", "--nproc", "2", "--out", str(outs["torch"]),
                         cwd=tmp)
    assert p.returncode == 0, describe(p)
    p = run_train(*_args(corpus, model, 2), "--backend", "jax", "--nproc", "1", "--devices-per-process", "2",
                  "--save-interval", "4", "--out", str(outs["jax"]), cwd=tmp)
    assert p.returncode == 0, describe(p)
    return tmp, corpus, model, outs


@pytest.mark.slow
def test_jax_trains_llama_as_plain_torch_does(runs):
    _, _, _, outs = runs
    (t_train, t_val), (j_train, j_val) = _losses(outs["torch"]), _losses(outs["jax"])
    assert sorted(j_train) == list(range(1, 7)) and sorted(j_val) == [0, 6]
    print(f"JAX vs plain torch: max |train loss difference| {max(abs(j_train[s] - t_train[s]) for s in j_train):.2e}")
    for s in j_train:
        assert j_train[s] == pytest.approx(t_train[s], abs=LOSS_TOL), (s, j_train[s], t_train[s])
    for s in j_val:
        assert j_val[s] == pytest.approx(t_val[s], abs=LOSS_TOL), (s, j_val[s], t_val[s])
    assert (outs["jax"] / "sample.txt").is_file()


@pytest.mark.slow
def test_jax_llama_checkpoint_resumes_on_torch_at_another_world_size(runs):
    """JAX (1 process × 2 devices) steps 1-4 → torch ZeroDDP (W = 3) steps 5-6: plain torch's losses."""
    tmp, corpus, model, outs = runs
    out = tmp / "switch"
    shutil.copytree(outs["jax"], out)
    shutil.rmtree(out / "checkpoints" / "6")
    p = run_train_pooled(*_args(corpus, model, 3), "--nproc", "3", "--resume", "--out", str(out), cwd=tmp)
    assert p.returncode == 0, describe(p)
    (t_train, t_val), (s_train, s_val) = _losses(outs["torch"]), _losses(out)
    print(f"JAX → torch W = 3 vs plain torch: max |train loss difference| "
          f"{max(abs(s_train[s] - t_train[s]) for s in (5, 6)):.2e}")
    for s in (5, 6):
        assert s_train[s] == pytest.approx(t_train[s], abs=LOSS_TOL), (s, s_train[s], t_train[s])
    assert s_val[6] == pytest.approx(t_val[6], abs=LOSS_TOL)
    assert json.loads((out / "summary.json").read_text())["world_size"] == 3


@pytest.mark.slow
def test_zero_trainer_restores_a_llama_checkpoint_with_hf_logits(runs):
    """The library path: ``ZeroTrainer.from_checkpoint`` builds the Llama program from the checkpoint's saved
    ``config.json``, and its logits on the trained weights are HF's ``LlamaForCausalLM``'s on the same weights."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from jax_backend import ZeroTrainer, make_mesh
    from jax_backend.layout import unflatten

    _, _, model_dir, outs = runs
    trainer, state = ZeroTrainer.from_checkpoint(outs["jax"] / "checkpoints", make_mesh(1))
    assert trainer.source.step == 6 and trainer.program.name == "hf-llama"
    weights = {k: np.asarray(v) for k, v in unflatten(trainer.chunks(state), trainer.layout, nested=False).items()}
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir).float().eval()
    model.load_state_dict({k: torch.tensor(v) for k, v in weights.items()}, strict=True)
    idx = np.random.default_rng(0).integers(0, 256, (2, 24))
    with torch.no_grad():
        ref = model(torch.from_numpy(idx)).logits.numpy()
    ours = np.asarray(trainer.program.logits({k: jnp.asarray(v) for k, v in weights.items()}, jnp.asarray(idx)))
    assert np.abs(ours - ref).max() <= 1e-5


def test_llama_configs_jax_cannot_train_are_refused_by_name(tmp_path):
    model = tmp_path / "llama"
    model.mkdir()
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    (model / "config.json").write_text(json.dumps({"model_type": "llama", **LLAMA, "rope_parameters": rope}))
    p = run_train("--backend", "jax", "--model", str(model), "--seq-len", "32", "--out", str(tmp_path / "o"),
                  cwd=tmp_path)
    assert p.returncode == 2, describe(p)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chunkzero train: error: "), p.stderr
    assert re.search(r"--model .*llama: rope_type 'yarn' is not implemented", lines[0]), lines[0]
    assert not (tmp_path / "o").exists()
