"""The chunkzero checkpoint format (DESIGN.md §5), read and written here for both backends.

One step is one standard Orbax checkpoint directory ``<root>/<step>/``: the item ``state`` holds every
chunk and optimizer-state chunk as a 1-D global array, the item ``meta`` the JSON document of
:class:`CheckpointMeta`. The backends only adapt their tensors (torch ↔ numpy, ``jax.Array``) and their
process mesh; everything about the format is in this package:

- :mod:`.meta` — names, the metadata schema and its validation; saved-shard ranges and their checksums.
- :mod:`.checksums` — the checksum algorithm, storage blocks, the checksum record's validation.
- :mod:`.agreement` — what the ranks of a save or load must agree on.
- :mod:`.steps` — committed steps on disk and reading a step's metadata (file system only).
- :mod:`.tree` — the ``state`` tree ↔ array paths; one rank's checked shards.
- :mod:`.plan` — matching tensors by name or alias; which saved slices make up a shard of another layout.
- :mod:`.reader` — TensorStore reads of saved slices into numpy (loads and the export).
- :mod:`.orbax_store` — the one module that touches Orbax: managers, saves, restores, read specs.
- :mod:`.export` — a checkpoint's parameters as safetensors or an Orbax parameter tree, streamed.

Importing this package imports numpy and the standard library only; Orbax, JAX and TensorStore are
imported by the functions that need them.
"""

from ..errors import CheckpointError, CheckpointFormatError  # the format's errors, importable with its names
from .checksums import CHECKSUM_ALGORITHM, STORAGE_BLOCK_BYTES, checksum_key, combine_checksums, shard_checksum
from .meta import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    EMA_KEY,
    META_FILENAME,
    META_ITEM,
    MIXED_PRECISIONS,
    OPTIM_KEY,
    PARAMS_KEY,
    STATE_ITEM,
    ArrayPath,
    CheckpointMeta,
    EmaMeta,
    OptimizerMeta,
    UnverifiedCheckpointWarning,
    array_name,
    check_ema_decay,
    chunk_index,
    chunk_key,
    ema_decay_at,
    param_array_dtype,
)
from .plan import ReadPiece, check_compatible, compare_layouts, matching_names, read_plan, saved_tensor
from .steps import is_step_dir, latest_step, list_steps, read_meta, resolve_step_dir
from .tree import flat_arrays, shard_arrays, state_tree

__all__ = [
    "ArrayPath",
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "CHECKSUM_ALGORITHM",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMeta",
    "EMA_KEY",
    "EmaMeta",
    "check_ema_decay",
    "ema_decay_at",
    "META_FILENAME",
    "META_ITEM",
    "MIXED_PRECISIONS",
    "OPTIM_KEY",
    "OptimizerMeta",
    "PARAMS_KEY",
    "ReadPiece",
    "STATE_ITEM",
    "STORAGE_BLOCK_BYTES",
    "array_name",
    "check_compatible",
    "compare_layouts",
    "checksum_key",
    "combine_checksums",
    "chunk_index",
    "chunk_key",
    "flat_arrays",
    "is_step_dir",
    "latest_step",
    "list_steps",
    "matching_names",
    "param_array_dtype",
    "read_meta",
    "read_plan",
    "resolve_step_dir",
    "saved_tensor",
    "shard_arrays",
    "UnverifiedCheckpointWarning",
    "shard_checksum",
    "state_tree",
]
