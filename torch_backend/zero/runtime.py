"""How torch's events become chunk calls while a ``ZeroDDP``'s module runs: :class:`ChunkRuntime`.

It turns each event into calls on the chunk it concerns (:class:`torch_backend.zero.chunks.Chunk`'s life
methods) and asks the :class:`~torch_backend.zero.schedule.Scheduler` for gathers and reductions; it keeps
no chunk state of its own.

- **Forward** — while the wrapped module runs, a ``TorchFunctionMode``
  (:class:`~torch_backend.zero.access_mode.ParamAccessMode`) sees every torch call. When an argument is a managed
  parameter its chunk is gathered (if needed) and the tensor is in use for the call (:meth:`ChunkRuntime.run_op`).
  So a parameter used by another module (``F.linear(x, other.weight)``), through an operator (``x @ w``), inside
  ``torch.stack([...])`` or several times is always gathered. With ``reshard_after_forward`` a chunk is released
  once every tensor of it has been used in this forward; whatever is still gathered is released when the forward
  returns, except the first ``prefetch`` chunks of the recorded backward order (gathered ahead, so the backward
  does not start on a miss). A ``torch.compile``'d submodule has its chunks gathered before the call and runs with
  the mode suspended; a submodule called directly under ``no_grad`` runs under the mode too. In a forward that
  releases nothing before its end (one rank; or every sharded chunk kept into the backward) the mode comes off
  once every sharded chunk is gathered, the chunks held until it is back (Note [suspended access mode]).
- **Backward** — ``saved_tensors_hooks`` replace a saved parameter (or a saved view of a chunk
  buffer) by a reference that counts on its chunk; unpacking it gathers the chunk again, and once
  autograd has freed every reference to a chunk, the chunk is released — so a frozen chunk is
  gathered in backward only if a saved tensor needs it, and only for as long. A recomputation in
  backward (activation checkpointing) runs under the same mode and pins what it gathers until the
  chunk's gradients are final (frozen chunks: until the backward ends). A post-accumulate-grad hook
  moves each parameter's final gradient into its chunk's gradient buffer (after a chunk's first, autograd
  adds them there in place: Note [gradients in the buffer] in :mod:`torch_backend.zero.chunk_gradient`); a
  chunk whose tensors are all READY_FOR_REDUCE is handed to the scheduler. A callback queued on the autograd
  engine (from a hook on the forward's outputs, so it belongs to the outermost backward) ends the backward:
  agreement on unused parameters, the remaining reductions, releases, ``param.grad`` placeholders
  (:mod:`torch_backend.zero.chunk_gradient`).

Hook code runs under ``no_torch_function()``, so the torch calls it makes on chunk buffers (and the
collectives it issues) skip the access mode, without a Python frame each.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from chunkzero import ChunkLayout
from chunkzero.errors import ConfigError, ShapeMismatchError, UnusedParameterError

from .access_mode import ALIASING, Entry, ParamAccessMode, SavedParam, SavedView, func_name
from .chunk_gradient import GradPlaceholders
from .chunks import Chunk, Pin
from .schedule import BACKWARD, FORWARD, OUTSIDE, Phase, Scheduler
from .torch_internals import (
    ENGINE_RUN_BACKWARD,
    compiled_original,
    current_autograd_node,
    no_torch_function,
    pop_torch_function_mode,
    push_torch_function_mode,
    storage_key,
    torch_function_mode_depth,
    tree_flatten,
)
from .units import ALIAS, UnitRecorder

__all__ = ["ChunkRuntime"]


def _tensors_in(out) -> list[torch.Tensor]:
    """Tensors in a forward's output: nested tuples, lists, dicts and mappings (HF ``ModelOutput``)."""
    leaves, _ = tree_flatten(out)
    found = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif hasattr(leaf, "values") and callable(leaf.values) and not isinstance(leaf, (str, bytes)):
            found.extend(_tensors_in(list(leaf.values())))
    return found


def _unused_parameter_error(unused) -> UnusedParameterError:
    """The error of a backward in which the layout entries ``unused`` got a gradient on no rank."""
    names = ", ".join(e.name + (f" (alias {', '.join(e.tensor.aliases)})" if e.tensor.aliases else "") for e in unused)
    return UnusedParameterError(
        f"{len(unused)} parameter(s) received no gradient on any rank in this backward pass: {names}. Make every "
        "parameter take part in the loss, freeze it (requires_grad=False) before wrapping, or pass "
        "find_unused_parameters=True to reduce a zero gradient for it.")


class ChunkRuntime:
    """The hooks and per-step state of one ``ZeroDDP`` over ``module``.

    Args:
        module: the wrapped module.
        layout: its chunk layout.
        chunks: the chunks, by index.
        entries: one :class:`Entry` per managed parameter (primary names, layout order).
        scheduler: decides and issues the chunk collectives.
        find_unused_parameters: reduce zero gradients for parameters that got none on any rank.
        reshard_after_forward: release chunks after their use in forward.
    """

    def __init__(self, module: nn.Module, layout: ChunkLayout, chunks: list[Chunk], entries: list[Entry],
                 scheduler: Scheduler, *, find_unused_parameters: bool, reshard_after_forward: bool):
        self.module = module
        self.layout = layout
        self.chunks = chunks
        self.sched = scheduler
        self.find_unused_parameters = find_unused_parameters
        self.reshard_after_forward = reshard_after_forward
        self.entries_by_id: dict[int, Entry] = {id(e.param): e for e in entries}
        self.chunk_by_storage: dict[int, Chunk] = {c.storage_key: c for c in chunks if not c.resident}
        self.trainable = [e for e in entries if e.param.requires_grad]
        self.hook_handles = [
            e.param.register_post_accumulate_grad_hook(self._make_post_grad_hook(e)) for e in self.trainable
        ]
        # Submodules run as one unit: their chunks gathered before the call, the access mode off inside
        # it. torch.compile'd ones from the start (the compiled graph sees plain, gathered parameters);
        # others once a recorded forward shows they use one chunk only (Note [recorded units], units.py).
        self._units: dict[int, list[Entry]] = {}
        inside: set[int] = set()
        for sub in module.modules():
            if compiled_original(sub) is not None and id(sub) not in inside:
                self._units[id(sub)] = self._entries_of(sub)
                inside |= {id(m) for m in compiled_original(sub).modules()}
        self._sharded = [c for c in chunks if not c.resident]
        self.recorder = UnitRecorder(module, self._entries_of, inside | set(self._units)) if self._sharded else None
        """Until a forward has been recorded: the candidate units (Note [recorded units], units.py)."""
        self.recording = False
        """Whether this forward is being recorded."""
        for sub in module.modules():
            if id(sub) not in inside:
                self.hook_handles.append(sub.register_forward_pre_hook(self._submodule_pre_hook))
                self.hook_handles.append(sub.register_forward_hook(self._submodule_post_hook, always_call=True))
        self._suspended: list[tuple[nn.Module, Any]] = []
        self._may_suspend = False
        """In this forward, the access mode may come off once every sharded chunk is gathered
        (Note [suspended access mode])."""
        self._forward_mode_off: ParamAccessMode | None = None
        """The forward's access mode while it is off the stack (Note [suspended access mode])."""
        self._release_later: list[tuple[Chunk, Any]] = []
        self.sync = True
        self._phase: Phase | None = None
        self._mode_stack: list[tuple[nn.Module, ParamAccessMode]] = []
        self._mode = ParamAccessMode(self)
        """The access mode of a forward or backward (stateless: one object, pushed each time)."""
        self._release_in_forward = True
        self._keep_for_backward: set[int] = set()
        self._fwd_used: dict[int, set[str]] = {}
        self._aliased: set[int] = set()
        """Chunks a parameter of which was detached in this forward (kept gathered to its end)."""
        self._bwd_grads: set[int] = set()
        self._finalize_queued = False
        self._pending_error: Exception | None = None
        self._placeholders = GradPlaceholders([(e.param, e.name, e.index) for e in self.trainable])
        self.saved_activations = None
        """While set (a placement trace on CPU), every other saved tensor is held as a
        :class:`~torch_backend.zero.placement.SavedActivation` counted by it."""
        self.backward_passes = 0
        """Backward passes finished so far."""
        self.grad_received = torch.zeros(len(layout.tensors), dtype=torch.bool)
        """Per layout tensor: whether it received a gradient on some rank since the last ``zero_grad``."""

    def _entries_of(self, sub: nn.Module) -> list[Entry]:
        return [self.entries_by_id[id(p)] for p in sub.parameters() if id(p) in self.entries_by_id]

    @contextlib.contextmanager
    def syncing(self, enabled: bool):
        """Inside the context, finished gradients are reduced (``True``) or kept accumulating in the
        chunks' gradient buffers (``False``, ``ZeroDDP.no_sync``); the previous setting comes back after."""
        previous, self.sync = self.sync, bool(enabled)
        try:
            yield
        finally:
            self.sync = previous

    def count_saved_activations(self, counter) -> None:
        """From now on hold every saved tensor that is not a parameter or chunk view as a
        :class:`~torch_backend.zero.placement.SavedActivation` counted by ``counter`` (a
        :class:`~torch_backend.zero.placement.SavedBytes`); ``None`` stops counting."""
        self.saved_activations = counter

    def zero_grad(self) -> None:
        """Drop all accumulated gradients (buffers, reductions in flight, fp32 shards, placeholders)."""
        self.finish_aborted_backward()
        if self._placeholders.installed:
            self._placeholders.clear()
        for c in self.chunks:
            if c.gradient is not None:
                c.gradient.zero()
        self.grad_received.zero_()

    # ================================================================== forward
    def forward(self, args: tuple, kwargs: dict):
        """Run the module with chunks gathered on use; record, prefetch and release (module docstring).

        Raises:
            UnusedParameterError: the previous backward left a parameter without a gradient on every rank.
        """
        self.raise_pending_error()
        if self._placeholders.installed:
            self._placeholders.clear()
        grad_enabled = torch.is_grad_enabled()
        self._release_in_forward = self.reshard_after_forward or not grad_enabled
        self._keep_for_backward = self.sched.prefetched_for(BACKWARD) if grad_enabled else set()
        self._may_suspend = not self._sharded or (
            grad_enabled and self.sched.policy is None
            and (not self._release_in_forward or all(c.index in self._keep_for_backward for c in self._sharded)))
        self._fwd_used = {}
        self._aliased = set()
        self.recording = self.recorder is not None and not self._may_suspend
        if self.recording:
            self.recorder.start()
        self._phase = FORWARD
        self.sched.start(FORWARD)
        backward_next = False
        try:
            with self._intercepting():
                # with no sharded chunk nothing is ever released: a saved tensor needs no reference
                if grad_enabled and (self._sharded or self.saved_activations is not None):
                    with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                        out = self.module(*args, **kwargs)
                else:
                    out = self.module(*args, **kwargs)
            backward_next = grad_enabled
            if self.recording:
                self._units.update(self.recorder.units())
                self.recorder = None  # recorded once
        finally:
            # a forward that raised has no backward: nothing is gathered ahead for it, nothing kept
            self.recording = False
            self._phase = None
            self._fwd_used = {}
            self.sched.end(FORWARD, prefetch_next=BACKWARD if backward_next else None, sync=self.sync)
            for c in self.chunks:
                keep = backward_next and (not self._release_in_forward or c.index in self._keep_for_backward)
                c.rest(release=not keep)
        if grad_enabled:
            for t in _tensors_in(out):
                if t.requires_grad:
                    t.register_hook(self._output_grad_hook)
        return out

    @contextlib.contextmanager
    def _intercepting(self):
        self._mode_stack.append((self, self._mode))
        try:
            with self._mode:
                try:
                    yield
                finally:
                    self._resume_mode()
        finally:
            self._mode_stack.pop()

    # Note [suspended access mode]. The access mode exists to gather a chunk before a torch call reads
    # its parameters and to release it after; each intercepted call costs Python work, and a step
    # makes thousands. In a forward where nothing could be released before its end anyway — no
    # sharded chunk (one rank), or a backward follows and every sharded chunk is kept into it
    # (``reshard_after_forward=False``, or the backward's prefetched chunks are all of them: the
    # one-chunk layout) — the mode comes off the stack at the first submodule call that finds every
    # sharded chunk gathered, its gather waited for (``_try_suspend``), and goes back on when the
    # wrapped module returns or raises (``_resume_mode``). Safe because while it is off every sharded
    # chunk is *held* (``Chunk.hold``): no release path frees its buffer (a nested backward's end, a
    # compiled submodule's release), and an update of its values (an optimizer step, a load) raises.
    # So every parameter is its gathered view, and every view of it stays valid, until the mode is
    # back: nothing the mode would have gathered can be missing. What it would have done and is
    # skipped: recording later first uses (the access order records fewer; it is re-recorded and
    # stays the same from then on) and the per-call tensor states, which only guard releases.
    # Saved tensors are still packed (the hooks do not depend on the mode).
    def _try_suspend(self) -> None:
        """Take the forward's access mode off the stack if every sharded chunk is gathered."""
        if self._phase is not FORWARD or len(self._mode_stack) != 1 or self._suspended:
            return
        for c in self._sharded:
            if not c.is_gathered or c.gather_in_flight:
                return
        mode = self._mode_stack[0][1]
        if torch_function_mode_depth() == 0:
            return
        top = pop_torch_function_mode()
        if top is not mode:  # another mode above ours: leave the stack as it is
            push_torch_function_mode(top)
            return
        for c in self._sharded:
            c.hold()
        self._may_suspend = False
        self._forward_mode_off = mode

    def _resume_mode(self) -> None:
        """Put the forward's access mode back (if it was taken off) and let the chunks go."""
        self._may_suspend = False
        mode, self._forward_mode_off = self._forward_mode_off, None
        if mode is not None:
            push_torch_function_mode(mode)
            for c in self._sharded:
                c.unhold()

    def backward(self, loss: torch.Tensor) -> None:
        """:meth:`torch_backend.ZeroDDP.backward`: ``loss.backward()`` under the access mode.

        Raises:
            ShapeMismatchError: ``loss`` has more than one element (as ``loss.backward()`` refuses).
        """
        if loss.numel() != 1:
            raise ShapeMismatchError("loss", (), tuple(loss.shape), "backward needs a scalar loss")
        run = ENGINE_RUN_BACKWARD
        if run is None or self._mode_stack:
            loss.backward()
            return
        seed = torch.ones_like(loss)  # outside the mode: it takes no parameter
        with self._intercepting():
            # the engine directly: Tensor.backward would go through the mode, whose handler runs with
            # the mode off, and the engine keeps the modes active when it starts
            run((loss,), (seed,), False, False, (), allow_unreachable=True, accumulate_grad=True)

    def use_chunk(self, c: Chunk) -> None:
        """Have ``c`` gathered for a computation now (forward, or a recomputation in backward)."""
        if c.resident:
            return
        if self._phase is BACKWARD:
            c.pin(Pin.RECOMPUTE)  # kept until its gradients are final: the recomputed graph needs it
        self.sched.ensure(c, self._phase or FORWARD)

    def run_op(self, entries: list[Entry], func, args, kwargs):
        """Run the torch call ``func(*args, **kwargs)`` that takes the parameters of ``entries``: their
        chunks gathered, the tensors in COMPUTE during the call (the access mode calls it)."""
        if len(entries) > 1:
            entries = list({id(e): e for e in entries}.values())
        forward = self._phase is FORWARD
        aliasing = forward and func_name(func) in ALIASING
        if self.recording:
            for e in entries:
                self.recorder.touch(ALIAS if aliasing else e.chunk.index)
        for e in entries:
            if not e.chunk.resident:
                self.use_chunk(e.chunk)
            e.chunk.use(e.name)
        try:
            return func(*args, **kwargs)
        finally:
            for e in entries:
                e.chunk.done_using(e.name)
                if aliasing:
                    self._aliased.add(e.chunk.index)
                elif forward:
                    self._after_use(e)

    def _after_use(self, e: Entry) -> None:
        """In forward, a chunk is released once every tensor of it has been used."""
        c = e.chunk
        used = self._fwd_used.setdefault(c.index, set())
        used.add(e.name)
        if self._release_in_forward and len(used) == len(c.tensors) and c.idle and c.index not in self._aliased:
            if self._keep_for_backward and c.index in self._keep_for_backward and self.sched.last_use(FORWARD, c.index):
                return  # the backward starts with it (a tied output head): keep it rather than gather it again
            if self.sched.used_next(FORWARD, c.index):  # the recorded order uses it again next: keep it gathered
                c.forget_uses()  # (so that use is recorded again, and the order stays the same)
                used.clear()
                return
            c.release()

    # ------------------------------------------------------------------ submodule calls outside forward
    def _submodule_pre_hook(self, module, args):  # noqa: ARG002 - torch's forward pre-hook signature
        if self._may_suspend:
            self._try_suspend()
        if self.recording:
            self.recorder.enter(module)
        if self._mode_stack and id(module) not in self._units:  # inside forward, a plain submodule: nothing
            return
        with no_torch_function():  # the engine's own torch calls skip the access mode
            if not self._mode_stack:  # not inside ZeroDDP.forward, nor already intercepting
                if current_autograd_node() is not None:
                    # called while the autograd engine runs a node: a recomputation (activation checkpointing)
                    if self._phase is not BACKWARD:
                        self._begin_backward()
                elif torch.is_grad_enabled():
                    raise ConfigError(
                        f"{type(module).__name__} (inside a ZeroDDP) was called directly with gradients enabled: call "
                        "the ZeroDDP wrapper itself (model(...)) so that its backward can re-gather the chunks; under "
                        "torch.no_grad() submodules may be called directly (e.g. model.module.generate(...))")
                else:
                    self._phase = OUTSIDE
                    self.sched.start(OUTSIDE)
                self._mode.__enter__()
                self._mode_stack.append((module, self._mode))
            entries = self._units.get(id(module))
            if entries is not None:
                held = sorted({e.chunk.index for e in entries})
                for c in held:
                    self.use_chunk(self.chunks[c])
                if self._forward_mode_off is None and torch_function_mode_depth():
                    top = pop_torch_function_mode()
                    if isinstance(top, ParamAccessMode):
                        for c in held:  # (gathered: use_chunk waited for it)
                            self.chunks[c].hold()  # nothing releases it while the mode is off
                        self._suspended.append((module, top))
                    else:  # another mode above ours: leave the stack as it is
                        push_torch_function_mode(top)

    def _submodule_post_hook(self, module, args, output):  # noqa: ARG002 - torch's forward hook signature
        if self.recording:
            self.recorder.exit(module)
        if not self._suspended and (not self._mode_stack or self._mode_stack[-1][0] is not module):
            return  # (the common case, inside forward: nothing to put back or end)
        with no_torch_function():  # the engine's own torch calls skip the access mode
            if self._suspended and self._suspended[-1][0] is module:
                push_torch_function_mode(self._suspended.pop()[1])
                entries = self._units[id(module)]
                for c in {e.chunk.index for e in entries}:
                    self.chunks[c].unhold()
                if self._phase is FORWARD:
                    for e in entries:
                        self._after_use(e)
            if not self._mode_stack or self._mode_stack[-1][0] is not module:
                return
            _, mode = self._mode_stack.pop()
            mode.__exit__(None, None, None)
            if self._phase is OUTSIDE:  # an inference call outside forward: release what it gathered
                self._phase = None
                self.sched.end(OUTSIDE)
                for c in self.chunks:
                    c.rest(release=True)

    # ================================================================== backward
    def _pack(self, t):
        with no_torch_function():  # the engine's own torch calls skip the access mode
            e = self.entries_by_id.get(id(t))
            if e is not None and e.param is t:
                return SavedParam(self, e) if not e.chunk.resident else t
            if self.chunk_by_storage:
                c = self.chunk_by_storage.get(storage_key(t))
                if c is not None:
                    return SavedView(self, c, t)
            counter = self.saved_activations
            if counter is not None:
                if counter.active:
                    return counter.hold(t)
                self.saved_activations = None  # its traced step is over
            return t

    def _unpack(self, x):
        with no_torch_function():  # the engine's own torch calls skip the access mode
            if type(x) is SavedParam:
                if self._phase is not BACKWARD:
                    self._begin_backward()
                e = x.entry
                self._unpacked(e.chunk)
                e.chunk.use(e.name)
                return e.param
            if type(x) is SavedView:
                if self._phase is not BACKWARD:
                    self._begin_backward()
                self._unpacked(x.chunk)
                return x.tensor
            return x if isinstance(x, torch.Tensor) else x.tensor  # an activation a placement trace counts

    def _unpacked(self, c: Chunk) -> None:
        if self._release_later:
            self._flush_releases()
        if torch.is_grad_enabled():  # a create_graph backward: the new graph keeps raw references
            c.pin(Pin.GRAPH)
        self.sched.ensure(c, BACKWARD)

    def saved_released(self, c: Chunk, name: str | None) -> None:
        """Autograd freed a saved reference to ``c`` (``name``: the parameter it referred to).

        A chunk no saved tensor needs is released at once — autograd frees a node's saved tensors
        after the node ran — except inside a custom ``autograd.Function``'s backward, which may free
        them before it computes with them (compiled graphs do): then once that node has finished.
        """
        with no_torch_function():  # the engine's own torch calls skip the access mode
            c.drop_saved_ref(name)
            if self._phase is not BACKWARD or c.has_saved_refs or c.pin_reason is not None:
                return
            node = current_autograd_node()
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                if not any(n is node for _, n in self._release_later):
                    node.register_hook(lambda *_, n=node: self._flush_releases(finished=n))
                self._release_later.append((c, node))
            else:
                c.release_if_idle()

    def _flush_releases(self, finished=None) -> None:
        """Release the chunks whose last reference a custom function's backward freed, once it ran
        (``finished``: the node whose post-hook calls this)."""
        with no_torch_function():  # the engine's own torch calls skip the access mode
            if not self._release_later:
                return
            node = current_autograd_node()
            keep = []
            for c, freed_in in self._release_later:
                if freed_in is node and freed_in is not finished:
                    keep.append((c, freed_in))  # that node is still running
                elif not c.has_saved_refs and c.pin_reason is None:
                    c.release_if_idle()
            self._release_later = keep

    def _output_grad_hook(self, grad):
        with no_torch_function():  # the engine's own torch calls skip the access mode
            if self._phase is not BACKWARD:
                self._begin_backward()
            return grad

    def _begin_backward(self) -> None:
        if self._phase is BACKWARD:
            return
        self._phase = BACKWARD
        self.sched.start(BACKWARD)
        if self._placeholders.installed:
            self._placeholders.clear()
        self._bwd_grads = set()
        if not self._finalize_queued:
            self._finalize_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _make_post_grad_hook(self, e: Entry):
        return functools.partial(self._on_grad, e)

    def _on_grad(self, e: Entry, param) -> None:
        with no_torch_function():  # the engine's own torch calls skip the access mode
            if self._phase is not BACKWARD:
                self._begin_backward()
            if self._release_later:
                self._flush_releases()
            c = e.chunk
            grad = param.grad
            if not c.gradient.landed(e.name, grad):  # else added in place (Note [gradients in the buffer])
                param.grad = None
                c.gradient.add(e.name, grad)
            self._bwd_grads.add(e.index)
            if c.grad_ready(e.name):
                if self.sync:
                    self.sched.mark_ready(c)
                if c.pin_reason in (None, Pin.RECOMPUTE) and not c.has_saved_refs:
                    c.release_if_idle()

    def finish_aborted_backward(self) -> None:
        """End a backward that raised inside the autograd engine, which then drops the callbacks
        queued on it, so :meth:`_finalize_backward` never ran: the same end-of-backward rounds run
        now (every rank whose backward raised takes part, so ranks stay paired), the gradient
        buffers it was accumulating are dropped and every chunk comes to rest. Gradients already
        reduced into the fp32 shards stay, as torch keeps a partial ``.grad``. Does nothing during
        a backward or after one that completed."""
        if self._finalize_queued and current_autograd_node() is None:
            self._finalize_backward(aborted=True)

    def _finalize_backward(self, aborted: bool = False) -> None:
        """End of a backward pass (autograd callback): agree on what got gradients, reduce what is
        left, release, reset states. Never raises (an error is kept for :meth:`raise_pending_error`).
        ``aborted``: the backward raised (:meth:`finish_aborted_backward`): no reduction, no error
        kept, not counted in :attr:`backward_passes`."""
        with no_torch_function():  # the engine's own torch calls skip the access mode
            self._finalize_queued = False
            error = None
            try:
                used = torch.zeros(len(self.layout.tensors), dtype=torch.int32)
                if self._bwd_grads:
                    used[sorted(self._bwd_grads)] = 1
                received = self.sched.end(BACKWARD, used, sync=self.sync) > 0
                if aborted:
                    self._discard_grad_buffers()
                    return
                self.backward_passes += 1
                trainable = self.trainable
                got = received.tolist()
                if any(got[e.index] for e in trainable):
                    unused = [e for e in trainable if not got[e.index]]
                    if unused and not self.find_unused_parameters:
                        error = _unused_parameter_error(unused)
                        self._discard_grad_buffers()
                    else:
                        self.grad_received |= received.to(torch.bool)
                        if self.sync:
                            self.sched.final_reduce()
            except Exception as e:  # noqa: BLE001 - kept and raised outside the autograd engine
                error = e
            finally:
                self._phase = None
                self._bwd_grads = set()
                self._release_later = []
                for c in self.chunks:
                    c.end_backward()
                    c.rest(release=True)
                    if c.gradient is not None:
                        c.gradient.take_views()
                self._placeholders.set(self.grad_received)
            if error is not None:
                self._pending_error = error

    def _discard_grad_buffers(self) -> None:
        """Drop the gradients not yet reduced (their chunks are no longer waiting to be reduced)."""
        for c in self.chunks:
            if c.gradient is not None:
                c.gradient.discard_buffer()
        self.sched.drop_ready()

    def raise_pending_error(self) -> None:
        """Raise (once) the error the last backward found, if any (ZeroOptimizer calls it)."""
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error
