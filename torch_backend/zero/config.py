"""``ZeroDDP``'s options as plain data: small frozen dataclasses, each checked once, where it is defined.

- :class:`MixedPrecision`: the dtype of the chunks, of the computation and of the gradient reduction
  (FSDP2's ``MixedPrecisionPolicy``, with one dtype for all three, as the chunks hold one).
- :class:`PrefetchPolicy`: how far chunks are gathered ahead and whether they are released after
  their use in forward (the overlap of collectives with computation).
- :class:`StaticPlacement` / :class:`AutoPlacementPolicy`: where each chunk's tensors live (FSDP2's
  ``OffloadPolicy``; ColossalAI Gemini's ``static`` and ``auto`` placement policies).

``ZeroDDP`` takes each either as an instance or by the flat keywords of its shortcut spelling
(``mixed_precision="bf16"``, ``prefetch=1, reshard_after_forward=True``, ``placement="static",
offload_optim_frac=0.5`` or ``placement="auto", device_memory_bytes=...``);
:func:`resolve_mixed_precision`, :func:`resolve_prefetch` and :func:`resolve_placement` turn the
shortcuts into the instances, and refuse an instance given together with its flat keywords.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import torch

from chunkzero.errors import ConfigError

__all__ = ["DEFAULT_STEADY_DEVICE_CAP_RATIO", "MIXED_PRECISION_DTYPES", "AutoPlacementPolicy", "MixedPrecision",
           "PlacementPolicy", "PrefetchPolicy", "StaticPlacement", "resolve_mixed_precision", "resolve_placement",
           "resolve_prefetch"]

DEFAULT_STEADY_DEVICE_CAP_RATIO = 0.9
"""Share of the device memory the auto placement plans within (Gemini's ``steady_cuda_cap_ratio`` default)."""

MIXED_PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Mixed-precision name -> the core's dtype name of the chunks."""

_TORCH_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class MixedPrecision:
    """The dtype of the chunks, the computation and the gradient reduction; the optimizer always
    updates fp32 master shards (FSDP2's ``MixedPrecisionPolicy`` with ``param_dtype == reduce_dtype``).

    Attributes:
        compute: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (or the torch dtype, stored as its name). fp32
            tensor inputs of the forward are cast to it; ``"fp16"`` scales the loss dynamically.

    Raises:
        ConfigError: ``compute`` is none of these (the message names the field).
    """

    compute: str = "fp32"

    def __post_init__(self):
        compute = (
            _TORCH_NAMES.get(self.compute, self.compute) if isinstance(self.compute, torch.dtype) else self.compute
        )
        if not isinstance(compute, str) or compute not in MIXED_PRECISION_DTYPES:
            raise ConfigError(f"MixedPrecision.compute must be one of {sorted(MIXED_PRECISION_DTYPES)} or their torch "
                              f"dtypes (the mixed_precision= keyword), got {self.compute!r}")
        object.__setattr__(self, "compute", compute)

    @property
    def dtype_name(self) -> str:
        """The core's dtype name of the chunks (``"bfloat16"`` …)."""
        return MIXED_PRECISION_DTYPES[self.compute]


@dataclass(frozen=True)
class PrefetchPolicy:
    """How chunk gathers overlap the computation.

    Attributes:
        chunks: chunks gathered ahead of use, in the order recorded during the previous step
            (Gemini's ``max_prefetch``); with ``chunks > 0`` all-gathers and reduce-scatters are
            asynchronous. ``0``: gather on first use, blocking collectives.
        reshard_after_forward: release sharded chunks after their use in forward (ZeRO-3); ``False``
            keeps them gathered from forward until the backward reduces them (fewer gathers, more memory).

    Raises:
        ConfigError: ``chunks`` is not a non-negative int, or ``reshard_after_forward`` not a bool
            (the message names the field).
    """

    chunks: int = 1
    reshard_after_forward: bool = True

    def __post_init__(self):
        if not _is_int(self.chunks) or self.chunks < 0:
            raise ConfigError(f"PrefetchPolicy.chunks must be a non-negative int (chunks; the prefetch= keyword), "
                              f"got {self.chunks!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ConfigError(
                f"PrefetchPolicy.reshard_after_forward must be a bool, got {self.reshard_after_forward!r}"
            )
        object.__setattr__(self, "chunks", int(self.chunks))


@dataclass(frozen=True)
class StaticPlacement:
    """Gemini's static placement: two fractions decide, once, where each chunk's tensors live
    (:func:`chunkzero.static_placement`).

    Attributes:
        offload_optim_frac: fraction in ``[0, 1]`` of trainable chunks (first in chunk order, rounded
            up) whose fp32 master, gradient and optimizer state live on the host.
        offload_param_frac: fraction in ``[0, 1]`` of sharded chunks whose compute-dtype parameter
            shard lives on the host between uses (their master too); each gather copies it to the
            device first.

    Raises:
        ConfigError: a fraction is not a number in ``[0, 1]`` (the message names the field).
    """

    kind: ClassVar[str] = "static"
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0

    def __post_init__(self):
        for name in ("offload_optim_frac", "offload_param_frac"):
            frac = getattr(self, name)
            if not _is_real(frac) or not 0.0 <= frac <= 1.0:
                raise ConfigError(f"StaticPlacement.{name} must be a number in [0, 1], got {frac!r}")
            object.__setattr__(self, name, float(frac))


@dataclass(frozen=True)
class AutoPlacementPolicy:
    """Gemini's auto placement (:mod:`torch_backend.zero.placement`): a warm-up step traces the non-model
    memory at each chunk access; from the next step parameter shards move between host and device by
    Belady's farthest-next-use rule within ``floor(steady_device_cap_ratio × device_memory_bytes)``.

    Attributes:
        device_memory_bytes: the device memory to plan within, in bytes (``None``: the CUDA device's
            total memory; on CPU the machine's physical RAM).
        steady_device_cap_ratio: share in ``(0, 1]`` of it that the chunks on the device plus the
            non-model memory may use (Gemini's ``steady_cuda_cap_ratio``).

    Raises:
        ConfigError: ``device_memory_bytes`` is not a positive int or ``None``, or the ratio is not a
            number in ``(0, 1]`` (the message names the field).
    """

    kind: ClassVar[str] = "auto"
    device_memory_bytes: int | None = None
    steady_device_cap_ratio: float = DEFAULT_STEADY_DEVICE_CAP_RATIO

    def __post_init__(self):
        n = self.device_memory_bytes
        if n is not None and (not _is_int(n) or n <= 0):
            raise ConfigError(
                f"AutoPlacementPolicy.device_memory_bytes must be a positive int (bytes) or None, got {n!r}"
            )
        r = self.steady_device_cap_ratio
        if not _is_real(r) or not 0.0 < r <= 1.0:
            raise ConfigError(f"AutoPlacementPolicy.steady_device_cap_ratio must be a number in (0, 1], got {r!r}")
        object.__setattr__(self, "device_memory_bytes", None if n is None else int(n))
        object.__setattr__(self, "steady_device_cap_ratio", float(r))


PlacementPolicy = Union[StaticPlacement, AutoPlacementPolicy]


# ---------------------------------------------------------------------------------------- shortcuts
def _given(**flat: Any) -> dict[str, Any]:
    return {k: v for k, v in flat.items() if v is not None}


def _refuse_mixed(keyword: str, policy: object, flat: dict[str, Any]) -> None:
    if flat:
        names = ", ".join(f"{k}=" for k in flat)
        raise ConfigError(f"{keyword}={type(policy).__name__}(...) and {names} both given: set "
                          f"{' and '.join(flat)} in the {type(policy).__name__}")


def resolve_mixed_precision(mixed_precision: MixedPrecision | str | torch.dtype) -> MixedPrecision:
    """``mixed_precision=`` as a :class:`MixedPrecision` (a name or dtype is its ``compute``).

    Raises:
        ConfigError: from :class:`MixedPrecision`.
    """
    return mixed_precision if isinstance(mixed_precision, MixedPrecision) else MixedPrecision(mixed_precision)


def resolve_prefetch(prefetch: PrefetchPolicy | int, reshard_after_forward: bool | None = None) -> PrefetchPolicy:
    """``prefetch=`` (a :class:`PrefetchPolicy` or its ``chunks``) with the flat ``reshard_after_forward``
    (``None``: not given, the policy's default).

    Raises:
        ConfigError: a :class:`PrefetchPolicy` together with ``reshard_after_forward`` (both named);
            from :class:`PrefetchPolicy`.
    """
    flat = _given(reshard_after_forward=reshard_after_forward)
    if isinstance(prefetch, PrefetchPolicy):
        _refuse_mixed("prefetch", prefetch, flat)
        return prefetch
    return PrefetchPolicy(prefetch, **flat)


def resolve_placement(placement: PlacementPolicy | str, *, offload_optim_frac: float | None = None,
                      offload_param_frac: float | None = None, device_memory_bytes: int | None = None,
                      steady_device_cap_ratio: float | None = None) -> PlacementPolicy:
    """``placement=`` (a :class:`StaticPlacement`, an :class:`AutoPlacementPolicy`, ``"static"`` or
    ``"auto"``) with the flat keywords (``None``: not given).

    Raises:
        ConfigError: ``placement`` is none of these; a policy instance together with flat keywords,
            or ``"static"`` with an auto keyword, or ``"auto"`` with an offload fraction (each message
            names the arguments); from the policies.
    """
    static = _given(offload_optim_frac=offload_optim_frac, offload_param_frac=offload_param_frac)
    auto = _given(device_memory_bytes=device_memory_bytes, steady_device_cap_ratio=steady_device_cap_ratio)
    if isinstance(placement, (StaticPlacement, AutoPlacementPolicy)):
        _refuse_mixed("placement", placement, {**static, **auto})
        return placement
    if placement == "static":
        for name, value in auto.items():
            raise ConfigError(f"{name} is for placement='auto' (got {value!r} with placement='static')")
        return StaticPlacement(**static)
    if placement == "auto":
        if static:
            raise ConfigError("offload_optim_frac and offload_param_frac are for placement='static'; placement='auto' "
                              f"decides from the budget (got {', '.join(f'{k}={v!r}' for k, v in static.items())})")
        return AutoPlacementPolicy(**auto)
    raise ConfigError(
        f"placement must be 'static', 'auto', a StaticPlacement or an AutoPlacementPolicy, got {placement!r}"
    )
