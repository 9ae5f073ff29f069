"""Orbax's files read and written without a ``CheckpointManager``: the saved arrays' index and the
TensorStore read spec Orbax itself would use (for :mod:`chunkzero.checkpoint.reader`), and the export's
parameter tree written one leaf at a time. Orbax is reached only through
:func:`chunkzero.checkpoint.orbax_store._ocp`, so importing this module imports no framework."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointFormatError
from .meta import ArrayPath, array_name
from .orbax_logs import quiet_expected_warnings
from .orbax_store import _ocp


@dataclasses.dataclass(frozen=True)
class ArrayIndex:
    """What a ``state`` item's ``_METADATA`` file says: the saved array paths and their storage driver."""

    item_dir: Path
    paths: frozenset[ArrayPath]
    use_ocdbt: bool
    use_zarr3: bool


def array_index(item_dir: str | os.PathLike) -> ArrayIndex:
    """Parse ``<item_dir>/_METADATA`` (plain JSON; no array is opened).

    Raises:
        CheckpointError: the file is missing.
        CheckpointFormatError: it is not a valid Orbax metadata file (names it).
    """
    item_dir = Path(item_dir).absolute()  # Orbax and TensorStore want absolute paths
    md = item_dir / "_METADATA"
    try:
        doc = json.loads(md.read_bytes())
        paths = frozenset(tuple(k["key"] for k in v["key_metadata"]) for v in doc.get("tree_metadata", {}).values())
        return ArrayIndex(item_dir, paths, bool(doc.get("use_ocdbt", True)), bool(doc.get("use_zarr3", False)))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint array metadata {str(md)!r} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointFormatError(f"{md}: not a valid Orbax metadata file ({e})") from None
    except (KeyError, TypeError):
        raise CheckpointFormatError(f"{md}: malformed tree_metadata entry") from None


def ts_context(index: ArrayIndex) -> Any:
    """The TensorStore context Orbax reads a checkpoint with (shared by every array of one read)."""
    return _ocp().type_handlers.get_ts_context(use_ocdbt=index.use_ocdbt)


def array_read_spec(index: ArrayIndex, path: ArrayPath, context: Any) -> dict:
    """The TensorStore spec that opens saved array ``path`` read-only, as Orbax itself would open it."""
    from etils import epath

    ocp = _ocp()
    info = ocp.type_handlers.ParamInfo(
        name=array_name(path),
        parent_dir=epath.Path(index.item_dir),
        is_ocdbt_checkpoint=index.use_ocdbt,
        use_zarr3=index.use_zarr3,
        ts_context=context,
    )
    return ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=index.use_ocdbt)


# ====================================================================== the export's parameter tree


def write_param_tree(out: str | os.PathLike, tree: Mapping[str, Any], leaf_type: type) -> None:
    """Write a nested tree of lazy leaves as an Orbax PyTree checkpoint at ``out``, one leaf in memory at a time.

    Args:
        out: the (absolute) output directory; must not exist.
        tree: nested dicts whose leaves are ``leaf_type`` instances with ``shape``, ``dtype``, ``size``,
            ``ndim``, ``order`` (a sort key: leaves are written in that order) and ``load()`` (the
            numpy array, read when written and dropped after).
        leaf_type: the leaves' class.

    On disk the leaves are ordinary numpy arrays (value type ``np.ndarray``) written by Orbax's own
    ``NumpyHandler``, so ``StandardCheckpointer().restore(out)`` returns them.
    """
    ocp = _ocp()
    registry = ocp.type_handlers.create_type_handler_registry((leaf_type, _streaming_numpy_handler()))
    quiet_expected_warnings()
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry)) as checkpointer:
        checkpointer.save(Path(out), args=ocp.args.PyTreeSave(dict(tree)))


def _streaming_numpy_handler():
    """Orbax's ``NumpyHandler``, loading each lazy leaf only when it is written, in the leaves' order."""
    ocp = _ocp()
    from orbax.checkpoint import future as ocp_future
    from orbax.checkpoint._src.serialization import ocdbt_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    class StreamingNumpyHandler(ocp.type_handlers.NumpyHandler):
        async def serialize(self, values, infos, args=None):
            args = list(args or [ocp.SaveArgs()] * len(values))
            return [
                ocp_future.CommitFutureAwaitingContractedSignals(
                    self._stream(values, infos, args), name="chunkzero_export"
                )
            ]

        async def _stream(self, values, infos, args):
            for i in sorted(range(len(values)), key=lambda i: values[i].order):
                value, info, arg = values[i], infos[i], args[i]
                await info.await_path_creation()
                a = value.load()
                spec = ts_utils.build_array_write_spec(
                    info=info, arg=arg, global_shape=a.shape, local_shape=a.shape, dtype=a.dtype,
                    use_ocdbt=info.is_ocdbt_checkpoint,
                    process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint),
                    metadata_key=self._metadata_key,
                ).json
                await self._open_and_write(a, spec, info.ts_context)
                del a

    return StreamingNumpyHandler()
