"""The README's examples as tests run them: a section's first python block, run verbatim in a fresh
interpreter that imports this checkout (offline: no Hugging Face download)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def python_block_after(heading: str) -> str:
    """The first ```` ```python ```` block after the README line ``heading`` (e.g. ``"## EMA weights"``).

    Raises:
        ValueError: the README has no such heading.
    """
    text = README.read_text()
    after = text[text.index("\n" + heading):]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def example_env(**extra: str) -> dict[str, str]:
    """This process's environment, offline, with this checkout first on ``PYTHONPATH``, and ``extra``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_python(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python *args`` in ``cwd`` (under :func:`example_env` unless ``env``), its output captured as text;
    killed after 600 s."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=example_env() if env is None else env,
                          capture_output=True, text=True, timeout=600)


def run_example(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code`` (an example and its checks, which print ``EXAMPLE OK`` last) with ``python -c`` in ``cwd``;
    fails the test, with the output's tails, unless it exits 0 having printed ``EXAMPLE OK``."""
    proc = run_python(["-c", code], cwd)
    assert proc.returncode == 0 and "EXAMPLE OK" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc
