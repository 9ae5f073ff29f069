"""The unraisable-hook filter of a save (``orbax_logs._drop_closed_loop_unraisables``): a late TensorStore
write after a failed save reports ``RuntimeError: Event loop is closed`` with no object through
``sys.unraisablehook``, which printed a bare traceback above the save's one-line error; every other report
still reaches the hook that was there before."""

import sys
from types import SimpleNamespace

import pytest

from chunkzero.checkpoint import orbax_logs


def _report(error: BaseException, obj=None) -> SimpleNamespace:
    return SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None, err_msg=None, object=obj)


@pytest.fixture
def seen(monkeypatch):
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    return reports


def test_a_closed_loop_callback_is_dropped_and_everything_else_reaches_the_previous_hook(seen):
    orbax_logs._drop_closed_loop_unraisables()
    orbax_logs._drop_closed_loop_unraisables()  # idempotent: one wrapper, so each report arrives once
    closed = RuntimeError("Event loop is closed")
    sys.unraisablehook(_report(closed))
    assert seen == []
    other = [_report(RuntimeError("boom")), _report(ValueError("Event loop is closed")),
             _report(RuntimeError("Event loop is closed"), obj=object())]
    for report in other:
        sys.unraisablehook(report)
    assert seen == other

