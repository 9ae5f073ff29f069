"""Frozen parameters under mixed precision (run in spawned gloo processes): a frozen tensor is stored
in the dtype it came in and returned bit for bit by ``state_dict()``, a checkpoint round trip and
``export_checkpoint``, while its chunk computes in the compute dtype.

Tolerances: frozen tensors bitwise (their fp32 bit patterns); trainable tensors as the other bf16
tests: the 3-step update within 5% (relative L2) of a bf16-compute, fp32-master single-process
reference (``optim_cases.low_precision_reference``).
"""

from __future__ import annotations

import copy
import os

import torch
from zero_cases import ADAMW, batches, gpt2_loss, hf_gpt2, zero_run


def frozen_half_gpt2(seed_shift: float = 0.0):
    """The tests' tiny tied HF GPT-2 (fp32, 2 blocks) with half its weights frozen: block 0 and the
    position embedding in fp32, and block 1's ``mlp.c_fc`` converted to bf16 before freezing (a
    tensor that arrives in bf16). ``seed_shift`` is added to every value (another starting point)."""
    module = hf_gpt2(n_layer=2, frozen_blocks=(0,))
    module.transformer.wpe.requires_grad_(False)
    fc = module.transformer.h[1].mlp.c_fc
    fc.to(torch.bfloat16).requires_grad_(False)
    if seed_shift:
        with torch.no_grad():
            for p in module.parameters():
                p.add_(seed_shift)
    return module


def frozen_originals(module) -> dict[str, torch.Tensor]:
    """Every frozen parameter's value as it came in, by name (its own dtype)."""
    return {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    """``got[n]`` (float32, as ``state_dict()`` returns) holds exactly ``want[n]``: the same fp32 bit
    patterns after widening ``want[n]`` (exact for fp32, bf16 and fp16)."""
    for n, w in want.items():
        g = got[n]
        assert g.dtype == torch.float32 and g.shape == w.shape, (where, n, g.dtype, g.shape)
        bad = (g.view(torch.int32) != w.float().view(torch.int32)).sum().item()
        assert bad == 0, f"{where}: frozen {n!r} ({w.dtype}) differs in {bad} of {w.numel()} elements"


def worker_frozen_exact(rank: int, world: int, root: str):
    """bf16 compute over a frozen-half fp32 GPT-2 (one frozen block in bf16): 3 AdamW steps; frozen
    tensors come back bit for bit from ``state_dict()``, a checkpoint save/load into another model and
    a safetensors export; frozen chunks keep their storage dtype (4 / 2 bytes per shard element in
    ``memory_report``), never mix dtypes, and hold no master; trainable tensors within the bf16 bound."""
    from optim_cases import UPDATE_RTOL, low_precision_reference, update_error
    from safetensors.torch import load_file

    from torch_backend import ZeroDDP, ZeroOptimizer, load_checkpoint, save_checkpoint
    from torch_backend.checkpoint.export import export_checkpoint

    module = frozen_half_gpt2()
    frozen = frozen_originals(module)
    assert {v.dtype for v in frozen.values()} == {torch.float32, torch.bfloat16}, {v.dtype for v in frozen.values()}
    ref = copy.deepcopy(module)
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = batches("gpt2", 3, 2 * world)
    model = ZeroDDP(module, chunk_size=1500, mixed_precision="bf16")
    layout = model.layout

    # chunks: frozen ones in their storage dtype (never two dtypes in one chunk), trainable in bf16
    dtype_of = {n: str(v.dtype).removeprefix("torch.") for n, v in frozen.items()}
    for c in model.chunks:
        names = [t.name for t in layout.chunk_tensors(c.index)]
        if c.requires_grad:
            assert c.info.dtype == "bfloat16" and not any(n in frozen for n in names), (c.index, names)
        else:
            assert {dtype_of[n] for n in names} == {c.info.dtype}, (c.index, names, c.info.dtype)
            assert c.master is None and c.shard.dtype == c.storage_dtype and c.buffer.dtype == torch.bfloat16
    frozen_chunks = [c for c in model.chunks if not c.requires_grad]
    if world > 1:
        assert any(not c.keep_gathered for c in frozen_chunks), layout.summary()

    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    zero_run(model, optim, gpt2_loss, data, rank, world)
    assert_bitwise(model.state_dict(), frozen, "state_dict after 3 bf16 steps")
    ref_masters = low_precision_reference(
        ref, gpt2_loss, data, torch.bfloat16, lambda ps: torch.optim.AdamW(ps, **ADAMW)
    )
    rel = update_error(model, initial, ref_masters)
    assert rel <= UPDATE_RTOL, f"relative L2 error of the bf16 update {rel:.3g} > {UPDATE_RTOL}"

    # memory: each frozen chunk's shard in its storage dtype (bf16: 2 bytes per element of the shard)
    report = optim.memory_report()
    want: dict[str, int] = {}
    for c in frozen_chunks:
        want[c.info.dtype] = want.get(c.info.dtype, 0) + layout.shard_numel(c.index) * (
            2 if c.info.dtype == "bfloat16" else 4
        )
    assert report.frozen_parameters == {"cpu": want}, (report.frozen_parameters, want)
    assert report.frozen_total("bfloat16") > 0 and report.frozen_total("float32") > 0

    # checkpoint: save, load into a model that starts elsewhere, export
    sd = model.state_dict()
    saved = save_checkpoint(os.path.join(root, "ckpt"), model, optim, step=3)
    other = ZeroDDP(frozen_half_gpt2(seed_shift=0.5), chunk_size=700, mixed_precision="bf16")
    other_optim = ZeroOptimizer(other, torch.optim.AdamW, **ADAMW)
    load_checkpoint(os.path.join(root, "ckpt"), other, other_optim)
    got = other.state_dict()
    assert_bitwise(got, frozen, "state_dict after a checkpoint round trip")
    for n in sd:
        assert torch.equal(got[n], sd[n]), n
    if rank == 0:
        export_checkpoint(saved, os.path.join(root, "export"))
        exported = load_file(os.path.join(root, "export", "model.safetensors"))
        for n, w in frozen.items():
            assert exported[n].dtype == w.dtype and torch.equal(
                exported[n].view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32),
                w.view(torch.int16 if w.dtype == torch.bfloat16 else torch.int32),
            ), n
    return rel
