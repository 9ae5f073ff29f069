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


def _imports(path, package: str) -> set[str]:
    """The modules of ``package`` that the file at ``path`` imports anywhere (lazy imports included)."""
    import ast

    mod = path.with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == package}


def test_jax_backend_has_no_import_cycle():
    """No module of jax_backend imports one that imports it back, directly or through others (issue 28)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = {p.relative_to(root).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__"): p.relative_to(root)
             for p in (root / "jax_backend").rglob("*.py")}
    import os

    cwd = os.getcwd()
    os.chdir(root)
    try:
        graph = {m: {i for i in _imports(f, "jax_backend") if i in files and i != m} for m, f in files.items()}
    finally:
        os.chdir(cwd)
    # a package's __init__ re-exports its modules: an edge into a package is not a cycle through its modules
    cycles = []

    def visit(m, path):
        for n in graph[m]:
            if n == path[0]:
                cycles.append(path + [n])
            elif n not in path and len(path) < 8 and not files[n].name == "__init__.py":
                visit(n, path + [n])

    for m in graph:
        if files[m].name != "__init__.py":
            visit(m, [m])
    assert not cycles, cycles[:5]
