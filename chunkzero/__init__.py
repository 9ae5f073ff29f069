"""chunkzero core: the framework-agnostic chunk layout, tensor states, chunk-size search, cost model and
placement decisions.

Imports numpy and the standard library only; the backends live in ``torch_backend`` and
``jax_backend``.
"""

from .configs import model_specs
from .cost import StrategyCost, chunk_zero3_cost, compare_strategies, ddp_cost, fsdp_cost
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointSaveError,
    ChunkZeroError,
    ConfigError,
    IllegalTransitionError,
    LayoutError,
    LayoutFormatError,
    LayoutVersionError,
    PlacementBudgetError,
    ShapeMismatchError,
    UnusedParameterError,
)
from .layout import ChunkInfo, ChunkLayout, TensorSlot, TensorSpec
from .placement import ChunkPlacement, Location, chunk_placements, offload_count, static_placement
from .placement_auto import PlacementPlan, StepSchedule, plan_placement
from .search import SearchResult, build_layout, gemini_search, search_chunk_size
from .states import LEGAL_TRANSITIONS, ChunkStates, TensorState

__version__ = "0.1.0"

__all__ = [
    "ChunkPlacement",
    "Location",
    "PlacementBudgetError",
    "PlacementPlan",
    "SearchResult",
    "StepSchedule",
    "StrategyCost",
    "build_layout",
    "chunk_placements",
    "chunk_zero3_cost",
    "compare_strategies",
    "ddp_cost",
    "fsdp_cost",
    "gemini_search",
    "model_specs",
    "offload_count",
    "plan_placement",
    "search_chunk_size",
    "static_placement",
    "ChunkInfo",
    "ChunkLayout",
    "ChunkStates",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointSaveError",
    "ChunkZeroError",
    "ConfigError",
    "IllegalTransitionError",
    "LEGAL_TRANSITIONS",
    "LayoutError",
    "LayoutFormatError",
    "LayoutVersionError",
    "ShapeMismatchError",
    "TensorSlot",
    "TensorSpec",
    "TensorState",
    "UnusedParameterError",
]
