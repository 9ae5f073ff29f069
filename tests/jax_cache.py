"""JAX's persistent compilation cache for the JAX processes the tests start (examples, the notebook's kernel),
where ``chunkzero train --backend jax`` keeps it: a program an earlier run compiled is loaded, not compiled again."""

from __future__ import annotations


def jax_cache_env() -> dict[str, str]:
    """The environment variables that turn the cache on in a new process, in
    ``jax_backend.processes.compilation_cache_dir()``; empty with ``CHUNKZERO_JAX_CACHE=off``."""
    from jax_backend.processes import compilation_cache_dir

    directory = compilation_cache_dir()
    if directory is None:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": str(directory), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
