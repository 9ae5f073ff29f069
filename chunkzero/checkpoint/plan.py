"""Which saved elements make up a shard of another layout: tensors matched by name or alias.

A checkpoint saved at one world size and chunk size loads into any other: each target shard is a list
of :class:`ReadPiece` s (slices of saved arrays), computed from the two layouts alone. Padding is never
read. :func:`matching_names` is the one place where a tensor's names and aliases are matched.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from ..errors import CheckpointError, ShapeMismatchError
from ..layout import ChunkLayout, TensorSlot, TensorSpec
from .meta import PARAMS_KEY, ArrayPath, chunk_key


def matching_names(tensor: TensorSlot | TensorSpec, keys: Container[str]) -> list[str]:
    """The names of ``tensor`` that ``keys`` holds: its primary name first, then its aliases (tied
    weights), in their order. ``keys`` is any container of names: a layout, a state dict, a set."""
    return [n for n in (tensor.name, *tensor.aliases) if n in keys]


def saved_tensor(
    saved: ChunkLayout, tensor: TensorSlot | TensorSpec, *, source: str = "checkpoint"
) -> TensorSlot:
    """The placement in ``saved`` of ``tensor`` (a tensor of another layout), by name or any alias.

    Raises:
        CheckpointError: no name of ``tensor`` is in ``saved`` (names the tensor and ``source``).
    """
    names = matching_names(tensor, saved)
    if not names:
        raise CheckpointError(f"tensor {tensor.name!r} of the model is not in the checkpoint {source}")
    return saved.tensor(names[0])


def check_compatible(saved: ChunkLayout, target: ChunkLayout, *, source: str = "checkpoint") -> None:
    """Check that ``target`` (the model's layout) holds exactly the saved tensors with the same shapes.

    Tensors are matched by name or alias; world size, chunk size and packing may differ.

    Raises:
        CheckpointError: a tensor of the model is not saved, or a saved tensor is not in the model.
        ShapeMismatchError: a tensor's shape differs (names it, expected = model's, got = saved).
    """
    matched: set[str] = set()
    for t in target.tensors:
        s = saved_tensor(saved, t, source=source)
        if s.shape != t.shape:
            raise ShapeMismatchError(t.name, t.shape, s.shape, f"model vs {source}")
        matched.add(s.name)
    extra = [n for n in saved.names if n not in matched]
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise CheckpointError(
            f"{source} holds tensors the model does not have: {', '.join(map(repr, extra[:5]))}{more}"
        )


def compare_layouts(
    saved: ChunkLayout, target: ChunkLayout, *, source: str = "checkpoint"
) -> tuple[list[str], list[str]]:
    """The tensors one layout has and the other lacks, for a load that allows them (a fine-tune that
    adds a head, an inference checkpoint with extra tensors); tensors matched by name or alias.

    Returns:
        ``(missing, unexpected)``: the primary names of ``target``'s tensors that ``saved`` lacks, and of
        ``saved``'s tensors that ``target`` lacks, each in its layout's order.

    Raises:
        ShapeMismatchError: a tensor in both has two shapes (names it, expected = model's, got = saved).
    """
    missing: list[str] = []
    matched: set[str] = set()
    for t in target.tensors:
        names = matching_names(t, saved)
        if not names:
            missing.append(t.name)
            continue
        s = saved.tensor(names[0])
        if s.shape != t.shape:
            raise ShapeMismatchError(t.name, t.shape, s.shape, f"model vs {source}")
        matched.add(s.name)
    return missing, [n for n in saved.names if n not in matched]


@dataclass(frozen=True)
class ReadPiece:
    """Copy ``array[src_start:src_stop]`` of the saved array ``array`` (a path such as
    ``("params", "chunk_0003")``) to ``dst_offset`` of the target shard."""

    array: ArrayPath
    src_start: int
    src_stop: int
    dst_offset: int

    @property
    def numel(self) -> int:
        return self.src_stop - self.src_start


def read_plan(saved: ChunkLayout, target: ChunkLayout, chunk: int, rank: int, kind: tuple[str, ...] = (PARAMS_KEY,),
              *, missing_ok: bool = False) -> list[ReadPiece]:
    """The saved-array slices that make up ``rank``'s shard of target chunk ``chunk``.

    ``kind`` is the array path without the chunk key: ``("params",)`` or ``("optim", "exp_avg")``.
    Pieces of one saved array that are contiguous in both source and target are merged, so when only
    the world size changed each shard is one read. Padding is not read (it stays zero), and with
    ``missing_ok`` neither are the tensors ``saved`` lacks.

    Raises:
        CheckpointError: a tensor of ``target`` is not in ``saved`` (unless ``missing_ok``).
    """
    pieces: list[ReadPiece] = []
    for t, a, b, shard_offset in target.shard_pieces(chunk, rank):
        if missing_ok and not matching_names(t, saved):
            continue
        s = saved_tensor(saved, t)
        p = ReadPiece((*kind, chunk_key(s.chunk)), s.offset + a, s.offset + b, shard_offset)
        last = pieces[-1] if pieces else None
        if (
            last
            and last.array == p.array
            and last.src_stop == p.src_start
            and last.dst_offset + last.numel == p.dst_offset
        ):
            pieces[-1] = ReadPiece(p.array, last.src_start, p.src_stop, last.dst_offset)
        else:
            pieces.append(p)
    return pieces
