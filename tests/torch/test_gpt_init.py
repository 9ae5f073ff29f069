"""The torch GPT's initial weights (:mod:`chunkzero.job.init`, drawn in numpy) against nanoGPT's own torch
initialization, applied to the same module: every tensor has the reference's distribution, the tied head is
the token embedding, drawn once."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from torch_backend.train.gpt import GPT, GPT_CONFIGS


def nanogpt_init(model: GPT) -> None:
    """nanoGPT's ``GPT.__init__``: ``_init_weights`` on every module (linear and embedding weights N(0, 0.02),
    biases 0; LayerNorm keeps torch's ones and zeros), then the residual projections N(0, 0.02 / sqrt(2 L))."""

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    with torch.no_grad():
        model.apply(init)
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * model.config.n_layer))


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-mini"])
def test_numpy_init_has_nanogpts_per_tensor_distributions(name):
    cfg = GPT_CONFIGS[name]
    ours = GPT(cfg, seed=5)
    torch.manual_seed(5)
    ref = GPT(cfg, seed=0)
    nanogpt_init(ref)
    ours_params, ref_params = dict(ours.named_parameters()), dict(ref.named_parameters())
    assert list(ours_params) == list(ref_params)
    for key, want in ref_params.items():
        got = ours_params[key].detach()
        want = want.detach()
        if float(want.std()) == 0:  # biases and LayerNorm: constants
            assert torch.equal(got, want), key
            continue
        std = float(want.std())
        assert float(got.std()) == pytest.approx(std, rel=0.03), key
        assert abs(float(got.mean())) < 4 * std / math.sqrt(got.numel()), key
        assert not torch.equal(got, want), key  # other draws of the same distribution
    assert ours.lm_head.weight is ours.transformer.wte.weight

