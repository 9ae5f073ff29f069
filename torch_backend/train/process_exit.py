"""How a process that ran a gloo process group ends: without interpreter finalization.

The mechanism is framework-free and lives in :mod:`chunkzero.process_exit` (the JAX workers of
``chunkzero train --backend jax`` end the same way); this module keeps its torch-side name."""

from chunkzero.process_exit import exit_without_finalization, exit_without_finalization_at_exit

__all__ = ["exit_without_finalization", "exit_without_finalization_at_exit"]
