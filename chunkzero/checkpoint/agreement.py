"""What the ranks of one save or load must agree on, checked on one gathered record per rank.

A save is collective: if two ranks were handed different directories or steps, each would wait for
the other inside Orbax's commit, for ever. So before anything is written, every rank states what it
was asked to do — :func:`save_target`: the resolved directory, the step, ``max_to_keep`` and a
SHA-256 digest of its chunk layout — the backend gathers the records (one all-gather of JSON), and
:func:`check_agreement` raises the same error on every rank when they differ, naming the field and
both ranks' values. A load gathers :func:`load_outcome` records after its reads, so every rank learns
which rank failed and why, and that they all read the same step.

Plain data and the standard library: the gather itself is the backend's (torch: ``all_gather_json``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..layout import ChunkLayout


def layout_digest(layout: ChunkLayout) -> str:
    """SHA-256 (hex) of ``layout``'s canonical JSON document: equal on two ranks iff their layouts are."""
    return hashlib.sha256(json.dumps(layout.to_dict(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save_target(
    directory: str | os.PathLike, step: int, layout: ChunkLayout, *, max_to_keep: int | None
) -> dict[str, Any]:
    """This rank's record of a save: what every rank must have been asked for.

    Returns:
        ``{"directory": absolute path, "step": step, "max_to_keep": max_to_keep, "layout_sha256": digest}``
        (JSON-able).
    """
    return {"directory": str(Path(directory).resolve()), "step": int(step), "max_to_keep": max_to_keep,
            "layout_sha256": layout_digest(layout)}


_FIELD_WORDS = {"layout_sha256": "chunk layout (SHA-256)", "step_dir": "step directory"}


def check_agreement(records: Sequence[Mapping[str, Any]], what: str) -> None:
    """Raise unless every rank's record equals rank 0's.

    Args:
        records: one record per rank, in rank order (:func:`save_target`, or the ``"step_dir"`` of
            :func:`load_outcome`).
        what: the operation, for the message (``"save"``, ``"load"``).

    Raises:
        CheckpointError: a rank's record differs; the message names the field, the first rank that
            differs and both values, e.g. ``ranks disagree on the directory of the save: rank 0 has
            '/runs/a', rank 1 has '/runs/b'``. Every rank raises the same error (the records are the same
            on every rank), so none is left waiting.
    """
    first = records[0]
    for q, r in enumerate(records[1:], 1):
        for key in dict.fromkeys([*first, *r]):
            if first.get(key) != r.get(key):
                raise CheckpointError(
                    f"ranks disagree on the {_FIELD_WORDS.get(key, key)} of the {what}: rank 0 has {first.get(key)!r}, "
                    f"rank {q} has {r.get(key)!r}; every rank must {what} the same step of the same directory"
                    + (" (nothing was written)" if what == "save" else "")
                )


def load_outcome(step_dir: str | os.PathLike | None, error: BaseException | None) -> dict[str, Any]:
    """This rank's record after the reads of a load: the step directory it read (``None`` if it could
    not resolve one) and its error as ``"Type: message"`` (``None`` on success). JSON-able."""
    return {"step_dir": None if step_dir is None else str(Path(step_dir).resolve()),
            "error": None if error is None else f"{type(error).__name__}: {error}"}


def failed_ranks(outcomes: Sequence[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """``(rank, "Type: message")`` of every rank whose :func:`load_outcome` holds an error, in rank order."""
    return [(q, o["error"]) for q, o in enumerate(outcomes) if o.get("error")]
