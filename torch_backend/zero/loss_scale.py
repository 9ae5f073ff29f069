"""``DynamicLossScaler``: the fp16 loss scale of a :class:`~torch_backend.ZeroOptimizer` (Megatron-LM's
``DynamicGradScaler``: growth interval and hysteresis; mixed-precision training after Micikevicius et
al. 2018, "Mixed Precision Training")."""

from __future__ import annotations

from typing import Any

from chunkzero.errors import CheckpointError, ConfigError

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Dynamic loss scale with growth interval and hysteresis (Megatron-LM's ``DynamicGradScaler``).

    On an overflow the growth counter resets and the hysteresis counter drops by one; when it reaches
    zero the scale is multiplied by ``backoff_factor`` (not below ``min_scale``) — so ``hysteresis=1``
    halves at the first overflow. After ``growth_interval`` overflow-free steps in a row the scale is
    multiplied by ``growth_factor`` (not above ``max_scale``) and the hysteresis counter is refilled.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        *,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2.0**32,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        if not initial_scale > 0:
            raise ConfigError(f"initial_scale must be > 0, got {initial_scale!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ConfigError(f"growth_interval must be a positive int (steps), got {growth_interval!r}")
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ConfigError(f"hysteresis must be a positive int (overflows), got {hysteresis!r}")
        if not 0 < min_scale <= initial_scale:
            raise ConfigError(f"min_scale must be in (0, initial_scale], got {min_scale!r}")
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ConfigError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor!r}, {backoff_factor!r}"
            )
        self.scale = float(initial_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, overflow: bool) -> None:
        """After a step: ``overflow`` (a non-finite gradient norm) backs off per hysteresis, else growth."""
        if overflow:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        """The scale, both trackers and the settings, as plain Python numbers."""
        return {k: getattr(self, k) for k in (
            "scale", "growth_tracker", "hysteresis_tracker", "growth_interval", "hysteresis",
            "min_scale", "max_scale", "growth_factor", "backoff_factor")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the fields of :meth:`state_dict` given in ``state`` (each cast to its current type).

        Raises:
            CheckpointError: a field this scaler does not have.
        """
        for k, v in state.items():
            if not hasattr(self, k):
                raise CheckpointError(f"unknown loss-scaler field {k!r}")
            setattr(self, k, type(getattr(self, k))(v))
