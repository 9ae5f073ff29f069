import subprocess
import sys


def test_core_imports_no_framework():
    code = (
        "import sys, chunkzero, chunkzero.layout, chunkzero.states, chunkzero.search, chunkzero.cost\n"
        "import chunkzero.checkpoint, chunkzero.configs, chunkzero.inspection, chunkzero.cli\n"
        "import chunkzero.checkpoint.reader, chunkzero.checkpoint.orbax_store, chunkzero.checkpoint.export\n"
        "import chunkzero.lightning\n"
        "import chunkzero.job.data, chunkzero.job.models, chunkzero.job.checks, chunkzero.job.report\n"
        "bad = [m for m in ('torch', 'jax', 'flax', 'orbax', 'optax', 'tensorstore', 'lightning') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"chunkzero imported frameworks: {out.stdout.strip()}"
