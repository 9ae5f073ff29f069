"""Hypothesis strategies for random tensor lists (shared by the core tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from chunkzero import TensorSpec

DTYPES = ("float32", "bfloat16", "float16")

shapes = st.one_of(
    st.just(()),  # 0-d: numel 1
    st.just((1,)),
    st.just((0,)),  # 0 elements
    st.just((3, 0)),
    st.tuples(st.integers(1, 40)),
    st.tuples(st.integers(1, 12), st.integers(1, 12)),
    st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6)),
    st.tuples(st.integers(100, 2500)),  # huge: usually bigger than the chunk size
)


@st.composite
def spec_lists(draw, max_tensors: int = 14, dtypes=DTYPES):
    """An ordered list of TensorSpecs with unique names, mixed dtypes, frozen and keep-gathered
    tensors, size-1, 0-numel and huge tensors, and tied aliases."""
    n = draw(st.integers(0, max_tensors))
    specs = []
    for i in range(n):
        aliases = (f"tied{i}.weight",) if draw(st.integers(0, 5)) == 0 else ()
        specs.append(
            TensorSpec(
                f"layer{i}.weight",
                draw(shapes),
                draw(st.sampled_from(dtypes)),
                aliases,
                requires_grad=draw(st.integers(0, 6)) != 0,
                keep_gathered=draw(st.integers(0, 8)) == 0,
            )
        )
    return specs


chunk_sizes = st.one_of(st.integers(1, 8), st.integers(9, 600))
world_sizes = st.integers(1, 8)
