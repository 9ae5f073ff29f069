"""The core, numpy only: search a chunk size for HF GPT-2 small at 8 ranks, build its layout and compare
chunk ZeRO-3 with FSDP and DDP: python examples/layout.py"""
from chunkzero import ChunkLayout, compare_strategies, model_specs, search_chunk_size

specs = model_specs("hf-gpt2")                       # sizes only: HF GPT-2 small, tied head as an alias
res = search_chunk_size(specs, world_size=8)         # chunk size in elements
layout = ChunkLayout.build(specs, res.chunk_size, 8)
print(layout.summary().splitlines()[0], layout.owned_range("transformer.wte.weight", rank=3))
for cost in compare_strategies(specs, 8, "bf16", layout=layout):  # chunk ZeRO-3, FSDP, DDP: bytes per rank
    print(f"{cost.strategy:12s} {cost.param_bytes + cost.grad_bytes + cost.master_bytes + cost.optimizer_state_bytes:,} B")
