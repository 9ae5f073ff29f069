"""One process of the multi-process reduce-scatter check (started by test_multiprocess.py through
chunkzero.workers.launch_processes): 2 CPU devices, fp32 and fp64 blocks of 16 KiB to 16 MiB per device."""

import sys

from chunkzero.workers import write_result

try:
    import jax

    from jax_backend.processes import join_processes, process_mesh

    join_processes(2, 60.0)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    from jax_backend.collectives import check_reduce_scatter, reduce_scatter_method

    sizes = [int(s) for s in sys.argv[1].split(",")]
    records = check_reduce_scatter(process_mesh(), sizes, (jnp.float32, jnp.float64))
    write_result({"status": "ok", "records": records, "method": reduce_scatter_method(),
                  "devices": jax.device_count(), "processes": jax.process_count()})
except Exception as e:  # the launcher shows this line
    write_result({"status": "error", "message": f"{type(e).__name__}: {e}"})
    raise
