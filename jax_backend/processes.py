"""The processes of a multi-process JAX run on CPU: who this one is, and joining the others.

A process learns its place from the environment — :data:`chunkzero.workers.COORDINATOR_ENV`
(``host:port`` of process 0), :data:`~chunkzero.workers.NUM_PROCESSES_ENV` and
:data:`~chunkzero.workers.PROCESS_ID_ENV` — set by :func:`chunkzero.workers.launch_processes` or by an
external launcher. :func:`join_processes` gives it ``devices_per_process`` CPU devices
(``jax_num_cpu_devices``) and calls ``jax.distributed.initialize`` with every wait bounded: the
start-up, the heartbeat after which a silent peer counts as dead, and the shutdown barrier. JAX then
runs CPU collectives across the processes over gloo. :func:`process_mesh` is the 1-D mesh of all
devices in process order, so process ``p``'s devices are ranks ``p·K … p·K + K − 1``.

Call :func:`join_processes` before anything else uses JAX (devices are fixed on first use).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from chunkzero.errors import ConfigError
from chunkzero.workers import COORDINATOR_ENV, CPU_THREADS_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV


@dataclass(frozen=True)
class ProcessPlace:
    """This process in its run: ``coordinator`` (``host:port`` or ``None`` when alone), ``num_processes``,
    ``process_id``."""

    coordinator: str | None
    num_processes: int
    process_id: int


def process_place(environ: dict | None = None) -> ProcessPlace:
    """This process's :class:`ProcessPlace` from the environment (alone when none of the variables is set).

    Raises:
        ConfigError: some but not all of the variables are set, or they are not consistent integers.
    """
    env = os.environ if environ is None else environ
    names = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)
    present = [n for n in names if env.get(n)]
    if not present:
        return ProcessPlace(None, 1, 0)
    if len(present) != len(names):
        missing = [n for n in names if n not in present]
        raise ConfigError(f"multi-process JAX: {', '.join(present)} set but {', '.join(missing)} not")
    try:
        n, i = int(env[NUM_PROCESSES_ENV]), int(env[PROCESS_ID_ENV])
    except ValueError:
        raise ConfigError(
            f"{NUM_PROCESSES_ENV}={env[NUM_PROCESSES_ENV]!r} and {PROCESS_ID_ENV}={env[PROCESS_ID_ENV]!r} "
            "must be integers"
        ) from None
    if n < 1 or not 0 <= i < n:
        raise ConfigError(f"{PROCESS_ID_ENV}={i} must be in [0, {NUM_PROCESSES_ENV}={n})")
    if ":" not in env[COORDINATOR_ENV]:
        raise ConfigError(f"{COORDINATOR_ENV}={env[COORDINATOR_ENV]!r} must be host:port")
    return ProcessPlace(env[COORDINATOR_ENV], n, i)


def join_processes(devices_per_process: int, timeout_s: float, place: ProcessPlace | None = None, *,
                   threads: int | None = None) -> ProcessPlace:
    """Configure JAX for CPU with ``devices_per_process`` devices and, with more than one process, join
    the others (``jax.distributed.initialize``); every wait is bounded by ``timeout_s`` seconds (a peer
    silent for that long counts as dead). ``threads``: bound XLA:CPU's threads (:func:`bound_cpu_threads`);
    ``None``: XLA's default.

    Raises:
        ConfigError: a bad ``devices_per_process``/``timeout_s``, or JAX already initialised with other devices.
    """
    import jax

    if isinstance(devices_per_process, bool) or not isinstance(devices_per_process, int) or devices_per_process < 1:
        raise ConfigError(f"--devices-per-process must be a positive int, got {devices_per_process!r}")
    place = place or process_place()
    seconds = max(1, math.ceil(timeout_s))
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices_per_process)
    if place.num_processes > 1 and not jax.distributed.is_initialized():
        jax.distributed.initialize(place.coordinator, place.num_processes, place.process_id,
                                   initialization_timeout=seconds, heartbeat_timeout_seconds=seconds,
                                   shutdown_timeout_seconds=seconds)
    if threads is not None:
        bound_cpu_threads(threads)
    if jax.local_device_count() != devices_per_process:
        raise ConfigError(f"JAX has {jax.local_device_count()} local devices, --devices-per-process asks for "
                          f"{devices_per_process} (was JAX used, or XLA_FLAGS set, before the run joined?)")
    return place


def cpu_threads(env: dict | None = None) -> int | None:
    """The XLA:CPU threads this process should run: ``$CHUNKZERO_CPU_THREADS``
    (:data:`chunkzero.workers.CPU_THREADS_ENV`, which ``chunkzero train --backend jax`` sets to cores /
    processes), ``None`` (XLA's default, every core) when unset, ``0`` or not a positive integer."""
    value = (os.environ if env is None else env).get(CPU_THREADS_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def bound_cpu_threads(threads: int) -> bool:
    """Create JAX's CPU client with thread pools of ``threads`` threads (XLA sizes its intra-op pools by the
    CPU cores the creating thread may run on), then let every thread of the process run on all the cores
    again. Call before anything creates the client (:func:`join_processes` calls it). Returns whether the
    bound was applied (``False`` off Linux, or when ``threads`` is not fewer than the cores).

    JAX 0.10 has no option for XLA:CPU's thread count (``--xla_cpu_multi_thread_eigen=false`` also turns
    XNNPACK's threads off and runs dots ~2.6× slower), so the bound is taken from the affinity mask at
    creation; the threads are not pinned afterwards."""
    import jax

    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        jax.devices()
        return False
    if threads >= len(cores):
        jax.devices()
        return False
    first = (os.getpid() * threads) % len(cores)  # spread the creating threads' cores over the processes
    os.sched_setaffinity(0, {cores[(first + k) % len(cores)] for k in range(threads)})
    try:
        jax.devices()
        # warm XLA's pools up (some start on first use) while the mask still holds
        jax.block_until_ready(jax.jit(lambda x: x @ x)(jax.numpy.ones((64, 64))))
    finally:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:  # the thread ended meanwhile
                pass
    return True


COMPILATION_CACHE_ENV = "CHUNKZERO_JAX_CACHE"
"""The JAX compilation cache's root directory (``off``: none); default ``$XDG_CACHE_HOME/chunkzero/jax``
(``~/.cache/chunkzero/jax``). Entries go in a subdirectory per host CPU (:func:`host_cpu_id`)."""


def host_cpu_id(cpuinfo: str | None = None) -> str:
    """A short name of this host's CPU kind: ``<machine>-<12 hex digits>``, the digits a SHA-256 of its
    instruction-set features (the ``flags`` or ``Features`` line of ``/proc/cpuinfo``, given as ``cpuinfo`` or
    read; elsewhere ``platform.processor()``), order-insensitive.

    Note [a cache per CPU]: JAX's cache key does not name the host CPU, and XLA:CPU loads an executable compiled
    for other instruction-set features with only a logged error (``cpu_aot_loader.cc``), then runs code this CPU
    may not have (AVX-512, AMX), which can kill the process (SIGILL). A home directory shared by machines, or a
    disk moved between them, must not hand one CPU's programs to another."""
    import hashlib
    import platform

    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    features = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                     if line.split(":", 1)[0].strip() in ("flags", "Features") and ":" in line), None)
    text = " ".join(sorted(set(features))) if features else platform.processor()
    return f"{platform.machine() or 'unknown'}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def compilation_cache_dir(env: dict | None = None) -> Path | None:
    """Where :func:`use_compilation_cache` keeps compiled programs: ``<root>/<host_cpu_id()>`` (Note [a cache
    per CPU]), the root ``$CHUNKZERO_JAX_CACHE`` (``off`` or empty: ``None``), else ``$XDG_CACHE_HOME/chunkzero/jax``,
    else ``~/.cache/chunkzero/jax``."""
    env = os.environ if env is None else env
    if COMPILATION_CACHE_ENV in env:
        value = env[COMPILATION_CACHE_ENV]
        if value.strip().lower() in ("", "off", "0", "none"):
            return None
        root = Path(value)
    else:
        root = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chunkzero" / "jax"
    return root / host_cpu_id()


def use_compilation_cache(directory: Path | None) -> bool:
    """Turn on JAX's persistent compilation cache in ``directory`` (created), every compiled program kept
    whatever its compile time, so a restarted run's step loads its executable instead of compiling it again.
    Returns whether it is on: a directory that cannot be created leaves it off (the run compiles, slower)."""
    import jax

    if directory is None:
        return False
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _write_cache_on_every_process()
    return True


def _write_cache_on_every_process() -> None:
    """Let every process write its own entries to the compilation cache, not only process 0.

    JAX writes persistent cache entries from process 0 alone (against write contention on shared
    filesystems), but on CPU each process's key differs (it hashes the process's view of the device
    topology), so process 1 onwards never finds an entry and compiles the step again on every start, and
    process 0 waits for it at the first collective. The keys being distinct, no two processes write the
    same file. This wraps JAX's private ``jax._src.compiler._cache_write`` (the version is pinned); where
    that is not found, the cache stays as JAX has it (a restart on process 1 onwards compiles)."""
    try:
        from jax._src import compilation_cache, compiler, distributed
    except ImportError:  # pragma: no cover - another JAX layout
        return
    original = getattr(compiler, "_cache_write", None)
    put = getattr(compilation_cache, "put_executable_and_time", None)
    if original is None or put is None or getattr(original, "_chunkzero_every_process", False):
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if distributed.global_state.process_id == 0 or host_callbacks:
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # noqa: BLE001 - a cache that cannot be written only costs a compile next time
            logging.getLogger(__name__).debug("compilation cache entry %s not written: %s", module_name, e)

    cache_write._chunkzero_every_process = True
    compiler._cache_write = cache_write


def process_mesh(axis: str | None = None):
    """The 1-D data-parallel mesh of every device of the run, ordered by (process, device id)."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from .mesh import DEFAULT_AXIS

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices), (axis or DEFAULT_AXIS,), axis_types=(AxisType.Auto,))


def all_gather_json(obj):
    """Every process's JSON-able ``obj``, by process index (a collective; ``[obj]`` when alone). Sent as
    UTF-8 JSON bytes, never pickled."""
    import json

    import jax
    import numpy as np

    if jax.process_count() == 1:
        return [obj]
    from jax.experimental.multihost_utils import process_allgather

    data = np.frombuffer(json.dumps(obj).encode("utf-8"), dtype=np.uint8)
    sizes = np.asarray(process_allgather(np.asarray([data.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(bytes(rows[i, :sizes[i]]).decode("utf-8")) for i in range(len(sizes))]


__all__ = ["ProcessPlace", "all_gather_json", "bound_cpu_threads", "cpu_threads", "join_processes", "process_mesh",
           "process_place"]
