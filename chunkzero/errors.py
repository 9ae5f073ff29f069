"""Typed exceptions raised by chunkzero.

Every user-facing failure is one of these; each message names the thing at fault
(the tensor, the field, the file, both shapes) so the user can act on it.
"""

from __future__ import annotations


class ChunkZeroError(Exception):
    """Base class of every chunkzero error."""


class LayoutError(ChunkZeroError, ValueError):
    """A chunk layout cannot be built from the given specs or sizes."""


class LayoutFormatError(LayoutError):
    """A serialized layout document is malformed; ``field`` names the offending field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"layout field {field!r}: {message}")


class LayoutVersionError(LayoutFormatError):
    """A serialized layout document has a version this chunkzero cannot read."""


class IllegalTransitionError(ChunkZeroError, RuntimeError):
    """A tensor was moved between two states the transition table does not allow.

    This is always a bug in the caller (the backend), never bad user input.
    """

    def __init__(self, tensor: str, from_state, to_state):
        self.tensor = tensor
        self.from_state = from_state
        self.to_state = to_state
        super().__init__(
            f"illegal tensor-state transition for {tensor!r}: "
            f"{getattr(from_state, 'name', from_state)} -> {getattr(to_state, 'name', to_state)}"
        )


class ConfigError(ChunkZeroError, ValueError):
    """An argument or configuration value is invalid; the message names it."""


class PlacementBudgetError(ConfigError):
    """A device memory budget cannot hold one chunk access: the accessed chunk plus the non-model
    memory recorded at that access exceed it. Attributes give the numbers, all in bytes."""

    def __init__(self, budget_bytes: int, access: int, chunk: int, chunk_bytes: int, non_model_bytes: int):
        self.budget_bytes, self.access, self.chunk = budget_bytes, access, chunk
        self.chunk_bytes, self.non_model_bytes = chunk_bytes, non_model_bytes
        super().__init__(
            f"device budget of {budget_bytes} bytes is too small for access {access} (chunk {chunk}): "
            f"the chunk needs {chunk_bytes} bytes and the non-model memory at that access is "
            f"{non_model_bytes} bytes, {chunk_bytes + non_model_bytes} bytes in all"
        )


class DataError(ConfigError):
    """The training data cannot be used: a missing path, an empty directory, a corpus shorter than one
    sequence, token ids the model cannot embed. The message names the path and the numbers."""


class UnusedParameterError(ChunkZeroError, RuntimeError):
    """A parameter received no gradient in a step (and ``find_unused_parameters`` is off)."""


class LossScaleError(ChunkZeroError, RuntimeError):
    """Training cannot make progress: ``skipped`` optimizer steps in a row were skipped for non-finite
    gradients at the minimum loss scale ``scale``, the last at step ``step`` (1-based ``step()`` calls)."""

    def __init__(self, message: str, *, step: int, scale: float, skipped: int):
        self.step, self.scale, self.skipped = step, scale, skipped
        super().__init__(message)


class CheckpointError(ChunkZeroError):
    """A checkpoint cannot be saved, found, read or matched to the model; the message names the file or tensor."""


class CheckpointSaveError(CheckpointError):
    """A save failed while writing (Orbax failed, the disk is full, another process did not arrive in time): a
    failure of the run, not bad input; the message names the step, the cause and the previous committed step,
    which is intact."""


class CheckpointFormatError(CheckpointError, ValueError):
    """A checkpoint's metadata is malformed, truncated or of an unknown version."""


class ShapeMismatchError(ChunkZeroError, ValueError):
    """A tensor's shape does not match the expected one; the message names the key and both shapes."""

    def __init__(self, key: str, expected, got, where: str = ""):
        self.key = key
        self.expected = tuple(expected)
        self.got = tuple(got)
        suffix = f" ({where})" if where else ""
        super().__init__(f"shape mismatch for {key!r}: expected {self.expected}, got {self.got}{suffix}")
