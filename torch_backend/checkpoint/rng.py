"""Per-rank RNG states as JSON (never pickle), saved in a checkpoint's metadata and restored on resume.

Python's and numpy's states are plain lists; torch's CPU and CUDA byte states travel as base64.
"""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from chunkzero.errors import CheckpointFormatError

logger = logging.getLogger("chunkzero.checkpoint")

__all__ = ["reseed", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON: Python, numpy, torch CPU and (if available) CUDA devices."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any], *, source: str = "rng state") -> None:
    """Restore states written by :func:`rng_state`.

    Raises:
        CheckpointFormatError: a field is missing or malformed (names ``source`` and the field).
    """
    try:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
        n = state["numpy"]
        np.random.set_state(
            (
                str(n["kind"]),
                np.asarray(n["keys"], dtype=np.uint32),
                int(n["pos"]),
                int(n["has_gauss"]),
                float(n["cached_gaussian"]),
            )
        )
        torch.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(state["torch"], validate=True)), dtype=torch.uint8)
        )
        if "cuda" in state and torch.cuda.is_available():
            cuda = [
                torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)
                for s in state["cuda"]
            ]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:
                logger.warning(
                    "%s: CUDA RNG states for %d devices, this process sees %d; CUDA RNG not restored",
                    source,
                    len(cuda),
                    torch.cuda.device_count(),
                )
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointFormatError(f"{source}: malformed RNG state ({type(e).__name__}: {e})") from None


def reseed(seed: int) -> None:
    """Seed Python, numpy and torch (CPU and CUDA) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
