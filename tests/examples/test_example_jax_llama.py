"""``examples/jax_llama.py`` runs as it is (the CLI twice: JAX at world size 2, then torch at 1), then is
checked: the torch session resumed the JAX checkpoint of an untied, grouped-query Llama under HF's tensor
names and went on from its step and its weights, with finite, falling losses."""

from __future__ import annotations

import pytest
from examples_runner import run_example

CHECKS = """
import json, math
from chunkzero.checkpoint import read_meta
sessions = [(r["step"], r["world_size"]) for r in records if r["kind"] == "session"]
assert sessions == [(0, 2), (4, 1)], sessions               # JAX W = 2 from step 0, torch W = 1 from step 4
assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values()), losses
meta = read_meta(root / "run" / "checkpoints" / "4")           # the only checkpoint: torch saved none
assert (meta.step, meta.extra["backend"], meta.layout.world_size) == (4, "jax", 2)
assert meta.model_config["num_key_value_heads"] == 2 and not meta.model_config["tie_word_embeddings"]
names = {t.name for t in meta.layout.tensors}
assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.k_proj.weight"} <= names
assert sorted(p.name for p in (root / "run" / "checkpoints").iterdir()) == ["4"]
assert json.loads((root / "run" / "config.json").read_text())["backend"] == "torch"
val = {r["step"]: r["val_loss"] for r in records if r["kind"] == "val"}
assert val[0] > val[4] > val[8], val                          # one validation set, at every world size
assert losses[5] < losses[1] - 0.1, losses                    # from JAX's trained weights, not the initial ones
print("EXAMPLE OK")
"""


@pytest.mark.slow  # about 80 s on 2 busy cores (a JAX compile, two CLI start-ups)
def test_jax_llama_example_runs(tmp_path):
    proc = run_example("jax_llama.py", tmp_path, checks=CHECKS)
    assert "resumed from step 4" in proc.stdout + proc.stderr
