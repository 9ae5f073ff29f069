"""Workers of the real-model tests on Hugging Face GPT-2 under ZeroDDP: peft's LoRA on a frozen base,
and the issue's "Done when" run (gradient checkpointing, two param groups, a LambdaLR, autograd.grad).

LoRA: the base model is frozen by peft; only the low-rank adapters (``lora_A`` / ``lora_B``) train. The
checks: training equals a single-process run of an identical copy on the full batch (fp32, rtol 1e-5,
AdamW eps 1e-6); chunk by chunk, only the adapters' chunks hold an fp32 master, a gradient and
optimizer state; and ``optim.memory_report()`` counts exactly what the layout implies, against full
fine-tuning of the same model.
"""

from __future__ import annotations

import copy

import torch
from optim_cases import nanogpt_groups, zero_steps
from zero_cases import ADAMW, FP32, assert_state_close, batches, gpt2_loss, hf_gpt2, mean_over_ranks, micro

from chunkzero.dtypes import itemsize_bytes
from torch_backend.zero.chunk_io import bytes_by_kind

CHUNK_SIZE = 1500  # elements: the tiny GPT-2 spreads over ~12 chunks, adapters in chunks of their own
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32, per element
STEP_BYTES = 4  # one 0-d fp32 ``step`` per inner-optimizer parameter (tensor piece)


def lora_gpt2(n_layer: int = 3):
    """The tests' tiny tied HF GPT-2 with peft LoRA (rank 4) on every attention and MLP projection."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"],
                        fan_in_fan_out=True)  # GPT-2's Conv1D stores weights as (in, out)
    return get_peft_model(hf_gpt2(n_layer), config)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def expected_model_state_bytes(model) -> int:
    """Model-state bytes this rank should hold right after ``step()`` (before ``zero_grad``), from the
    layout alone: a frozen chunk's shard in its storage dtype (the layout chunk's); a trainable chunk's
    fp32 master, fp32 gradient shard and AdamW's two fp32 moments (16 bytes per element; in bf16 on one
    rank the chunk is resident and also keeps its bf16 copy), plus one 4-byte ``step`` per tensor piece."""
    layout, rank = model.layout, model.rank
    compute = model.compute_dtype.itemsize
    total = 0
    for c in layout.chunks:
        n = layout.shard_numel(c.index)
        if not c.requires_grad:
            total += n * itemsize_bytes(c.dtype)
            continue
        total += n * (4 + 4 + ADAM_STATE_BYTES)
        if compute != 4 and model.world_size == 1:
            total += n * compute
        total += STEP_BYTES * len(layout.shard_pieces(c.index, rank))
    return total


def check_chunks(model, optim) -> None:
    """Chunk by chunk: adapters and base never share a chunk; a frozen chunk holds only its shard,
    in the dtype the base came in (no master, gradient or optimizer state); an adapter chunk holds all three."""
    from chunkzero.errors import ConfigError

    layout = model.layout
    assert any(c.requires_grad for c in model.chunks) and any(not c.requires_grad for c in model.chunks)
    for c in model.chunks:
        names = [t.name for t in layout.chunk_tensors(c.index)]
        adapters = [is_adapter(n) for n in names]
        assert all(adapters) or not any(adapters), (c.index, names)
        assert c.requires_grad == all(adapters), (c.index, names)
        n = layout.shard_numel(c.index)
        if not c.requires_grad:
            assert c.master is None and model.grad_shard(c.index) is None and c.gradient is None, c.index
            assert [(k, b) for _, k, b in bytes_by_kind(c)] == [("parameters", n * c.storage_dtype.itemsize)], (
                bytes_by_kind(c)
            )
            try:
                optim.shard_state(c.index)
            except ConfigError:
                pass
            else:
                raise AssertionError(f"frozen chunk {c.index} has optimizer state")
        else:
            assert c.master is not None and c.master.dtype == torch.float32 and c.master.numel() == n, c.index
            grad = model.grad_shard(c.index)
            assert grad is not None and grad.dtype == torch.float32 and grad.numel() == n, c.index
            state = optim.shard_state(c.index)
            assert {"exp_avg", "exp_avg_sq"} <= set(state), (c.index, sorted(state))
            assert all(state[k].numel() == n for k in ("exp_avg", "exp_avg_sq")), c.index


def one_step_report(module, rank: int, world: int, mixed_precision: str):
    """Wrap ``module``, take one AdamW step on this rank's micro-batch, return the model and the
    ``memory_report()`` right after ``step()`` (gradients still held)."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    model = ZeroDDP(module, chunk_size=CHUNK_SIZE, mixed_precision=mixed_precision)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    optim.backward(gpt2_loss(model, micro(batches("gpt2", 1, 2 * world)[0], rank, world)))
    assert optim.step()
    return model, optim.memory_report()


def worker_lora(rank: int, world: int):
    """peft LoRA on a frozen HF GPT-2 (3 layers, tied): 3 AdamW steps equal the reference; only the
    adapter chunks carry master/gradient/optimizer state; ``memory_report()`` equals the layout's
    bytes, in fp32 and bf16, for LoRA and for full fine-tuning of the same model."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    module = lora_gpt2()
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable), sorted(trainable)
    ref = copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=CHUNK_SIZE, prefetch=1)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAMW)
    losses, ref_losses = [], []
    data = batches("gpt2", 3, 2 * world)
    for step, batch in enumerate(data):
        loss = gpt2_loss(model, micro(batch, rank, world))
        optim.backward(loss)
        assert optim.step()
        if step == len(data) - 1:
            check_chunks(model, optim)
            assert optim.memory_report().model_state_bytes() == expected_model_state_bytes(model)
        optim.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
        r = gpt2_loss(ref, batch)
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
    got, want = model.state_dict(), ref.state_dict()
    assert_state_close(got, want, **FP32)
    # the base did not move; the adapters did (lora_B starts at zero)
    base = hf_gpt2(3).state_dict()
    for name, value in base.items():
        peft_name = "base_model.model." + name.replace("c_attn.", "c_attn.base_layer.").replace(
            "c_proj.", "c_proj.base_layer.").replace("c_fc.", "c_fc.base_layer.")
        torch.testing.assert_close(got[peft_name], value, rtol=0, atol=0)  # bitwise: frozen, never stepped
    assert all(got[n].abs().max() > 0 for n in trainable if ".lora_B." in n)
    assert model.gathered_chunks() == []

    # the saving against full fine-tuning of the same model, as the layout predicts it
    bytes_by_case = {}
    for precision in ("fp32", "bf16"):
        for case, build in (("lora", lora_gpt2), ("full", lambda: hf_gpt2(3))):
            m, report = one_step_report(build(), rank, world, precision)
            assert report.model_state_bytes() == expected_model_state_bytes(m), (precision, case, str(report))
            bytes_by_case[(precision, case)] = report.model_state_bytes()
        n_adapter = sum(p.numel() for n, p in lora_gpt2().named_parameters() if is_adapter(n))
        n_base = sum(p.numel() for p in hf_gpt2(3).parameters())
        # per parameter, padding and step counters aside: LoRA = base x 4 bytes (the fp32 base keeps its
        # dtype under any compute dtype) + adapters x 16, full fine-tuning = (base + adapters... none) x 16
        # (+ the compute-dtype copy of a resident chunk)
        compute = 4 if precision == "fp32" else 2
        per_trainable = 16 + (compute if compute != 4 and world == 1 else 0)
        predicted = (n_base * 4 + n_adapter * per_trainable) / (n_base * per_trainable)
        ratio = bytes_by_case[(precision, "lora")] / bytes_by_case[(precision, "full")]
        assert abs(ratio - predicted) < 0.02, (precision, ratio, predicted)
    return {f"{p}/{c}": b for (p, c), b in bytes_by_case.items()}


def worker_checkpointed_groups_lambdalr(rank: int, world: int):
    """The issue's "Done when" run: HF GPT-2 (3 layers, tied) with non-reentrant gradient checkpointing,
    nanoGPT's two param groups (decay 0.1 on matrices; 0 and half the learning rate on biases and
    LayerNorm) and a ``LambdaLR`` stepping the ZeroOptimizer equals the single-process reference after
    3 steps (rtol 1e-5); then ``torch.autograd.grad`` with respect to the input embeddings, through the
    checkpointed blocks, equals the reference's."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    lr = 1e-3
    module = hf_gpt2(3)
    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module.train()
    assert module.lm_head.weight is module.transformer.wte.weight
    ref = copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=1500, prefetch=1)
    optim = ZeroOptimizer(model, torch.optim.AdamW, param_groups=nanogpt_groups(module, lr), lr=lr, eps=1e-6)
    ref_opt = torch.optim.AdamW(nanogpt_groups(ref, lr), lr=lr, eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1.0 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1.0 + s))
    data = batches("gpt2", 3, 2 * world)
    losses = zero_steps(model, optim, gpt2_loss, data, rank, world, sched)
    ref_losses = []
    for batch in data:
        r = gpt2_loss(ref, batch)
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        ref_losses.append(r.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
    assert [g["lr"] for g in optim.param_groups] == [lr / 4, lr / 8]
    assert [g["weight_decay"] for g in optim.param_groups] == [0.1, 0.0]
    assert_state_close(model.state_dict(), ref.state_dict(), **FP32)

    def input_grad(m, ids):
        inner = m.module if isinstance(m, ZeroDDP) else m
        with torch.no_grad():
            emb = inner.get_input_embeddings()(ids)
        emb = emb.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(m(inputs_embeds=emb).logits.square().sum(), emb)
        return g

    batch = batches("gpt2", 1, 2 * world, seed=7)[0]
    mine = micro(batch, rank, world)
    want = input_grad(ref, batch)[rank * mine.shape[0] : (rank + 1) * mine.shape[0]]
    got = input_grad(model, mine)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert model.gathered_chunks() == [] and all(model.grad_shard(c.index) is None for c in model.chunks)
    return True
