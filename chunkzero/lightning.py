"""``chunkzero.lightning.ZeroStrategy`` and ``chunkzero.lightning.ZeroEMACallback``: the public names of
the Lightning strategy and EMA callback, which live in the torch backend (:mod:`torch_backend.lightning`,
:mod:`torch_backend.lightning_ema`). Importing this module imports no framework; the first use of a name
imports torch and lightning (``pip install 'chunkzero[lightning]'``)."""

from __future__ import annotations

__all__ = ["ZeroEMACallback", "ZeroStrategy"]


def __getattr__(name: str):
    if name == "ZeroStrategy":
        from torch_backend.lightning import ZeroStrategy

        return ZeroStrategy
    if name == "ZeroEMACallback":
        from torch_backend.lightning_ema import ZeroEMACallback

        return ZeroEMACallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
