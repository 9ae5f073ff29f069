"""The files of ``examples/`` as tests run them: by file name, as they are, in a fresh interpreter that
imports this checkout (offline: no Hugging Face download), in a scratch directory (they write ``runs/``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from jax_cache import jax_cache_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

_WITH_CHECKS = """
import runpy, sys
sys.argv = {argv!r}
sys.path.insert(0, {folder!r})  # as `python examples/NAME.py` does
globals().update(runpy.run_path(sys.argv[0], run_name="__main__"))
"""


def example_path(name: str) -> Path:
    """``examples/<name>``; fails the test when it does not exist."""
    path = EXAMPLES / name
    assert path.is_file(), f"no example {path}"
    return path


def example_env(**extra: str) -> dict[str, str]:
    """This process's environment, offline, with this checkout first on ``PYTHONPATH``, JAX's persistent
    compilation cache on (``tests/jax_cache.py``), and ``extra``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **jax_cache_env(), **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_python(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None,
               timeout_s: float = 600) -> subprocess.CompletedProcess:
    """``python *args`` in ``cwd`` (under :func:`example_env` unless ``env``), its output captured as text;
    killed after ``timeout_s``."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=example_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout_s)


def run_example(name: str, cwd: Path, *args: str, checks: str = "", env: dict[str, str] | None = None,
                launcher: Sequence[str] = (), timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run ``examples/<name>`` as it is, with ``args``, in ``cwd``; fails the test, with the output's
    tails, unless it exits 0.

    ``checks`` (python that prints ``EXAMPLE OK`` last) then runs in the same interpreter against the
    example's globals (the file is run with ``runpy.run_path``, unchanged). ``launcher`` (e.g.
    ``["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]``) runs the file under it
    instead. Killed after ``timeout_s``.
    """
    assert not (checks and launcher), "checks run in the example's own interpreter, so not under a launcher"
    path = str(example_path(name))
    if checks:
        code = _WITH_CHECKS.format(argv=[path, *args], folder=str(EXAMPLES)) + checks
        proc = run_python(["-c", code], cwd, env, timeout_s)
    else:
        proc = run_python([*launcher, path, *args], cwd, env, timeout_s)
    tails = proc.stdout[-4000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, tails
    assert not checks or "EXAMPLE OK" in proc.stdout, tails
    return proc
