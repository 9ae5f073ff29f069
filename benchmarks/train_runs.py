"""What the benchmarks that run ``chunkzero train`` as a command share: a small corpus and the environment.

:func:`make_corpus` copies about 1 MB of the standard library's source (:data:`CORPUS_FILES`, files that
are missing are skipped) into a corpus directory; :func:`train_env` is the environment of a ``python -m
chunkzero.cli train`` that imports this checkout and starts its own workers. Imports the standard library only.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS_FILES = ("argparse.py", "textwrap.py", "string.py", "shlex.py", "json/decoder.py", "json/encoder.py",
                "ast.py", "dataclasses.py", "inspect.py", "typing.py", "functools.py")
"""Standard-library sources, relative to its directory, that make the benchmarks' corpus."""


def make_corpus(dest: Path, files: Sequence[str] = CORPUS_FILES) -> Path:
    """Copy ``files`` (relative to the standard library's directory; missing ones are skipped) into
    ``dest``, created if needed, each named by its path with ``/`` as ``_``. Returns ``dest``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    dest.mkdir(parents=True, exist_ok=True)
    for rel in files:
        if (stdlib / rel).is_file():
            shutil.copy(stdlib / rel, dest / rel.replace("/", "_"))
    return dest


def train_env() -> dict[str, str]:
    """This process's environment for a ``chunkzero train`` subprocess: this checkout first on
    ``PYTHONPATH``, and no ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` (which would make
    it a worker of an outer run instead of launching its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env
