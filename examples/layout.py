"""The core, numpy only: search a chunk size for HF GPT-2 small at 8 ranks, build its layout and compare
chunk ZeRO-3 with FSDP and DDP: python examples/layout.py"""
from chunkzero import ChunkLayout, compare_strategies, model_specs, search_chunk_size

specs = model_specs("hf-gpt2")                       # sizes only: HF GPT-2 small, tied head as an alias
res = search_chunk_size(specs, world_size=8)         # chunk size in elements
layout = ChunkLayout.build(specs, res.chunk_size, 8)
print(layout.summary().splitlines()[0], layout.owned_range("transformer.wte.weight", rank=3))
for c in compare_strategies(specs, 8, "bf16", layout=layout):  # chunk ZeRO-3, FSDP, DDP: model-state bytes per rank
    print(f"{c.strategy:12s} {c.param_bytes + c.grad_bytes + c.master_bytes + c.optimizer_state_bytes:,} B")
