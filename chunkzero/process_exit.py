"""How a process that ran a gloo process group ends: without interpreter finalization.

``destroy_process_group()`` does not stop gloo's worker threads; only the process group's C++
destructor joins them, once the last Python reference to the group is gone (a model keeps one
until the garbage collector of interpreter finalization frees it). A worker that completes the
last collective (a barrier) wakes this thread and only then drops its work object. A barrier's
work holds the collectives queued before it, so dropping it can free Python tensors they gathered
into. On a loaded machine the worker can wait for a CPU until this thread is in ``Py_FinalizeEx``;
freeing a Python object then takes the GIL, Python ends the thread (``pthread_exit``), and the
unwinding through ``~AsyncWork`` (noexcept) calls ``std::terminate``: SIGABRT, "terminate called
without an active exception".

So such a process runs what ``Py_FinalizeEx`` runs while the interpreter is still whole
(``threading``'s exit hooks and non-daemon threads, e.g. pending checkpoint saves; then ``atexit``,
e.g. ``jax.distributed`` and logging shutdown), flushes its output and leaves with ``os._exit``, as a
forked ``multiprocessing`` child does: :func:`exit_without_finalization` now, or
:func:`exit_without_finalization_at_exit` once the interpreter exits (a worker whose return value is
still to be delivered by its launcher: ``torch_backend.train.worker``).

Imports the standard library only. Shared by both engines of ``chunkzero train`` (``torch_backend.train``
keeps its old name for it, :mod:`torch_backend.train.process_exit`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_without_finalization", "exit_without_finalization_at_exit"]


def exit_without_finalization(code: int = 0) -> NoReturn:
    """End this process with exit status ``code``: ``threading``'s exit hooks (joining non-daemon
    threads), the ``atexit`` functions, a flush of stdout and stderr, then ``os._exit(code)``, so no
    interpreter finalization runs while gloo's threads live (see the module docstring)."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing left to flush into
                pass
    os._exit(code)


def exit_without_finalization_at_exit(code: int = 0) -> None:
    """When the interpreter exits normally, end with :func:`exit_without_finalization` ``(code)`` instead
    of finalizing.

    For code that must return first (a launched worker's return value is delivered by its launcher after
    it returns). The hook is an ``atexit`` function; ``atexit`` runs the last registered first and the
    hook runs the others itself, so call this last, once nothing else will register one: a function
    registered after it would run twice.
    """

    def hook() -> None:
        atexit.unregister(hook)
        exit_without_finalization(code)

    atexit.register(hook)
