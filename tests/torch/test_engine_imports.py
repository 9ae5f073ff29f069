"""The engine's modules import each other without a cycle, counting imports inside functions (a lazy
import that breaks a cycle is still one), and only the stream layer touches ``torch.cuda``'s streams
and events."""

from __future__ import annotations

import ast
import pathlib

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "torch_backend" / "zero"
PACKAGE = "torch_backend.zero"


def engine_imports(root: pathlib.Path = ENGINE) -> dict[str, set[str]]:
    """``{module: engine modules it imports}`` for every module of ``root``, from every import statement
    in it (top level, inside functions, under ``TYPE_CHECKING``)."""
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for m in sorted(modules):
        deps: set[str] = set()
        for node in ast.walk(ast.parse((root / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    names = [node.module] if node.module else [a.name for a in node.names]
                elif node.level == 0 and node.module and node.module.startswith(PACKAGE + "."):
                    names = [node.module.removeprefix(PACKAGE + ".")]
                elif node.level == 0 and node.module == PACKAGE:
                    names = [a.name for a in node.names]
                else:
                    continue
                deps |= {n.split(".")[0] for n in names if n and n.split(".")[0] in modules}
            elif isinstance(node, ast.Import):
                deps |= {a.name.removeprefix(PACKAGE + ".").split(".")[0] for a in node.names
                         if a.name.startswith(PACKAGE + ".")}
        graph[m] = deps - {m}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_find_cycle_sees_a_lazy_import(tmp_path):
    """The checker itself: a cycle closed only by an import inside a function is found."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    (tmp_path / "c.py").write_text("from .b import f\n")
    graph = engine_imports(tmp_path)
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"b"}}
    assert find_cycle(graph) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_the_engine():
    graph = engine_imports()
    assert len(graph) > 10
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_only_the_stream_layer_touches_cuda_streams_and_events():
    offenders = []
    for path in sorted(ENGINE.glob("*.py")):
        if path.stem == "streams":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("Stream", "Event", "current_stream", "stream",
                                                                 "synchronize", "default_stream", "set_stream"):
                base = node.value
                if isinstance(base, ast.Attribute) and base.attr == "cuda":
                    offenders.append(f"{path.name}:{node.lineno} cuda.{node.attr}")
    assert not offenders, offenders
