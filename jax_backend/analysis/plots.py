"""Figures of the layout comparison (matplotlib, imported by each function when it draws).

:func:`plot_chunk_map` draws a :class:`chunkzero.ChunkLayout` chunk by chunk (:func:`plot_chunk_groups` by
transformer block, for layouts of many chunks), :func:`plot_memory_bars`
the per-device memory of a :class:`jax_backend.analysis.compare.LayoutComparison`, predicted next to
measured, :func:`plot_sweep` a :func:`jax_backend.analysis.compare.chunk_size_sweep`, and
:func:`plot_comparison` the first two in one figure. Each takes an optional matplotlib ``ax`` and
returns the axes (the figure for :func:`plot_comparison`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from chunkzero.layout import ChunkLayout

MIB = 2**20
"""Bytes per MiB (:mod:`.compare`'s tables use the same)."""


def _tensor_group(name: str) -> str:
    m = re.search(r"\.(?:h|layers)\.(\d+)\.", name)
    return f"block {m.group(1)}" if m else "embeddings / head"


def plot_chunk_map(layout: ChunkLayout, ax=None, *, max_chunks: int | None = None, normalize: bool = True):
    """Chunks as rows of tensors (one color per transformer block, grey for embeddings/head, hatched
    padding), with each rank's shard boundaries as black ticks.

    Args:
        normalize: draw every chunk over its own size (x in ``[0, 1]``, the size written at the right),
            so a huge dedicated chunk (an embedding) does not squash the others; ``False`` draws elements.
        max_chunks: draw only the first chunks.

    Returns:
        The axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    chunks = layout.chunks[:max_chunks] if max_chunks else layout.chunks
    if ax is None:
        _, ax = plt.subplots(figsize=(10, max(2.5, 0.18 * len(chunks) + 1)))
    cmap = plt.get_cmap("tab20")
    blocks: dict[str, int] = {}
    widest = max(c.size for c in chunks)
    for row, c in enumerate(chunks):
        y = len(chunks) - 1 - row
        scale = 1.0 / c.size if normalize else 1.0
        for t in layout.chunk_tensors(c.index):
            grp = _tensor_group(t.name)
            color = "0.6" if grp == "embeddings / head" else cmap(blocks.setdefault(grp, len(blocks)) % 20)
            ax.add_patch(Rectangle((t.offset * scale, y - 0.4), t.numel * scale, 0.8, facecolor=color, edgecolor="white",
                                   linewidth=0.3))
        if c.padding:
            ax.add_patch(Rectangle((c.utilized * scale, y - 0.4), c.padding * scale, 0.8, facecolor="none",
                                   edgecolor="red", hatch="///", linewidth=0.5))
        if not c.keep_gathered:
            shard = c.size // layout.world_size
            for r in range(1, layout.world_size):
                ax.plot([r * shard * scale] * 2, [y - 0.45, y + 0.45], color="black", linewidth=0.6)
        if normalize:
            ax.text(1.01, y, f"{c.size:,}" + (" kept" if c.keep_gathered else ""), va="center", fontsize=6)
    ax.set_xlim(0, 1.12 if normalize else widest * 1.01)
    ax.set_ylim(-0.7, len(chunks) - 0.3)
    step = max(1, len(chunks) // 12)
    ax.set_yticks([len(chunks) - 1 - i for i in range(0, len(chunks), step)])
    ax.set_yticklabels([str(chunks[i].index) for i in range(0, len(chunks), step)])
    ax.set_xlabel("position in chunk (fraction of its size; size in elements at the right)" if normalize
                  else "element offset in chunk")
    ax.set_ylabel("chunk")
    ax.set_title(f"chunk map: {len(layout.chunks)} chunks, capacity {layout.chunk_size:,} elements "
                 f"(larger tensors get a chunk of their own), W={layout.world_size}\n"
                 f"ticks: rank shard boundaries; colors: blocks; hatched: padding ({layout.padding_numel:,} elements)",
                 fontsize=9)
    return ax


_ROLE_COLORS = {"attention": "tab:blue", "MLP": "tab:orange", "norm": "tab:green", "embedding / head": "0.55"}


def _tensor_role(name: str) -> str:
    if re.search(r"(attn|attention)\.", name):
        return "attention"
    if re.search(r"mlp\.", name):
        return "MLP"
    if re.search(r"(ln_|norm)", name):
        return "norm"
    return "embedding / head"


def plot_chunk_groups(layout: ChunkLayout, ax=None):
    """The chunk map of a many-chunk layout, one row per transformer block (and one for the embeddings /
    head): the row's chunks side by side (each chunk a framed box as wide as its size, labelled with its
    index when it fits), its tensors colored by role (attention, MLP, norm, embedding / head), padding
    hatched. A chunk goes to the row of the block that holds most of its elements. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    groups: dict[str, list] = {}
    for c in layout.chunks:
        weight: dict[str, int] = {}
        for t in layout.chunk_tensors(c.index):
            weight[_tensor_group(t.name)] = weight.get(_tensor_group(t.name), 0) + t.numel
        groups.setdefault(max(weight, key=weight.get) if weight else "embeddings / head", []).append(c)
    order = sorted(groups, key=lambda g: (g != "embeddings / head", int(g.split()[1]) if g.startswith("block") else -1))
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.28 * len(order) + 1.5))
    unit = 1e6
    widest = 0.0
    for row, g in enumerate(order):
        y = len(order) - 1 - row
        x = 0.0
        for c in groups[g]:
            for t in layout.chunk_tensors(c.index):
                ax.add_patch(Rectangle(((x + t.offset) / unit, y - 0.38), t.numel / unit, 0.76,
                                       facecolor=_ROLE_COLORS[_tensor_role(t.name)], edgecolor="none"))
            if c.padding:
                ax.add_patch(Rectangle(((x + c.utilized) / unit, y - 0.38), c.padding / unit, 0.76, facecolor="none",
                                       edgecolor="red", hatch="///", linewidth=0.5))
            ax.add_patch(Rectangle((x / unit, y - 0.38), c.size / unit, 0.76, facecolor="none", edgecolor="black",
                                   linewidth=0.8))
            if c.size / unit > 0.6:
                ax.text((x + c.size / 2) / unit, y, str(c.index), ha="center", va="center", fontsize=6.5, color="white")
            x += c.size
        widest = max(widest, x)
    ax.set_xlim(0, widest / unit * 1.01)
    ax.set_ylim(-0.7, len(order) - 0.3)
    ax.set_yticks(range(len(order)))
    labels = []
    for g in reversed(order):
        idx = [c.index for c in groups[g]]
        labels.append(f"{g}: chunk{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}")
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("elements (millions), the row's chunks side by side (framed, index inside)")
    ax.legend(handles=[Patch(facecolor=col, label=role) for role, col in _ROLE_COLORS.items()]
              + [Patch(facecolor="none", edgecolor="red", hatch="///", label="padding")],
              fontsize=7, loc="lower right", ncol=5, frameon=True)
    ax.set_title(f"chunk map by block: {len(layout.chunks)} chunks, capacity {layout.chunk_size:,} elements (larger "
                 f"tensors get a chunk of their own)\nW={layout.world_size}: each rank holds 1/{layout.world_size} of "
                 f"every sharded chunk; padding {layout.padding_numel:,} elements", fontsize=9)
    return ax


GROUPED_MAP_ABOVE_CHUNKS = 24
""":func:`plot_comparison` draws layouts with more chunks than this by block (:func:`plot_chunk_groups`)."""


def plot_memory_bars(cmp: Any, ax=None):
    """Per-device memory per strategy of ``cmp`` (a :class:`jax_backend.analysis.compare.LayoutComparison`; not
    imported here, as :mod:`.compare` imports this module to plot): predicted (parameters, gradients, master, optimizer states,
    peak gathered) next to measured (arguments, temp) when measured. MiB. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(cmp.rows))
    width = 0.38 if cmp.measured else 0.6
    parts = [("params", "param_bytes"), ("grads", "grad_bytes"), ("fp32 master", "master_bytes"),
             ("optimizer states", "optimizer_state_bytes"), ("peak gathered", "peak_gathered_bytes")]
    colors = plt.get_cmap("tab10")
    bottom = np.zeros(len(cmp.rows))
    offset = -width / 2 if cmp.measured else 0.0
    for j, (label, attr) in enumerate(parts):
        vals = np.array([getattr(r.predicted, attr) / MIB for r in cmp.rows])
        ax.bar(x + offset, vals, width, bottom=bottom, label=f"pred: {label}", color=colors(j))
        bottom += vals
    top = float(bottom.max()) if len(bottom) else 0.0
    for xi, total in zip(x + offset, bottom):
        ax.text(xi, total, f"{total:,.0f} MiB" + ("\npredicted" if cmp.measured else ""), ha="center", va="bottom",
                fontsize=7)
    if cmp.measured:
        args = np.array([(r.measured.memory.argument_bytes if r.measured else 0) / MIB for r in cmp.rows])
        temp = np.array([(r.measured.memory.temp_bytes if r.measured else 0) / MIB for r in cmp.rows])
        ax.bar(x + width / 2, args, width, label="meas: arguments (state)", color="0.35")
        ax.bar(x + width / 2, temp, width, bottom=args, label="meas: temp", color="0.7")
        for xi, total in zip(x + width / 2, args + temp):
            ax.text(xi, total, f"{total:,.0f} MiB\nmeasured", ha="center", va="bottom", fontsize=7)
        top = max(top, float((args + temp).max()))
    ax.set_ylim(0, top * 1.15 if top else 1)
    ax.set_xticks(x)
    ax.set_xticklabels([r.strategy for r in cmp.rows])
    ax.set_ylabel("MiB per device")
    ax.set_title(f"{cmp.model}, W={cmp.world_size}, {cmp.precision}: per-device memory", fontsize=9)
    ax.legend(fontsize=7)
    return ax


def plot_sweep(rows: Sequence[Mapping[str, Any]], ax=None, *, title: str = ""):
    """Padding + capacity waste (left axis, elements) and all-gathers per step (right axis) vs chunk size."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    xs = [r["chunk_size"] for r in rows]
    over = [(r["padding_numel"] + r["wasted_numel"]) for r in rows]
    ax.plot(xs, over, "o-", label="padding + capacity waste (elements)")
    ax.set_xscale("log")
    ax.set_xlabel("chunk size (elements)")
    ax.set_ylabel("elements")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["allgathers"] for r in rows], "s--", color="C1", label="all-gathers per step")
    ax2.set_ylabel("all-gathers per step")
    for r in rows:
        if r.get("searched"):
            ax.axvline(r["chunk_size"], color="green", linestyle=":", label="searched size")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=7, frameon=False)
    ax.set_title(title or "chunk-size sweep", fontsize=9)
    return ax


def plot_comparison(cmp: Any, path: str | None = None):
    """One figure of ``cmp`` (a ``LayoutComparison``): the chunk map (top) and the memory bars (bottom); written to
    ``path`` when given.
    Returns the figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    n = len(cmp.layout.chunks)
    grouped = n > GROUPED_MAP_ABOVE_CHUNKS
    rows = len({_tensor_group(t.name) for t in cmp.layout.tensors}) if grouped else n
    height = max(3.0, (0.3 if grouped else 0.18) * rows + 1.2)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, height + 4.8), gridspec_kw={"height_ratios": [height, 4]})
    (plot_chunk_groups if grouped else plot_chunk_map)(cmp.layout, ax1)
    plot_memory_bars(cmp, ax2)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig



__all__ = ["plot_chunk_groups", "plot_chunk_map", "plot_comparison", "plot_memory_bars", "plot_sweep"]
