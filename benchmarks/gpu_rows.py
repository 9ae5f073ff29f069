"""The rows of ``benchmarks/gpu_check.sh``: one JSON object per line, appended as each is measured, and
the markdown tables assembled from them.

Every row has ``part`` (the part of the check that wrote it) and ``kind`` (what it is: ``env``,
``part`` = a part's outcome, ``engine`` = a ``bench_engine.py`` system, ``streams`` = a prefetch
comparison of ``gpu_streams.py``, ``placement`` = a ``gpu_placement.py`` configuration, ``rung`` = a
try of the largest-model ladder, ``plan`` = the memory plan against a measured run, ``note``). A part
that is killed keeps the rows it appended before: each row is one ``write`` of a whole line, flushed at
once.

    python benchmarks/gpu_rows.py add ROWS.jsonl '{"part": "x", "kind": "note", "text": "..."}'
    python benchmarks/gpu_rows.py table ROWS.jsonl OUT.md      # every part's rows as markdown tables
"""

from __future__ import annotations

import json
import os
import sys

COLUMNS = {
    "engine": ["label", "n_params", "timed_steps", "median_s", "tokens_per_s", "mfu", "peak_cuda_mib", "peak_rss_mib",
               "state_mib", "zero_bound_mib", "gathers_per_step", "late_gathers_per_step", "error"],
    "streams": ["config", "prefetch", "steps", "compare_to", "losses_equal", "params_equal", "max_abs_diff",
                "expect_equal", "verdict", "h2d_mib_compute", "h2d_mib_other", "d2h_mib_compute", "d2h_mib_other",
                "moved_mib", "plan_same", "seconds", "error"],
    "placement": ["placement", "share", "tokens_per_s", "peak_device_gib", "budget_gib", "moved_mib_per_step",
                  "optim_host", "error"],
    "rung": ["n_layer", "n_embd", "n_params", "host_need_gib", "host_available_gib", "device_need_gib",
             "device_free_gib", "result", "tokens_per_s", "peak_cuda_mib", "peak_rss_mib", "seconds"],
    "plan": ["options", "measured_as", "planned_mib", "measured_mib", "planned_over_measured"],
    "part": ["status", "rc", "seconds", "limit_s", "rows"],
}
"""The columns shown per row kind (a row's other fields stay in the JSONL); other kinds show every field."""


def add(path: str, row: dict) -> None:
    """Append ``row`` (JSON-serialisable; must have ``part``) as one line of ``path``, flushed."""
    if "part" not in row:
        raise ValueError(f"a row needs a 'part' field: {row!r}")
    line = json.dumps(row, default=str) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read(path: str) -> list[dict]:
    """The rows of ``path``; a torn last line (a writer killed mid-write) is skipped."""
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v).replace("|", "/").replace("\n", " ")[:200]


def render(rows: list[dict]) -> str:
    """Markdown: the ``env`` and ``note`` rows as text, then one section per part (in the order the
    parts first wrote), one table per row kind, and the table of every part's outcome."""
    out = []
    for r in rows:
        if r.get("kind") == "env":
            out += ["```"] + [f"{k}: {v}" for k, v in r.items() if k not in ("part", "kind")] + ["```", ""]
    for r in rows:
        if r.get("kind") == "note":
            out += [f"- {r.get('text', '')}"]
    if out and out[-1] != "":
        out.append("")
    parts = list(dict.fromkeys(r["part"] for r in rows if r.get("kind") not in ("env", "note", "part")))
    for part in parts:
        out += [f"### {part}", ""]
        mine = [r for r in rows if r["part"] == part and r.get("kind") not in ("env", "note", "part")]
        for kind in dict.fromkeys(r.get("kind", "") for r in mine):
            block = [r for r in mine if r.get("kind", "") == kind]
            cols = COLUMNS.get(kind) or list(dict.fromkeys(k for r in block for k in r if k not in ("part", "kind")))
            cols = [c for c in cols if any(c in r for r in block)]
            out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in block]
            out.append("")
    status = [r for r in rows if r.get("kind") == "part"]
    if status:
        out += ["### parts", ""]
        cols = ["part"] + COLUMNS["part"]
        out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in status]
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "add":
        add(argv[1], json.loads(argv[2]))
        return 0
    if len(argv) in (3, 4) and argv[0] == "table":
        header = argv[3] if len(argv) == 4 else ""
        text = (header + "\n\n" if header else "") + render(read(argv[1]))
        tmp = argv[2] + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, argv[2])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
