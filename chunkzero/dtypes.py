"""Dtype names shared by both backends (numpy has no bfloat16, so dtypes are plain strings)."""

from __future__ import annotations

from .errors import ConfigError

ITEMSIZE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "bool": 1,
}
"""Bytes per element of every dtype a chunk may hold."""

_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "double": "float64",
    "long": "int64",
    "int": "int32",
}


def canonical_dtype(dtype: object) -> str:
    """Return the canonical name (``"float32"``, ``"bfloat16"`` …) of a dtype.

    Accepts strings (``"fp16"``, ``"torch.float16"``, ``"float16"``), numpy dtypes, torch and jax
    dtypes (anything whose ``str()`` ends in the name).

    Raises:
        ConfigError: the dtype is not one chunks can hold.
    """
    if isinstance(dtype, type):  # numpy / jax scalar types: np.float32, jnp.bfloat16
        name = dtype.__name__
    elif isinstance(getattr(dtype, "name", None), str):  # numpy and jax dtypes
        name = dtype.name
    else:  # strings and torch dtypes ("torch.float16")
        name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in ITEMSIZE_BYTES:
        raise ConfigError(f"unsupported dtype {dtype!r}; expected one of {sorted(ITEMSIZE_BYTES)}")
    return name


def itemsize_bytes(dtype: object) -> int:
    """Bytes per element of ``dtype``."""
    return ITEMSIZE_BYTES[canonical_dtype(dtype)]


def numpy_dtype(dtype: object):
    """The numpy dtype of ``dtype`` (bfloat16 as ``ml_dtypes.bfloat16``, which JAX ships; imported on
    first use).

    Raises:
        ConfigError: the dtype is not one chunks can hold.
    """
    import numpy as np

    name = canonical_dtype(dtype)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
