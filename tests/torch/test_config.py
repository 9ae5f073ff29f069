"""ZeroDDP's option dataclasses (torch_backend.zero.config): each bad field value is refused by name, the
flat keywords are shortcuts for the dataclasses, and a dataclass given with its flat keywords is refused."""

import dataclasses
import re

import pytest
import torch

from chunkzero import static_placement
from chunkzero.errors import ConfigError
from torch_backend import AutoPlacementPolicy, MixedPrecision, PrefetchPolicy, StaticPlacement, ZeroDDP
from torch_backend.zero.config import DEFAULT_STEADY_DEVICE_CAP_RATIO, resolve_placement


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (MixedPrecision, dict(compute="fp8"), "compute"),
        (MixedPrecision, dict(compute=torch.float64), "compute"),
        (MixedPrecision, dict(compute=["bf16"]), "compute"),
        (PrefetchPolicy, dict(chunks=-1), "chunks"),
        (PrefetchPolicy, dict(chunks=1.5), "chunks"),
        (PrefetchPolicy, dict(chunks=True), "chunks"),
        (PrefetchPolicy, dict(reshard_after_forward=1), "reshard_after_forward"),
        (StaticPlacement, dict(offload_optim_frac=1.5), "offload_optim_frac"),
        (StaticPlacement, dict(offload_optim_frac=True), "offload_optim_frac"),
        (StaticPlacement, dict(offload_optim_frac="0.5"), "offload_optim_frac"),
        (StaticPlacement, dict(offload_param_frac=-0.1), "offload_param_frac"),
        (AutoPlacementPolicy, dict(device_memory_bytes=0), "device_memory_bytes"),
        (AutoPlacementPolicy, dict(device_memory_bytes=2.5e9), "device_memory_bytes"),
        (AutoPlacementPolicy, dict(device_memory_bytes=True), "device_memory_bytes"),
        (AutoPlacementPolicy, dict(steady_device_cap_ratio=0.0), "steady_device_cap_ratio"),
        (AutoPlacementPolicy, dict(steady_device_cap_ratio=1.5), "steady_device_cap_ratio"),
        (AutoPlacementPolicy, dict(steady_device_cap_ratio=None), "steady_device_cap_ratio"),
    ],
)
def test_bad_field_raises_config_error_naming_it(cls, kwargs, field):
    with pytest.raises(ConfigError, match=re.escape(f"{cls.__name__}.{field} must be")):
        cls(**kwargs)


def test_fields_are_normalized_and_frozen():
    assert MixedPrecision(torch.bfloat16).compute == "bf16" and MixedPrecision("fp16").dtype_name == "float16"
    assert StaticPlacement(1, 0).offload_optim_frac == 1.0 and isinstance(StaticPlacement(1).offload_optim_frac, float)
    assert AutoPlacementPolicy(steady_device_cap_ratio=1).steady_device_cap_ratio == 1.0
    assert AutoPlacementPolicy().steady_device_cap_ratio == DEFAULT_STEADY_DEVICE_CAP_RATIO
    with pytest.raises(dataclasses.FrozenInstanceError):
        PrefetchPolicy().chunks = 2


def test_flat_keywords_are_shortcuts_for_the_dataclasses():
    flat = ZeroDDP(_module(), chunk_size=80, mixed_precision="bf16", prefetch=2, reshard_after_forward=False,
                   offload_optim_frac=0.5, offload_param_frac=1.0)
    policy = ZeroDDP(_module(), chunk_size=80, mixed_precision=MixedPrecision(compute=torch.bfloat16),
                     prefetch=PrefetchPolicy(chunks=2, reshard_after_forward=False),
                     placement=StaticPlacement(offload_optim_frac=0.5, offload_param_frac=1.0))
    for model in (flat, policy):
        assert model.mixed_precision_policy == MixedPrecision("bf16")
        assert model.prefetch_policy == PrefetchPolicy(2, reshard_after_forward=False)
        assert model.placement_policy == StaticPlacement(0.5, 1.0)
        assert (model.mixed_precision, model.compute_dtype, model.prefetch, model.reshard_after_forward) == \
            ("bf16", torch.bfloat16, 2, False)
        assert (model.offload_optim_frac, model.offload_param_frac) == (0.5, 1.0)
        assert model.placements == static_placement(model.layout.chunks, offload_optim_frac=0.5, offload_param_frac=1.0)
        assert all(c.buffer.dtype == torch.bfloat16 for c in model.chunks)
    assert len(flat.offload_optim_chunks) > 0 and len(flat.offload_param_chunks) > 0
    auto = ZeroDDP(
        _module(), chunk_size=80, placement=AutoPlacementPolicy(device_memory_bytes=10**6, steady_device_cap_ratio=0.5)
    )
    assert auto.auto_placement.budget_bytes == 5 * 10**5 and (auto.offload_optim_frac, auto.offload_param_frac) == (
        0.0,
        0.0,
    )
    assert resolve_placement("auto", device_memory_bytes=10**6, steady_device_cap_ratio=0.5) == auto.placement_policy
    assert ZeroDDP(_module(), chunk_size=80).placement_policy == StaticPlacement()


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (
            dict(placement=StaticPlacement(), offload_optim_frac=0.5),
            ("placement=StaticPlacement", "offload_optim_frac"),
        ),
        (
            dict(placement=StaticPlacement(), device_memory_bytes=10**9),
            ("placement=StaticPlacement", "device_memory_bytes"),
        ),
        (
            dict(placement=AutoPlacementPolicy(), steady_device_cap_ratio=0.5),
            ("placement=AutoPlacementPolicy", "steady_device_cap_ratio"),
        ),
        (
            dict(placement=AutoPlacementPolicy(), offload_param_frac=0.0),
            ("placement=AutoPlacementPolicy", "offload_param_frac"),
        ),
        (
            dict(prefetch=PrefetchPolicy(), reshard_after_forward=True),
            ("prefetch=PrefetchPolicy", "reshard_after_forward"),
        ),
    ],
)
def test_dataclass_with_its_flat_keywords_names_both(kwargs, names):
    with pytest.raises(ConfigError) as info:
        ZeroDDP(_module(), chunk_size=80, **kwargs)
    assert all(n in str(info.value) for n in names), str(info.value)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(placement="gemini"), "placement must be"),
        (dict(placement=3), "placement must be"),
        (
            dict(placement="static", steady_device_cap_ratio=DEFAULT_STEADY_DEVICE_CAP_RATIO),
            "steady_device_cap_ratio is for",
        ),
        (dict(placement="static", device_memory_bytes=10**9), "device_memory_bytes is for"),
        (dict(placement="auto", offload_optim_frac=0.0), "offload_optim_frac and offload_param_frac are for"),
        (dict(mixed_precision="fp8"), "mixed_precision"),
        (dict(prefetch=-1), "prefetch"),
    ],
)
def test_shortcut_spellings_refuse_what_does_not_go_together(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        ZeroDDP(_module(), chunk_size=80, **kwargs)
