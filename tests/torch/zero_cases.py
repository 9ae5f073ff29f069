"""Models and per-rank workers of the ZeroDDP / ZeroOptimizer tests (run in spawned gloo processes).

Each worker does several checks in one process group (spawning is the slow part on 2 cores) and
asserts inside the rank; a failure is re-raised in pytest with the rank's traceback. References
are single-process runs of an identical copy of the module on the full batch (every rank's
micro-batch concatenated).

Tolerances: fp32 rtol 1e-5 / atol 1e-6 (only the summation order differs); bf16: the update within 5%
(relative L2) of a bf16-compute, fp32-master single-process reference (``optim_cases``).
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FP32 = dict(rtol=1e-5, atol=1e-6)
ADAMW = dict(lr=1e-3, eps=1e-6)
"""AdamW settings of the tests. eps is 1e-6, not 1e-8: with 1e-8 an element whose gradient is ~1e-9
(rounding noise, summed in another order on W ranks) moves by ~lr in a sign-dependent direction."""


# ---------------------------------------------------------------------------------------- models
def hf_gpt2(n_layer: int = 2, n_embd: int = 16, frozen_blocks: tuple[int, ...] = ()):
    """A small HF GPT-2 LM (vocabulary 64, 16 positions, tied embeddings, no dropout), seed 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=n_embd, n_layer=n_layer, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    for i in frozen_blocks:
        model.transformer.h[i].requires_grad_(False)
    return model


def tiny_gpt2():
    return hf_gpt2()


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=16, type_vocab_size=2, num_labels=3, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return BertForSequenceClassification(cfg)


class Odd(nn.Module):
    """The awkward cases: a layer called twice, a weight used by another module, ``x @ w``, a view of
    a weight used after its chunk was released, an in-place op on an activation, a frozen layer, an
    embedding, an optional unused parameter."""

    def __init__(self, with_unused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)
        if with_unused:
            self.unused = nn.Parameter(torch.ones(3))

    def forward(self, idx):
        x = self.emb(idx)
        x = self.a(x)
        x = self.a(torch.tanh(x))  # the same layer twice
        x = F.linear(x, self.b.weight, self.b.bias)  # b's weight used outside b.forward
        wt = self.w.t()  # a view taken now, used after w's chunk has been released
        x = x @ self.w  # through an operator
        x = x + torch.tanh(x) @ wt.t()
        x.relu_()  # in place on an activation
        x = self.frozen(x) + x
        return self.head(self.ln(x)).squeeze(-1)


def odd_loss(model, batch):
    idx, y = batch
    return F.mse_loss(model(idx), y)


def gpt2_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def bert_loss(model, batch):
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def batches(kind: str, steps: int, global_batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind == "gpt2":
            out.append(torch.randint(0, 64, (global_batch, 8), generator=g))
        elif kind == "bert":
            out.append(
                (
                    torch.randint(0, 64, (global_batch, 8), generator=g),
                    torch.randint(0, 3, (global_batch,), generator=g),
                )
            )
        else:
            out.append(
                (torch.randint(0, 10, (global_batch, 5), generator=g), torch.randn(global_batch, 5, generator=g))
            )
    return out


def micro(batch, rank: int, world: int):
    """Rank ``rank``'s equal slice of a global batch (a tensor or a tuple of tensors)."""
    if isinstance(batch, tuple):
        return tuple(micro(b, rank, world) for b in batch)
    n = batch.shape[0] // world
    return batch[rank * n : (rank + 1) * n]


CASES = {
    # name: (builder, loss, keep-gathered names, chunk size in elements)
    "gpt2": (tiny_gpt2, gpt2_loss, lambda n: n.startswith("transformer.ln_f"), 1500),
    "bert": (tiny_bert, bert_loss, lambda n: n.startswith("classifier"), 1500),
    "odd": (Odd, odd_loss, ["ln.weight", "ln.bias"], 100),
}


def mean_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def reference_run(module, loss_fn, data, optimizer_class, hyper, max_norm=None):
    """Single process, full batch: returns the per-step losses; ``module`` is trained in place."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = optimizer_class(params, **hyper)
    losses = []
    for batch in data:
        loss = loss_fn(module, batch)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


def micro_batch_reference_run(module, loss_fn, data, world, optimizer_class, hyper):
    """:func:`reference_run` with data parallelism's summation order: each step's gradient is the sum
    of the ``world`` micro-batches' gradients in rank order, then divided by ``world`` (what the
    averaging reduction computes): the same mathematics as the full batch, rounded differently.
    ``module`` is trained in place."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = optimizer_class(params, **hyper)
    for batch in data:
        for r in range(world):
            loss_fn(module, micro(batch, r, world)).backward()
        average_grads(params, world)
        opt.step()
        opt.zero_grad()


def average_grads(params, world: int) -> None:
    """Divide each accumulated ``.grad`` by ``world``."""
    for p in params:
        if p.grad is not None:
            p.grad.div_(world)


def assert_state_within_noise(got: dict, want: dict, other: dict, *, factor: float = 4.0, **tol):
    """:func:`assert_state_close` with each tensor's ``atol`` raised to ``factor`` × the reference's own
    noise there: the largest ``|want - other|``, where ``other`` is the reference trained with data
    parallelism's summation order (:func:`micro_batch_reference_run`). AdamW normalizes each gradient element, so an
    element whose gradient is mostly rounding noise moves by a noise-sized fraction of ``lr``: that
    is the floor any data-parallel run shares with the reference, whatever its kernels (which vary
    with the CPU's vector units). A wrong update (a skipped step, lr × 0.5) moves elements by ~``lr``,
    far above it."""
    assert list(got) == list(want), (list(got), list(want))
    for k in want:
        noise = (want[k].float() - other[k].float()).abs().max().item()
        atol = max(tol.get("atol", 0.0), factor * noise)
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=tol.get("rtol", 0.0), atol=atol,
                                   msg=lambda m, k=k, n=noise: f"{k} (reference noise {n:.3g}): {m}")


def zero_run(model, optim, loss_fn, data, rank, world):
    losses = []
    for batch in data:
        loss = loss_fn(model, micro(batch, rank, world))
        optim.backward(loss)
        assert optim.step()
        optim.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def assert_state_close(got: dict, want: dict, **tol):
    assert list(got) == list(want), (list(got), list(want))
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), msg=lambda m, k=k: f"{k}: {m}", **tol)


# ---------------------------------------------------------------------------------------- workers
def worker_fp32_equivalence(rank: int, world: int):
    """fp32: GPT-2 (tied, AdamW), BERT (AdamW + clipping), odd module (Adam, SGD momentum) equal the
    single-process full-batch reference after 3 steps."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    # Adam's eps is 1e-6 (see ADAMW).
    runs = [
        ("gpt2", torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1, eps=1e-6), None),
        ("bert", torch.optim.AdamW, dict(lr=1e-3, eps=1e-6), 0.05),
        ("odd", torch.optim.Adam, dict(lr=1e-2, eps=1e-6), None),
        ("odd", torch.optim.SGD, dict(lr=1e-2, momentum=0.9), 0.5),
    ]
    report = {}
    for name, opt_cls, hyper, max_norm in runs:
        build, loss_fn, kg, chunk_size = CASES[name]
        module = build()
        ref = copy.deepcopy(module)
        data = batches(name, 3, 2 * world)
        model = ZeroDDP(module, chunk_size=chunk_size, keep_gathered=kg)
        n_sharded = sum(not c.keep_gathered for c in model.layout.chunks)
        assert n_sharded >= 3 and any(c.keep_gathered for c in model.layout.chunks), model.layout.summary()
        optim = ZeroOptimizer(model, opt_cls, max_norm=max_norm, **hyper)
        losses = zero_run(model, optim, loss_fn, data, rank, world)
        assert not model.gathered_chunks()
        ref_losses, _ = reference_run(ref, loss_fn, data, opt_cls, hyper, max_norm)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
        assert_state_close(model.state_dict(), ref.state_dict(), **FP32)
        if max_norm is not None:
            assert optim.last_grad_norm > max_norm, "clipping was not exercised"
        report[f"{name}-{opt_cls.__name__}"] = losses
    if name == "odd":
        frozen_before = CASES["odd"][0]().frozen.weight
        # bitwise: a frozen tensor is never stepped
        torch.testing.assert_close(model.state_dict()["frozen.weight"], frozen_before, rtol=0, atol=0)
    return report


def worker_features(rank: int, world: int):
    """no_sync accumulation, no_grad inference, unused parameters, reshard_after_forward=False,
    state dicts (model and optimizer, torch round trip), shard-level API, offload decisions."""
    from chunkzero.errors import CheckpointError, ShapeMismatchError, UnusedParameterError
    from torch_backend import ZeroDDP, ZeroOptimizer

    build, loss_fn, kg, cs = CASES["gpt2"]

    # --- no_sync: 3 micro-batches accumulated under no_sync, a fourth synced, then one step == one big batch
    module = build()
    ref = copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=cs, keep_gathered=kg)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    (big,) = batches("gpt2", 1, 8 * world, seed=7)
    mine = micro(big, rank, world)
    parts = mine.chunk(4)
    with model.no_sync():
        for part in parts[:3]:
            optim.backward(loss_fn(model, part) / 4)
    assert all(model.grad_shard(c.index) is None for c in model.chunks), "no_sync must not reduce"
    optim.backward(loss_fn(model, parts[3]) / 4)
    assert optim.step()
    optim.zero_grad()
    reference_run(ref, loss_fn, [big], torch.optim.AdamW, ADAMW)
    assert_state_close(model.state_dict(), ref.state_dict(), **FP32)

    # --- inference under no_grad leaves nothing gathered (and matches the reference)
    model.eval()
    ref.eval()
    with torch.no_grad():
        out = model(input_ids=mine).logits
        assert model.gathered_chunks() == [], model.gathered_chunks()
        torch.testing.assert_close(out, ref(input_ids=mine).logits, **FP32)
    model.train()
    ref.train()

    # --- reshard_after_forward=False gives the same result and releases after backward
    module2 = build()
    ref2 = copy.deepcopy(module2)
    model2 = ZeroDDP(module2, chunk_size=cs, keep_gathered=kg, reshard_after_forward=False)
    optim2 = ZeroOptimizer(model2, torch.optim.AdamW, **ADAMW)
    data = batches("gpt2", 2, 2 * world)
    loss = loss_fn(model2, micro(data[0], rank, world))
    if world > 1:
        assert model2.gathered_chunks(), "chunks should stay gathered until backward"
    optim2.backward(loss)
    assert model2.gathered_chunks() == []
    optim2.step()
    optim2.zero_grad()
    zero_run(model2, optim2, loss_fn, data[1:], rank, world)
    reference_run(ref2, loss_fn, data, torch.optim.AdamW, ADAMW)
    assert_state_close(model2.state_dict(), ref2.state_dict(), **FP32)

    # --- model state dict: aliases, round trip, strict errors, shape mismatch
    sd = model.state_dict()
    assert "lm_head.weight" in sd and "transformer.wte.weight" in sd
    assert all(v.device.type == "cpu" and (v.dtype == torch.float32 or not v.is_floating_point()) for v in sd.values())
    fresh = ZeroDDP(build(), chunk_size=cs, keep_gathered=kg)
    result = fresh.load_state_dict(sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_state_close(fresh.state_dict(), sd, rtol=0, atol=0)  # bitwise: a copy in and out
    only_one_alias = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    assert fresh.load_state_dict(only_one_alias).missing_keys == []
    try:
        fresh.load_state_dict({**sd, "bogus.weight": torch.zeros(1)})
        raise AssertionError("unexpected key accepted")
    except CheckpointError as e:
        assert "bogus.weight" in str(e)
    partial = {k: v for k, v in sd.items() if k != "transformer.h.0.mlp.c_fc.bias"}
    try:
        fresh.load_state_dict(partial)
        raise AssertionError("missing key accepted")
    except CheckpointError as e:
        assert "transformer.h.0.mlp.c_fc.bias" in str(e)
    assert fresh.load_state_dict(partial, strict=False).missing_keys == ["transformer.h.0.mlp.c_fc.bias"]
    try:
        fresh.load_state_dict({**sd, "transformer.wpe.weight": torch.zeros(3, 3)})
        raise AssertionError("shape mismatch accepted")
    except ShapeMismatchError as e:
        assert "transformer.wpe.weight" in str(e) and "(16, 16)" in str(e) and "(3, 3)" in str(e)

    # --- optimizer state dict: name-keyed, full shapes, into torch AdamW and back
    osd = optim.state_dict()
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert osd["param_groups"][0]["params"] == names
    torch_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAMW)
    ref_osd = torch_opt.state_dict()  # before loading: for comparing later
    torch_opt.load_state_dict(osd)
    reloaded = torch_opt.state_dict()  # int-keyed
    for i, n in enumerate(names):
        assert reloaded["state"][i]["exp_avg"].shape == dict(ref.named_parameters())[n].shape
    optim.load_state_dict(reloaded)
    osd2 = optim.state_dict()
    for n in names:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(osd2["state"][n][k], osd["state"][n][k], rtol=0, atol=0)  # copies only
    del ref_osd

    # training continues identically after a torch-format optimizer round trip into a fresh model
    # (bitwise: the same engine, layout and kernels step the same state on the same data)
    model3 = ZeroDDP(build(), chunk_size=cs, keep_gathered=kg)
    model3.load_state_dict(model.state_dict())
    optim3 = ZeroOptimizer(model3, torch.optim.AdamW, **ADAMW)
    optim3.load_state_dict(reloaded)
    nxt = batches("gpt2", 1, 2 * world, seed=11)
    zero_run(model, optim, loss_fn, nxt, rank, world)
    zero_run(model3, optim3, loss_fn, nxt, rank, world)
    assert_state_close(model3.state_dict(), model.state_dict(), rtol=0, atol=0)

    # --- shard-level API round trip (what a checkpoint does); bitwise for the same reason as model3
    model4 = ZeroDDP(build(), chunk_size=cs, keep_gathered=kg)
    optim4 = ZeroOptimizer(model4, torch.optim.AdamW, **ADAMW)
    for c in model.chunks:
        shard = model.master_shard(c.index)
        assert shard.dtype == torch.float32 and shard.shape == (model.layout.shard_numel(c.index),)
        model4.load_master_shard(c.index, shard.clone())
        state = optim.shard_state(c.index)
        assert state["exp_avg"].shape == shard.shape and state["step"].dim() == 0
        optim4.load_shard_state(c.index, {k: v.clone() for k, v in state.items()})
    optim4.load_loss_scaler_state(optim.loss_scaler_state())
    assert optim4.step_count == optim.step_count
    zero_run(model, optim, loss_fn, nxt, rank, world)
    zero_run(model4, optim4, loss_fn, nxt, rank, world)
    assert_state_close(model4.state_dict(), model.state_dict(), rtol=0, atol=0)

    # --- unused parameters: the error names it; find_unused_parameters reduces a zero gradient
    odd_build, odd_loss_fn, odd_kg, odd_cs = CASES["odd"]
    (batch,) = batches("odd", 1, 2 * world)
    strict_model = ZeroDDP(Odd(with_unused=True), chunk_size=odd_cs, keep_gathered=odd_kg)
    try:
        odd_loss_fn(strict_model, micro(batch, rank, world)).backward()
        strict_model.raise_pending_error()  # kept by the backward, raised outside the autograd engine
        raise AssertionError("unused parameter not reported")
    except UnusedParameterError as e:
        assert "pass: unused." in str(e) and "find_unused_parameters" in str(e), str(e)
    assert strict_model.gathered_chunks() == []
    lenient = ZeroDDP(Odd(with_unused=True), chunk_size=odd_cs, keep_gathered=odd_kg, find_unused_parameters=True)
    lopt = ZeroOptimizer(lenient, torch.optim.Adam, lr=1e-2)
    for _ in range(2):
        lopt.backward(odd_loss_fn(lenient, micro(batch, rank, world)))
        assert lopt.step()
        lopt.zero_grad()
    # bitwise: Adam without weight decay moves nothing on a zero gradient (0 / (0 + eps) = 0)
    torch.testing.assert_close(lenient.state_dict()["unused"], torch.ones(3), rtol=0, atol=0)

    # --- offload decisions: made and reported on a CPU-only machine
    off = ZeroDDP(build(), chunk_size=cs, keep_gathered=kg, offload_optim_frac=0.5, offload_param_frac=0.25)
    ZeroOptimizer(off, torch.optim.AdamW, **ADAMW)
    trainable = [c.index for c in off.layout.chunks if c.requires_grad]
    report = off.memory_report()
    assert report.offload_optim_chunks == tuple(trainable[: -(-len(trainable) // 2)]), report
    assert len(report.offload_param_chunks) >= 1
    assert all(off.chunks[i].master.device.type == "cpu" for i in report.offload_optim_chunks)
    assert report.total("parameters") == sum(
        off.layout.shard_numel(c.index) * 4 for c in off.layout.chunks
    ), report
    return str(report)


def worker_mixed_precision(rank: int, world: int):
    """bf16 updates within 5% of a bf16-compute, fp32-master reference; fp16 overflow skips the step and backs off."""
    from optim_cases import UPDATE_RTOL, low_precision_reference, update_error

    from torch_backend import ZeroDDP, ZeroOptimizer

    build, loss_fn, kg, cs = CASES["gpt2"]
    # --- bf16: the 3-step update within 5% (relative L2) of the bf16-compute, fp32-master reference
    module = build()
    ref = copy.deepcopy(module)
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = batches("gpt2", 3, 2 * world)
    model = ZeroDDP(module, chunk_size=cs, keep_gathered=kg, mixed_precision="bf16")
    assert model.low_precision_shard(0).dtype == torch.bfloat16 and model.master_shard(0).dtype == torch.float32
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    losses = zero_run(model, optim, loss_fn, data, rank, world)
    ref_masters = low_precision_reference(ref, loss_fn, data, torch.bfloat16, lambda ps: torch.optim.AdamW(ps, **ADAMW))
    rel = update_error(model, initial, ref_masters)
    assert rel <= UPDATE_RTOL, f"relative L2 error of the bf16 update {rel:.3g} > {UPDATE_RTOL}"

    # --- fp16: forced overflow (hysteresis 1 halves at once; hysteresis 2 needs two overflows)
    results = {"bf16_losses": losses, "bf16_update_rel_l2": rel}
    for hysteresis in (1, 2):
        model = ZeroDDP(build(), chunk_size=cs, keep_gathered=kg, mixed_precision="fp16")
        optim = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, initial_scale=2.0**10, hysteresis=hysteresis)
        data = batches("gpt2", 4, 2 * world)
        optim.backward(loss_fn(model, micro(data[0], rank, world)))
        assert optim.step(), "a normal fp16 step must apply"
        optim.zero_grad()
        scales = [optim.loss_scale]
        for i in (1, 2):
            masters = [model.master_shard(c.index).clone() for c in model.chunks]
            lows = [model.low_precision_shard(c.index).clone() for c in model.chunks]
            states = [
                {k: v.clone() for k, v in optim.shard_state(c.index).items()} for c in model.chunks if c.requires_grad
            ]
            loss = loss_fn(model, micro(data[i], rank, world))
            if rank == world - 1:
                loss = loss * float("inf")  # overflow on one rank only: every rank must skip
            optim.backward(loss)
            assert not optim.step(), "overflow step must be skipped"
            optim.zero_grad()
            scales.append(optim.loss_scale)
            for c, before in zip(model.chunks, masters):
                assert torch.equal(model.master_shard(c.index), before)
            for c, before in zip(model.chunks, lows):
                assert torch.equal(model.low_precision_shard(c.index), before)
            after = [optim.shard_state(c.index) for c in model.chunks if c.requires_grad]
            for a, b in zip(after, states):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if hysteresis == 1:
            assert scales == [2.0**10, 2.0**9, 2.0**8], scales
        else:
            assert scales == [2.0**10, 2.0**10, 2.0**9], scales
        optim.backward(loss_fn(model, micro(data[3], rank, world)))
        assert optim.step()
        assert optim.skipped_steps == 2 and optim.step_count == 2
        results[f"fp16_scales_h{hysteresis}"] = scales
    return results


def worker_agreement_subgroup(rank: int, world: int):
    """The agreement group of a non-gloo data-parallel subgroup is created by that subgroup's ranks
    alone: the last rank (outside it) never calls in, the votes sum over ranks 0..W-2, and a group
    every rank creates afterwards still matches up (torch names groups by a per-process count)."""
    from torch_backend.zero import collectives

    sub = dist.new_group(list(range(world - 1)))  # every rank creates it, as torch requires
    out = 0
    if rank < world - 1:
        real = dist.get_backend
        collectives.dist.get_backend = lambda g=None: "nccl" if g is sub else real(g)  # as if sub were NCCL
        try:
            group = collectives.agreement_group(sub)
        finally:
            collectives.dist.get_backend = real
        assert group is not sub
        votes = torch.ones(3, dtype=torch.int32)
        collectives.agree(votes, group)
        out = int(votes[0])
    everyone = dist.new_group(list(range(world)))
    t = torch.ones(1)
    dist.all_reduce(t, group=everyone)
    return out, int(t)


def worker_gather_exchange(rank: int, world: int):
    """At two gloo ranks ``all_gather_flat`` is one all-to-all into the other rank's half plus a local
    copy (Note [gather as an exchange]): the buffer it fills equals gloo's own all-gather bit for bit
    (fp32 and bf16, sync and async, a shard that is a non-contiguous view), and no all-gather is issued."""
    from torch_backend.zero import collectives

    issued = []
    real_a2a, real_ag = collectives.dist.all_to_all_single, collectives._ALL_GATHER_FLAT
    collectives.dist.all_to_all_single = lambda *a, **k: (issued.append("all_to_all"), real_a2a(*a, **k))[1]
    collectives._ALL_GATHER_FLAT = lambda *a, **k: (issued.append("all_gather"), real_ag(*a, **k))[1]
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for async_op in (False, True):
                g = torch.Generator().manual_seed(10 * rank + 1)
                shard = torch.randn(2, 37, generator=g).to(dtype).t()[:, 0]  # strided: a copy is sent
                want = torch.empty(world * shard.numel(), dtype=dtype)
                real_ag(want, shard.contiguous())
                got = torch.full_like(want, float("nan"))
                collectives.all_gather_flat(got, shard, dist.group.WORLD, async_op=async_op).wait()
                assert torch.equal(got, want), (dtype, async_op, rank)
    finally:
        collectives.dist.all_to_all_single, collectives._ALL_GATHER_FLAT = real_a2a, real_ag
    return issued
