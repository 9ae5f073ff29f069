"""What Orbax, absl, ``concurrent.futures`` and TensorStore would print that chunkzero reports itself, or that
comes from choices made on purpose: the filters a save installs (:func:`quiet_saves`), and those of every
Orbax call (:func:`quiet_expected_warnings`). A failed save is raised once, as one line, by
:mod:`chunkzero.checkpoint.orbax_store`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any


def quiet_saves() -> None:
    """Install the filters of a save (each kept once however often installed): Orbax's small-block warning,
    its save threads' tracebacks, and the late writes of a failed save (a log record and an unraisable)."""
    logging.getLogger("absl").addFilter(_without_small_chunk_warning)
    logging.getLogger("absl").addFilter(_without_orbax_thread_errors)
    logging.getLogger("concurrent.futures").addFilter(_without_closed_loop_callbacks)
    _drop_closed_loop_unraisables()


def quiet_expected_warnings() -> None:
    """Install the filter of every Orbax call (a read, an export): Orbax's warnings about choices made on
    purpose (kept once)."""
    logging.getLogger("absl").addFilter(_without_expected_warnings)


def _without_small_chunk_warning(record: logging.LogRecord) -> bool:
    """Drop Orbax's "target_byte_size too small" warning: the small storage blocks are chosen on purpose
    (a resume reads only the blocks it owns)."""
    return "target_byte_size too small" not in record.getMessage()


def _without_orbax_thread_errors(record: logging.LogRecord) -> bool:
    """Drop the errors Orbax's save threads log with their tracebacks (every process, every thread, one
    failure): the save raises :class:`CheckpointSaveError` once, in one line (``orbax_store._not_saved``)."""
    if record.levelno < logging.ERROR:
        return True
    # absl reports its own file as the caller; Orbax starts its messages with "[process=N]"
    return f"{os.sep}orbax{os.sep}" not in record.pathname and not record.getMessage().startswith("[process=")


def _without_closed_loop_callbacks(record: logging.LogRecord) -> bool:
    """Drop ``concurrent.futures``' "exception calling callback" for a write that finished after its save had
    failed (a full disk): the save's event loop is closed by then (``RuntimeError: Event loop is closed``), and
    the failure is raised once, in one line (``orbax_store._not_saved``)."""
    error = record.exc_info[1] if record.exc_info else None
    return not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed")


def _closed_loop_unraisable(unraisable: Any) -> bool:
    """Whether ``unraisable`` (a ``sys.UnraisableHookArgs``) is the same late write as
    :func:`_without_closed_loop_callbacks`, reported by TensorStore's own thread with no object: its done
    callback calls ``call_soon_threadsafe`` on the failed save's closed event loop."""
    error = unraisable.exc_value
    return (unraisable.object is None and isinstance(error, RuntimeError)
            and str(error) == "Event loop is closed")


def _drop_closed_loop_unraisables() -> None:
    """Chain a ``sys.unraisablehook`` that drops :func:`_closed_loop_unraisable` reports (printed as a bare
    traceback on stderr otherwise) and hands every other report to the hook it replaces. Idempotent."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_callbacks", False):
        return

    def hook(unraisable: Any) -> None:
        if not _closed_loop_unraisable(unraisable):
            previous(unraisable)

    hook.drops_closed_loop_callbacks = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


_EXPECTED_ABSL_WARNINGS = (
    "Given directory is read only",  # every read manager is read-only on purpose (it never saves)
    "No jax.Array in TypeHandlerRegistry",  # an export registers its numpy leaves' handler only, on purpose
)


def _without_expected_warnings(record: logging.LogRecord) -> bool:
    """Drop Orbax's absl warnings about choices made here on purpose (:data:`_EXPECTED_ABSL_WARNINGS`)."""
    message = record.getMessage()
    return not any(w in message for w in _EXPECTED_ABSL_WARNINGS)
