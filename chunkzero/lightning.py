"""``chunkzero.lightning.ZeroStrategy``: the public name of the Lightning strategy, which lives in the
torch backend (:mod:`torch_backend.lightning`). Importing this module imports no framework; the first
use of ``ZeroStrategy`` imports torch and lightning (``pip install 'chunkzero[lightning]'``)."""

from __future__ import annotations

__all__ = ["ZeroStrategy"]


def __getattr__(name: str):
    if name == "ZeroStrategy":
        from torch_backend.lightning import ZeroStrategy

        return ZeroStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
