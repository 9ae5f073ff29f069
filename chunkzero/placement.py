"""Placement: which memory holds each chunk's tensors, and Gemini's static placement policy.

A chunk owns four kinds of tensor on a rank: the persistent compute-dtype **parameter shard** (what
is gathered before use; between uses it stays on one device), the fp32 **master shard**, the fp32
**gradient shard** and the **optimizer state** (e.g. Adam's two moments). :class:`ChunkPlacement`
says, per chunk, whether each lives in device memory or in host memory. A frozen chunk
(``requires_grad=False``) keeps no master, no gradient and no optimizer state, so those are
``None``.

:func:`static_placement` is Gemini's static policy (ColossalAI ``GeminiDDP(offload_optim_frac,
offload_param_frac)``): fixed fractions of the chunks, first in chunk order, live on the host for the
whole run. The trace-driven ``auto`` policy is in :mod:`chunkzero.placement_auto`; both produce
plain data that a backend applies.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["ChunkPlacement", "Location", "chunk_placements", "offload_count", "static_placement"]


class Location(str, enum.Enum):
    """Where a tensor lives. A ``str`` enum: ``Location.HOST == "host"``."""

    DEVICE = "device"
    """Accelerator memory (the training device: a CUDA GPU, or the CPU when training on CPU)."""
    HOST = "host"
    """Host (CPU) memory, pinned on CUDA; the tensor is copied to the device when it is used."""


def _location(value, what: str) -> Location:
    try:
        return Location(value)
    except ValueError:
        raise ConfigError(f"{what} must be one of {[m.value for m in Location]}, got {value!r}") from None


@dataclass(frozen=True)
class ChunkPlacement:
    """Where one chunk's tensors live on this rank between uses.

    Attributes:
        index: the chunk's index in the layout (``ChunkInfo.index``).
        param: location of the persistent compute-dtype parameter shard (the whole chunk for a
            keep-gathered chunk) between uses; a host shard is copied to the device before the gather.
        master: location of the fp32 master shard; ``None`` for a frozen chunk.
        grad: location of the fp32 gradient shard; ``None`` for a frozen chunk.
        optim_state: location of the optimizer state; ``None`` for a frozen chunk.

    Locations may be given as :class:`Location` or as the strings ``"device"`` / ``"host"``.

    Raises:
        ConfigError: a negative index, an unknown location, or a chunk with some but not all of
            ``master``, ``grad`` and ``optim_state`` set.
    """

    index: int
    param: Location
    master: Location | None = None
    grad: Location | None = None
    optim_state: Location | None = None

    def __post_init__(self):
        if isinstance(self.index, bool) or not isinstance(self.index, numbers.Integral) or self.index < 0:
            raise ConfigError(f"chunk placement index must be a non-negative int, got {self.index!r}")
        object.__setattr__(self, "index", int(self.index))
        object.__setattr__(self, "param", _location(self.param, f"chunk {self.index} param"))
        trainable = [self.master, self.grad, self.optim_state]
        if any(v is None for v in trainable) and any(v is not None for v in trainable):
            raise ConfigError(
                f"chunk {self.index}: master, grad and optim_state must all be set (a trainable chunk) or all "
                f"be None (a frozen chunk), got master={self.master!r}, grad={self.grad!r}, "
                f"optim_state={self.optim_state!r}"
            )
        for name in ("master", "grad", "optim_state"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _location(getattr(self, name), f"chunk {self.index} {name}"))

    @property
    def trainable(self) -> bool:
        """Whether the chunk keeps a master, a gradient and optimizer state (``requires_grad``)."""
        return self.master is not None

    @property
    def param_offloaded(self) -> bool:
        """The parameter shard lives on the host between uses."""
        return self.param is Location.HOST

    @property
    def optim_offloaded(self) -> bool:
        """The optimizer state lives on the host (so the optimizer step for this chunk runs there)."""
        return self.optim_state is Location.HOST

    def tensors_on(self, location: Location | str) -> tuple[str, ...]:
        """Names of the kinds held at ``location``, among ``"param"``, ``"master"``, ``"grad"``,
        ``"optim_state"`` (in that order): what a memory report counts on that device."""
        where = _location(location, "location")
        return tuple(n for n in ("param", "master", "grad", "optim_state") if getattr(self, n) is where)


def offload_count(frac: float, n: int) -> int:
    """How many of ``n`` chunks a fraction ``frac`` in [0, 1] offloads: ``ceil(frac * n)``, with a
    1e-9 tolerance so that float noise (``0.55 * 100 == 55.00000000000001``) does not add a chunk;
    0 when ``frac == 0``, at most ``n``."""
    return min(n, math.ceil(frac * n - 1e-9)) if frac > 0 else 0


def _fraction(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _chunk_indices(chunks: Sequence) -> list[int]:
    indices = [c.index for c in chunks]
    if len(set(indices)) != len(indices):
        dup = next(i for i in indices if indices.count(i) > 1)
        raise ConfigError(f"chunk index {dup} appears twice in the chunks given")
    return indices


def chunk_placements(
    chunks: Sequence, *, param_host: Iterable[int] = (), optim_host: Iterable[int] = ()
) -> tuple[ChunkPlacement, ...]:
    """One :class:`ChunkPlacement` per chunk, in the order given, from two sets of chunk indices.

    Args:
        chunks: chunk descriptors with ``index`` and ``requires_grad`` (``ChunkLayout.chunks``).
        param_host: chunks whose parameter shard lives on the host; every other one is on the device.
        optim_host: trainable chunks whose master, gradient and optimizer state live on the host.
            Nothing here implies anything else; :func:`static_placement` adds its own rules.

    Raises:
        ConfigError: a duplicate chunk index, an index in ``param_host`` / ``optim_host`` that is not
            among ``chunks``, or a frozen chunk in ``optim_host``.
    """
    indices = _chunk_indices(chunks)
    param_host, optim_host = set(param_host), set(optim_host)
    for what, given in (("param_host", param_host), ("optim_host", optim_host)):
        unknown = sorted(given - set(indices))
        if unknown:
            raise ConfigError(f"{what} names chunk {unknown[0]}, which is not among the {len(indices)} chunks given")
    out = []
    for c in chunks:
        param = Location.HOST if c.index in param_host else Location.DEVICE
        if not c.requires_grad:
            if c.index in optim_host:
                raise ConfigError(f"optim_host names chunk {c.index}, which is frozen and keeps no optimizer state")
            out.append(ChunkPlacement(c.index, param))
            continue
        state = Location.HOST if c.index in optim_host else Location.DEVICE
        out.append(ChunkPlacement(c.index, param, state, state, state))
    return tuple(out)


def static_placement(
    chunks: Sequence, *, offload_optim_frac: float = 0.0, offload_param_frac: float = 0.0
) -> tuple[ChunkPlacement, ...]:
    """Gemini's static placement: fixed fractions of the chunks live on the host.

    - ``offload_count(offload_optim_frac, n_trainable)`` trainable chunks, first in chunk order, keep
      their fp32 master, gradient and optimizer state on the host (the optimizer steps them there).
    - ``offload_count(offload_param_frac, n_sharded)`` sharded (not keep-gathered) chunks, first in
      chunk order, keep their parameter shard on the host between uses. A param-offloaded trainable
      chunk also keeps its master, gradient and optimizer state on the host: its refreshed
      parameters are produced where its master is, and no device copy is kept between uses.

    Everything else is on the device. ``offload_count`` rounds up, so any fraction above 0 offloads at
    least one chunk (when there is one).

    Args:
        chunks: chunk descriptors with ``index``, ``requires_grad`` and ``keep_gathered``
            (``ChunkLayout.chunks``), in chunk order.
        offload_optim_frac: fraction in [0, 1] of the trainable chunks.
        offload_param_frac: fraction in [0, 1] of the sharded chunks.

    Returns:
        One :class:`ChunkPlacement` per chunk, in the order given; frozen chunks have ``master``,
        ``grad`` and ``optim_state`` set to ``None``.

    Raises:
        ConfigError: a fraction that is not a number in [0, 1] (the message names the argument and
            the value), or a duplicate chunk index.

    Source: ColossalAI Gemini's static placement policy (``StaticPlacementPolicy``).
    """
    optim_frac = _fraction("offload_optim_frac", offload_optim_frac)
    param_frac = _fraction("offload_param_frac", offload_param_frac)
    _chunk_indices(chunks)
    trainable = [c.index for c in chunks if c.requires_grad]
    sharded = [c.index for c in chunks if not c.keep_gathered]
    param_host = set(sharded[: offload_count(param_frac, len(sharded))])
    optim_host = set(trainable[: offload_count(optim_frac, len(trainable))]) | (param_host & set(trainable))
    return chunk_placements(chunks, param_host=param_host, optim_host=optim_host)
