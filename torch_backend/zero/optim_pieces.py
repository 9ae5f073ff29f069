"""The parameters a :class:`~torch_backend.ZeroOptimizer`'s inner torch optimizer steps, and their state.

**Pieces.** This rank owns, of each tensor of a trainable chunk, the flattened elements
``[start, stop)`` that fall in its shard (``ChunkLayout.shard_pieces``; a keep-gathered chunk's
tensors whole, on every rank). Each such piece is one inner-optimizer parameter: a 1-D fp32
``nn.Parameter`` that is a view into the chunk's master shard (so the update lands in the master),
whose ``.grad`` is set, for the step only, to the same view of the reduced gradient shard. A piece
sits in its tensor's param group, so chunks may mix groups, and a tensor without a gradient in a
step is skipped exactly as torch skips ``grad is None``. Only elementwise optimizers are correct on
pieces (the split of a tensor between ranks must not matter).

**State.** Per-element optimizer state (``exp_avg``, ``momentum_buffer`` …) lives in one flat buffer
per (chunk, state key) of ``shard_numel`` elements aligned with the master shard; each piece's state
entry is a view into it. The inner optimizer creates its state lazily, per piece; after each step
:meth:`PieceStates.adopt` moves any state tensor that is not yet such a view into the buffer (once,
at the first step, for optimizers that update in place; Note [adopt what was written]). Checkpoints read
and write the buffers directly. ``step`` counts are kept per tensor (:attr:`PieceStates.steps`,
identical on every rank): 0 means "no state yet", as for a torch parameter that never had a gradient.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch
from torch import nn

from chunkzero.errors import ShapeMismatchError

__all__ = ["Piece", "PieceStates", "build_pieces"]


class Piece:
    """One inner-optimizer parameter: elements ``[start, stop)`` of tensor ``name`` at ``offset`` in
    chunk ``chunk``'s master shard on this rank."""

    __slots__ = ("chunk", "end", "name", "offset", "param", "start", "stop", "tensor_index", "views")

    def __init__(self, name: str, tensor_index: int, chunk, start: int, stop: int, offset: int):
        self.name, self.tensor_index, self.chunk = name, tensor_index, chunk
        self.start, self.stop, self.offset = start, stop, offset
        self.end = offset + stop - start
        """Where the piece ends in the master shard."""
        self.param = nn.Parameter(self.master_view())
        self.views: dict[str, torch.Tensor] = {}
        """The state entries that are views into the chunk's flat buffers (by key)."""

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def master_view(self) -> torch.Tensor:
        return self.chunk.master.detach()[self.offset : self.offset + self.numel]

    def follow_master(self) -> None:
        """Point the parameter at the chunk's current master storage (after the master was replaced)."""
        self.param.data = self.master_view()


def build_pieces(model) -> dict[int, list[Piece]]:
    """This rank's pieces of every trainable chunk, by chunk index, in shard order."""
    index = {t.name: i for i, t in enumerate(model.layout.tensors)}
    out: dict[int, list[Piece]] = {}
    for c in model.chunks:
        if not c.requires_grad:
            continue
        out[c.index] = [Piece(t.name, index[t.name], c, a, b, off)
                        for t, a, b, off in model.layout.shard_pieces(c.index, model.shard_rank)]
    return out


def _step_device(group: dict, param: torch.Tensor) -> torch.device:
    """Where torch keeps a parameter's ``step``: on the CPU, on the parameter's device when the group
    is ``fused`` or ``capturable`` (their kernels read it there)."""
    return param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def _step_tensor(value: int, group: dict, param: torch.Tensor) -> torch.Tensor:
    """A piece's ``step`` as torch keeps it: float32 0-d, on :func:`_step_device`."""
    return torch.tensor(float(value), dtype=torch.float32, device=_step_device(group, param))


# Note [adopt what was written]. The inner optimizer's state is a mapping of this module's own dicts
# (:class:`_StateMap` of :class:`_StateEntry`), which raise their PieceStates' :class:`_Stale` flag when
# written (an item set, ``update``, ``setdefault``, ``|=``). An optimizer that updates in place (torch's)
# writes its entries at its first step only, so ZeroOptimizer.step runs :meth:`PieceStates.adopt`, a walk
# over every piece, only after a step that wrote: one flag read per step, not a loop over tensors. An
# optimizer that replaces its state tensors writes them each step, and is adopted each step. An entry that
# is not one of these dicts (a plain dict put in ``optim.state[p]`` by hand) keeps the flag up, so it too
# is adopted after every step. The dicts hold the flag, not the PieceStates (no reference cycle keeps the
# buffers alive), and their copies (``copy``, ``deepcopy``, pickling) are plain dicts, as torch's are.


class _Stale:
    """Whether a piece's state was written since the last :meth:`PieceStates.adopt`: :attr:`value`."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = True


class _WriteFlagging:
    """The write methods of a dict that raise ``self.stale`` (a :class:`_Stale`) before writing."""

    stale: _Stale

    def __setitem__(self, key, value):
        self.stale.value = True
        super().__setitem__(key, value)

    def update(self, *args, **kwargs):
        self.stale.value = True
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self.stale.value = True
        return super().setdefault(key, default)

    def __ior__(self, other):
        self.update(other)
        return self


class _StateEntry(_WriteFlagging, dict):
    """One piece's inner-optimizer state: a dict whose writes raise ``stale``."""

    def __init__(self, stale: _Stale, *args, **kwargs):
        self.stale = stale
        super().__init__(*args, **kwargs)

    def __reduce__(self):  # a copy is a plain dict
        return dict, (dict(self),)


class _StateMap(_WriteFlagging, collections.defaultdict):
    """The inner optimizer's ``state``: a ``defaultdict`` of :class:`_StateEntry` whose writes raise ``stale``."""

    def __init__(self, stale: _Stale, entries=()):
        self.stale = stale
        super().__init__(functools.partial(_StateEntry, stale), entries)

    def __reduce__(self):  # a copy is torch's defaultdict(dict)
        return collections.defaultdict, (dict,), None, None, iter(self.items())


class PieceStates:
    """The flat per-chunk state buffers behind the pieces' optimizer state (see the module docstring).

    Args:
        model: the ZeroDDP model.
        state: the inner optimizer's ``state`` (keyed by piece parameter); its entries are copied into
            :attr:`state`, which replaces it (Note [adopt what was written]).
        groups: the inner optimizer's ``param_groups`` (where a piece's ``step`` lives depends on them).
        pieces: :func:`build_pieces`'s result.
    """

    def __init__(self, model, state, groups: list[dict], pieces: dict[int, list[Piece]]):
        self.stale = _Stale()
        """Whether a state entry was written since the last :meth:`adopt` (``stale.value``; Note [adopt what was
        written])."""
        self.state = _StateMap(self.stale, ((k, _StateEntry(self.stale, v)) for k, v in state.items()))
        """The inner optimizer's ``state`` from now on (keyed by piece parameter)."""
        self.groups = groups
        self.pieces = pieces
        self.chunks = {ci: model.chunks[ci] for ci in pieces}
        self.tensor_index: dict[str, int] = {t.name: i for i, t in enumerate(model.layout.tensors)}
        """primary name -> the tensor's index in the layout (the index into :attr:`steps`)."""
        index = self.tensor_index
        self.chunk_tensors = {ci: [index[t.name] for t in model.layout.chunk_tensors(ci)] for ci in pieces}
        """chunk index -> layout indices of all its tensors (on every rank, owned here or not)."""
        self.flat: dict[int, dict[str, torch.Tensor]] = {}
        """chunk index -> state key -> 1-D buffer of ``shard_numel`` elements."""
        self.keys: list[str] = []
        """Per-element state keys, in the order first seen."""
        self.steps = torch.zeros(len(model.layout.tensors), dtype=torch.int64)
        """Per layout tensor: the updates applied to it (torch's per-parameter ``step``); 0 = no state."""
        self.uses_step = False
        """Whether the inner optimizer keeps a ``step`` entry (Adam-style) per parameter."""
        self.scalars: dict[int, dict[str, torch.Tensor]] = {}
        """chunk index -> 0-d state entries other than ``step``, as loaded by :meth:`load_shard_state`."""

    # ------------------------------------------------------------------ after a step
    def adopt(self) -> None:
        """Move every per-element state tensor that is not a view of a flat buffer into one (ZeroOptimizer
        calls it after a step that wrote state: :attr:`stale`)."""
        watched = True
        for ci, pieces in self.pieces.items():
            for p in pieces:
                st = self.state.get(p.param)
                if st is None:
                    continue
                watched = watched and type(st) is _StateEntry
                for key, value in st.items():
                    if key == "step":
                        self.uses_step = True
                    elif (
                        isinstance(value, torch.Tensor)
                        and value.shape == p.param.shape
                        and value is not p.views.get(key)
                    ):
                        view = self._buffer(ci, key, value.dtype)[p.offset : p.offset + p.numel]
                        view.copy_(value)
                        st[key] = p.views[key] = view
        for ci in self.pieces:  # every trainable chunk holds every key (a checkpoint saves each chunk's)
            for key in self.keys:
                self._buffer(ci, key, torch.float32)
        self.stale.value = not watched

    def _buffer(self, ci: int, key: str, dtype: torch.dtype) -> torch.Tensor:
        flat = self.flat.setdefault(ci, {})
        buf = flat.get(key)
        if buf is None:
            chunk = self.chunks[ci]
            buf = flat[key] = torch.zeros(chunk.shard_numel, dtype=dtype, device=chunk.master.device)
            if key not in self.keys:
                self.keys.append(key)
        return buf

    def follow_master(self, ci: int) -> None:
        """Chunk ``ci``'s master was replaced (a placement moved it): its state buffers move to the
        master's device (a copy, also where both are the same memory) and the pieces' state entries
        become views of the new buffers; a ``step`` goes where torch keeps it for the new device
        (:func:`_step_device`: host → device under a fused AdamW too), other 0-d entries kept off the
        CPU move along."""
        flat = self.flat.get(ci)
        if not flat:
            return
        device = self.chunks[ci].master.device
        group_of = {id(q): g for g in self.groups for q in g["params"]}
        for key, buf in flat.items():
            flat[key] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
            flat[key].copy_(buf)
        for p in self.pieces[ci]:
            st = self.state.get(p.param)
            for key in list(p.views):
                p.views[key] = flat[key][p.offset : p.offset + p.numel]
                if st is not None and key in st:
                    st[key] = p.views[key]
            for key, value in (st or {}).items():
                if not isinstance(value, torch.Tensor) or value.dim() != 0:
                    continue
                if key == "step":
                    st[key] = value.to(_step_device(group_of.get(id(p.param), {}), p.param))
                elif value.device.type != "cpu":
                    st[key] = value.to(device)

    # ------------------------------------------------------------------ shard-level I/O
    def shard_state(self, ci: int) -> dict[str, torch.Tensor]:
        """The live flat buffers of chunk ``ci``, its other 0-d entries, and its ``step`` (the largest
        of its tensors'); empty while it has no state."""
        out: dict[str, torch.Tensor] = dict(self.flat.get(ci, {}))
        if not out:
            return out
        out.update(self.scalars.get(ci, {}))
        if self.uses_step:
            out["step"] = torch.tensor(float(self.steps[self.chunk_tensors[ci]].max()), dtype=torch.float32)
        return out

    def load_shard_state(self, ci: int, state: dict[str, Any], step_if_missing: int) -> None:
        """Set chunk ``ci``'s state: 1-D entries (``shard_numel``) into its flat buffers (in place where
        they exist; an entry that *is* the buffer is kept), ``step`` for every tensor of the chunk
        (``step_if_missing`` when absent), other 0-d entries as they are. An empty ``state`` clears it.

        Raises:
            ShapeMismatchError: a 1-D entry is not ``shard_numel`` long.
        """
        chunk = self.chunks[ci]
        scalars: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            value = torch.as_tensor(value)
            if key == "step":
                continue
            if value.dim() >= 1:
                if tuple(value.shape) != (chunk.shard_numel,):
                    raise ShapeMismatchError(
                        f"chunk {ci} optimizer state {key!r}", (chunk.shard_numel,), tuple(value.shape)
                    )
                buf = self._buffer(ci, key, torch.float32)
                if buf.data_ptr() != value.data_ptr():
                    buf.copy_(value)
            else:
                scalars[key] = value.to(torch.float32, copy=True) if value.is_floating_point() else value.clone()
        self.scalars[ci] = scalars
        if not state:
            self.flat.pop(ci, None)
            step = 0
        elif "step" in state:
            self.uses_step = True
            step = int(torch.as_tensor(state["step"]).item())
        else:
            step = step_if_missing
        self.steps[self.chunk_tensors[ci]] = step
        self.attach(ci)

    def load_shards(self, ci: int, shards: dict[str, torch.Tensor], steps: dict[int, int], *, uses_step: bool) -> None:
        """Set chunk ``ci``'s state from a torch-format state dict's values, then :meth:`attach` it.

        Args:
            ci: the chunk's index.
            shards: state key -> this rank's 1-D shard (``shard_numel`` elements, any device), copied into the
                key's flat buffer (an fp32 one is made on the master's device where the key is new).
            steps: layout tensor index -> its ``step`` (0: no state).
            uses_step: whether the dict keeps a ``step`` per tensor (Adam-style).
        """
        self.flat.setdefault(ci, {})
        for key, shard in shards.items():
            self._buffer(ci, key, torch.float32).copy_(shard)
        for index, step in steps.items():
            self.steps[index] = step
        self.uses_step = self.uses_step or uses_step
        self.attach(ci)

    def attach(self, ci: int) -> None:
        """Rebuild the inner optimizer's state of chunk ``ci``'s pieces from the flat buffers and
        :attr:`steps` (a tensor with step 0 gets no state)."""
        group_of = {id(p): g for g in self.groups for p in g["params"]}
        flat = self.flat.get(ci, {})
        for p in self.pieces.get(ci, []):
            step = int(self.steps[p.tensor_index])
            if step == 0 or not flat:
                self.state.pop(p.param, None)
                p.views = {}
                continue
            p.views = {k: buf[p.offset : p.offset + p.numel] for k, buf in flat.items()}
            st = _StateEntry(self.stale, p.views)
            for k, v in self.scalars.get(ci, {}).items():
                st[k] = v.clone()
            if self.uses_step:
                st["step"] = _step_tensor(step, group_of.get(id(p.param), {}), p.param)
            self.state[p.param] = st

    def bytes_per_element(self) -> int | None:
        """Bytes of per-element state the optimizer keeps per master element (the sum over the state
        keys of their element sizes: 8 for Adam's two fp32 moments); ``None`` while it has no state."""
        flat = next((f for f in self.flat.values() if f), None)
        if not flat:
            return None
        return sum(b.element_size() for b in flat.values())

    def state_bytes(self) -> list[tuple[torch.device, int]]:
        """``(device, bytes)`` of each flat buffer and of every other state tensor (0-d entries)."""
        out = [(b.device, b.numel() * b.element_size()) for flat in self.flat.values() for b in flat.values()]
        for pieces in self.pieces.values():
            for p in pieces:
                for k, v in self.state.get(p.param, {}).items():
                    if isinstance(v, torch.Tensor) and p.views.get(k) is not v:
                        out.append((v.device, v.numel() * v.element_size()))
        return out
