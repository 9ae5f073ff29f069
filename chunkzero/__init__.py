"""chunkzero core: the framework-agnostic chunk layout, tensor states, chunk-size search and cost model.

Imports numpy and the standard library only; the backends live in ``torch_backend`` and
``jax_backend``.
"""

from .errors import (
    CheckpointError,
    CheckpointFormatError,
    ChunkZeroError,
    ConfigError,
    IllegalTransitionError,
    LayoutError,
    LayoutFormatError,
    LayoutVersionError,
    ShapeMismatchError,
    UnusedParameterError,
)
from .layout import ChunkInfo, ChunkLayout, TensorPlacement, TensorSpec
from .states import LEGAL_TRANSITIONS, ChunkStates, TensorState

__version__ = "0.1.0"

__all__ = [
    "ChunkInfo",
    "ChunkLayout",
    "ChunkStates",
    "CheckpointError",
    "CheckpointFormatError",
    "ChunkZeroError",
    "ConfigError",
    "IllegalTransitionError",
    "LEGAL_TRANSITIONS",
    "LayoutError",
    "LayoutFormatError",
    "LayoutVersionError",
    "ShapeMismatchError",
    "TensorPlacement",
    "TensorSpec",
    "TensorState",
    "UnusedParameterError",
]
