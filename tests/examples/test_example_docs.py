"""The README and docs/ show code only as excerpts of files in examples/, each naming its file, and every
example file is run by a test (by its name: tests/examples/, and tests/torch/test_checkpoint_orbax.py for
the plain-Orbax reader) and shown or named in the docs."""

from __future__ import annotations

import re

import pytest
from examples_runner import EXAMPLES, ROOT

CONTRACT = {"DESIGN.md", "ARCHITECTURE.md"}  # API sketches that define the contract, not examples to run
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in CONTRACT)]
NAMED = re.compile(r"^# (examples/[\w.]+\.py)$")


def python_blocks(text: str) -> list[list[str]]:
    """The lines of every ```` ```python ```` block of ``text`` (indented ones included)."""
    return [m.group(1).split("\n") for m in re.finditer(r"^ *```python\n(.*?)\n *```$", text, re.S | re.M)]


def is_excerpt(shown: list[str], source: list[str]) -> bool:
    """Every shown line (``# ...`` marks an elision) is a line of ``source``, in the same order."""
    it = iter(source)
    return all(any(line == s for s in it) for line in shown if line.strip() != "# ...")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_is_an_excerpt_of_the_example_it_names(page):
    for block in python_blocks(page.read_text()):
        m = NAMED.match(block[0])
        assert m, f"{page.name}: a python block that names no example file: {block[0]!r}"
        source = (ROOT / m.group(1)).read_text().split("\n")
        assert is_excerpt(block[1:], source), f"{page.name}: the block naming {m.group(1)} is not an excerpt of it"


def test_the_excerpt_check_can_fail():
    source = ["a = 1", "b = 2", "c = 3"]
    assert is_excerpt(["a = 1", "# ...", "c = 3"], source)
    assert not is_excerpt(["c = 3", "a = 1"], source)  # out of order
    assert not is_excerpt(["a = 2"], source)           # edited


def test_every_example_is_run_by_a_test_and_shown_in_the_docs():
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    docs = "\n".join(p.read_text() for p in PAGES)
    files = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert len(files) >= 6
    for name in files:
        assert f'"{name}"' in tests, f"no test runs examples/{name}"
        assert f"examples/{name}" in docs, f"no page shows or names examples/{name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
