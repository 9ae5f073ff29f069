"""Workers of the real-model recipe tests: activation checkpointing, ``torch.autograd.grad``, ranks that
use different parameters (MoE routing), frozen parameters, and the refusal of silent no-ops.

Each compares a ZeroDDP run on W ranks with a single-process run of an identical copy on the full
batch (fp32, rtol 1e-5, Adam eps 1e-6).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from zero_cases import ADAMW, FP32, assert_state_close, gpt2_loss, hf_gpt2, mean_over_ranks, micro


class CheckpointedMLP(nn.Module):
    """Blocks run under ``torch.utils.checkpoint`` (reentrant or not); one block is frozen, and one
    weight is used raw inside a checkpointed plain function (no module call)."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.use_reentrant = use_reentrant
        self.emb = nn.Embedding(10, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4))
        self.blocks[1].requires_grad_(False)
        self.mix = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.head = nn.Linear(16, 1)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.use_reentrant)
        x = checkpoint(lambda t: torch.tanh(t @ self.mix), x, use_reentrant=self.use_reentrant)
        return self.head(x).squeeze(-1)


def mse_loss(model, batch):
    idx, y = batch
    return F.mse_loss(model(idx), y)


def _data(kind, steps, global_batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "lm":
        return [torch.randint(0, 64, (global_batch, 8), generator=g) for _ in range(steps)]
    return [(torch.randint(0, 10, (global_batch, 5), generator=g), torch.randn(global_batch, 5, generator=g))
            for _ in range(steps)]


def _train_both(model, optim, ref, ref_opt, loss_fn, data, rank, world, *, ref_loss_fn=None):
    losses, ref_losses = [], []
    for batch in data:
        loss = loss_fn(model, micro(batch, rank, world))
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
        r = (ref_loss_fn or loss_fn)(ref, batch)
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32)
    assert_state_close(model.state_dict(), ref.state_dict(), **FP32)
    assert model.gathered_chunks() == [], model.gathered_chunks()


def worker_activation_checkpointing(rank: int, world: int):
    """``torch.utils.checkpoint`` (non-reentrant and reentrant, frozen block, a plain checkpointed
    function) and HF ``gradient_checkpointing_enable()`` train equal to the reference."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    for use_reentrant in (False, True):
        module = CheckpointedMLP(use_reentrant)
        ref = copy.deepcopy(module)
        model = ZeroDDP(module, chunk_size=700, prefetch=1)
        assert sum(not c.requires_grad for c in model.chunks) >= 1 and len(model.chunks) >= 5
        optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **ADAMW)
        _train_both(model, optim, ref, ref_opt, mse_loss, _data("mse", 3, 2 * world), rank, world)
        # frozen chunks: compute dtype only, and nothing pinned or gathered after the backward
        assert all(c.master is None for c in model.chunks if not c.requires_grad)

    for use_reentrant in (False, True):
        module = hf_gpt2(n_layer=3)
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        module.train()
        ref = copy.deepcopy(module)
        model = ZeroDDP(module, chunk_size=1500, prefetch=1)
        optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
        ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
        _train_both(model, optim, ref, ref_opt, gpt2_loss, _data("lm", 3, 2 * world), rank, world)
    return True


def worker_autograd_grad(rank: int, world: int):
    """``torch.autograd.grad`` with respect to the input embeddings (saliency, and a gradient penalty
    with ``create_graph=True``) equals the reference's, leaves no gradient or gathered chunk behind,
    and the training steps around it still equal the reference."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    module = hf_gpt2(n_layer=3)
    ref = copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=1500, prefetch=1)
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    data = _data("lm", 3, 2 * world)

    def saliency(m, ids):
        inner = m.module if isinstance(m, ZeroDDP) else m
        with torch.no_grad():
            emb = inner.get_input_embeddings()(ids)
        emb = emb.detach().requires_grad_(True)
        out = m(inputs_embeds=emb).logits
        (g,) = torch.autograd.grad(out.square().sum(), emb)
        return g

    for step, batch in enumerate(data):
        mine = micro(batch, rank, world)
        got = saliency(model, mine)
        want = saliency(ref, batch)[rank * mine.shape[0] : (rank + 1) * mine.shape[0]]
        # fp32 relative 1e-5; absolute 1e-5 x the largest gradient, for elements near zero (the matmuls
        # of a 2-row and a 6-row batch sum in another order)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        assert model.gathered_chunks() == [] and all(model.grad_shard(c.index) is None for c in model.chunks)
        if step == 1:
            # gradient penalty: the loss includes the norm of the input gradient (double backward)
            def penalized(m, ids):
                inner = m.module if isinstance(m, ZeroDDP) else m
                with torch.no_grad():
                    emb = inner.get_input_embeddings()(ids)
                emb = emb.detach().requires_grad_(True)
                out = m(inputs_embeds=emb, labels=ids)
                (g,) = torch.autograd.grad(out.loss, emb, create_graph=True)
                return out.loss + 0.1 * g.square().sum() * ids.shape[0]

            loss = penalized(model, mine)
            optim.backward(loss)
            r = penalized(ref, batch) / 1.0
            r.backward()
        else:
            optim.backward(gpt2_loss(model, mine))
            gpt2_loss(ref, batch).backward()
        optim.step()
        optim.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        assert model.gathered_chunks() == [], (step, model.gathered_chunks())
    assert_state_close(model.state_dict(), ref.state_dict(), rtol=1e-4, atol=1e-6)
    return True


class MoE(nn.Module):
    """Two experts routed by the sign of the first input feature; an expert that gets no token is not
    called at all (so on a rank whose micro-batch has one sign, one expert is idle)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 16)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2))
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        route = (x[:, 0] > 0).long()
        y = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            mask = route == i
            if mask.any():
                y = y.index_put((mask.nonzero().squeeze(1),), expert(h[mask]))
        return self.out(y + h).squeeze(-1)


def moe_idle_expert_run(rank: int, world: int, shard_group_size: int | None = None):
    """Train :class:`MoE` with an expert idle on rank 0 (each expert in its own chunk; shards over
    ``shard_group_size`` ranks, all when ``None``) and its single-process reference, asserting they agree
    (:func:`_train_both`). Returns the ZeroDDP model."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    module = MoE()
    ref = copy.deepcopy(module)
    model = ZeroDDP(module, chunk_size=600, prefetch=1, shard_group_size=shard_group_size)
    expert_chunks = {model.layout.tensor(f"experts.{i}.0.weight").chunk for i in range(2)}
    assert len(expert_chunks) == 2 and model.replicas == world // (shard_group_size or world), model.layout.summary()
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    g = torch.Generator().manual_seed(5)
    data = []
    for _ in range(3):
        x = torch.randn(4 * world, 4, generator=g)
        # rank r's micro-batch: rank 0 only positive first features (expert 1 idle there), the others mixed
        n = x.shape[0] // world
        x[:n, 0] = x[:n, 0].abs()
        data.append((x, torch.randn(4 * world, generator=g)))

    def loss_fn(m, batch):
        x, y = batch
        return F.mse_loss(m(x), y)

    _train_both(model, optim, ref, ref_opt, loss_fn, data, rank, world)
    return model


def worker_moe(rank: int, world: int):
    """An expert idle on one rank only (its own chunk) trains equal to the reference."""
    return moe_idle_expert_run(rank, world).collective_stats


def worker_no_silent_noops(rank: int, world: int):
    """A plain torch optimizer or clip_grad_norm_ over model.parameters() raises a clear error; after
    the error the model trains on."""
    from chunkzero.errors import ConfigError
    from torch_backend import ZeroDDP, ZeroOptimizer

    module = hf_gpt2(n_layer=2)
    model = ZeroDDP(module, chunk_size=1500)
    batch = micro(_data("lm", 1, 2 * world)[0], rank, world)
    gpt2_loss(model, batch).backward()
    for what, call in (("sgd", lambda: torch.optim.SGD(model.parameters(), lr=0.1).step()),
                       ("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))):
        try:
            call()
        except ConfigError as e:
            assert "ZeroOptimizer" in str(e), (what, str(e))
        else:
            raise AssertionError(f"{what} over model.parameters() did nothing and said nothing")
    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    optim.zero_grad()
    optim.backward(gpt2_loss(model, batch))
    assert optim.step()
    return True


class _RaiseOnce(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (an error inside the autograd engine)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _RaiseOnce.armed:
            _RaiseOnce.armed = False
            raise RuntimeError("raised inside backward")
        return grad


class RaisesInBackward(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 1)

    raise_in_forward = False

    def forward(self, idx):
        x = self.emb(idx)
        for i, block in enumerate(self.blocks):
            if i == 2 and self.raise_in_forward:
                raise RuntimeError("raised inside forward")
            x = torch.tanh(block(_RaiseOnce.apply(x) if i == 2 else x))
        return self.head(x).squeeze(-1)


def worker_error_in_backward(rank: int, world: int):
    """A backward that raises inside the autograd engine (on every rank) leaves the engine usable:
    whether the next call is ``zero_grad`` or a forward, training then equals the reference and no
    chunk stays gathered. So does a forward that raises (after a complete step, so that the backward's
    first chunks would be gathered ahead), whether chunks are resharded after forward or not."""
    from torch_backend import ZeroDDP, ZeroOptimizer

    data = _data("mse", 3, 2 * world)
    for reshard in (True, False):
        module = RaisesInBackward()
        model = ZeroDDP(module, chunk_size=300, prefetch=1, reshard_after_forward=reshard)
        optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
        optim.backward(mse_loss(model, micro(data[0], rank, world)))
        optim.step()
        optim.zero_grad()
        module.raise_in_forward = True
        try:
            mse_loss(model, micro(data[1], rank, world))
        except RuntimeError as e:
            assert "raised inside forward" in str(e), str(e)
        else:
            raise AssertionError("the forward did not raise")
        module.raise_in_forward = False
        assert model.gathered_chunks() == [], (reshard, model.gathered_chunks())
        optim.backward(mse_loss(model, micro(data[1], rank, world)))
        assert optim.step()

    for recover_with in ("zero_grad", "forward"):
        module = RaisesInBackward()
        ref = copy.deepcopy(module)
        model = ZeroDDP(module, chunk_size=300, prefetch=1)
        assert len(model.chunks) >= 3
        optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
        _RaiseOnce.armed = True
        try:
            optim.backward(mse_loss(model, micro(data[0], rank, world)))
        except RuntimeError as e:
            assert "raised inside backward" in str(e), str(e)
        else:
            raise AssertionError("the backward did not raise")
        if recover_with == "zero_grad":
            optim.zero_grad()
        else:
            with torch.no_grad():
                model(micro(data[0], rank, world)[0])
            optim.zero_grad()
        assert model.gathered_chunks() == [], (recover_with, model.gathered_chunks())
        _train_both(model, optim, ref, torch.optim.AdamW(ref.parameters(), **ADAMW), mse_loss, data, rank, world)
    return True


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).squeeze(-1)


def worker_compile(rank: int, world: int):
    """``ZeroDDP(torch.compile(module))`` and compiled blocks train equal to the eager reference;
    ``torch.compile`` of the ZeroDDP itself is refused with a clear error."""
    from chunkzero.errors import ConfigError
    from torch_backend import ZeroDDP, ZeroOptimizer

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4 * world, 16, generator=g), torch.randn(4 * world, generator=g)) for _ in range(3)]

    def loss_fn(m, batch):
        x, y = batch
        return F.mse_loss(m(x), y)

    for how in ("blocks", "whole"):
        module = Blocks()
        ref = copy.deepcopy(module)
        if how == "whole":
            module = torch.compile(module, backend="aot_eager")  # dynamo + AOT autograd, no codegen
        else:
            for i, block in enumerate(module.blocks):
                module.blocks[i] = torch.compile(block)  # inductor
        model = ZeroDDP(module, chunk_size=700, prefetch=1)
        optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
        ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
        for batch in data:
            optim.backward(loss_fn(model, micro(batch, rank, world)))
            optim.step()
            optim.zero_grad()
            loss_fn(ref, batch).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        got = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
        assert_state_close(got, ref.state_dict(), **FP32)
        assert model.gathered_chunks() == []
    try:
        torch.compile(ZeroDDP(Blocks()), backend="aot_eager")(data[0][0])
    except ConfigError as e:
        assert "compile the module or its blocks" in str(e), str(e)
    else:
        raise AssertionError("torch.compile of a ZeroDDP ran without a word")
    return True


class Tied(nn.Module):
    """Embedding, LayerNorm, Linear layers, and a head tied to the embedding after construction."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(3))
        self.head = nn.Linear(16, 10)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


class RawParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))


def worker_meta_init(rank: int, world: int, weights_path: str):
    """A module built on the meta device: its values (reset_parameters per submodule, in module order)
    equal eager init's under the same seed, tied weights stay tied, it trains equal to the eager
    reference; load_pretrained fills an uninitialized one; a submodule without reset_parameters is
    refused with a clear error naming it."""
    from chunkzero.errors import ConfigError
    from torch_backend import ZeroDDP, ZeroOptimizer
    from torch_backend.checkpoint.pretrained import load_pretrained

    torch.manual_seed(0)
    eager = Tied()
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = Tied()
    model = ZeroDDP(lazy, chunk_size=400, device="cpu")
    assert len(model.chunks) >= 3 and lazy.head.weight is lazy.emb.weight
    assert not any(p.is_meta for p in lazy.parameters())
    assert_state_close(model.state_dict(), eager.state_dict(), rtol=0, atol=0)  # bitwise: same init kernels, same seed

    optim = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(eager.parameters(), **ADAMW)
    data = [torch.randint(0, 10, (2 * world, 6), generator=torch.Generator().manual_seed(s)) for s in range(2)]

    def loss_fn(m, idx):
        return F.cross_entropy(m(idx).flatten(0, 1), idx.flatten())

    _train_both(model, optim, eager, ref_opt, loss_fn, data, rank, world)

    # uninitialized on purpose, then streamed from a safetensors file
    with torch.device("meta"):
        empty = Tied()
    model2 = ZeroDDP(empty, chunk_size=400, device="cpu", param_init_fn=lambda m: None)
    report = load_pretrained(model2, weights_path)
    assert report.missing_keys == [] and report.unexpected_keys == []
    from safetensors.torch import load_file

    loaded, saved = model2.state_dict(), load_file(weights_path)  # bitwise: copied from the file
    for k, v in saved.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
    torch.testing.assert_close(loaded["head.weight"], saved["emb.weight"], rtol=0, atol=0)  # tied

    with torch.device("meta"):
        raw = RawParam()
    try:
        ZeroDDP(raw, device="cpu")
    except ConfigError as e:
        assert "RawParam" in str(e) and "param_init_fn" in str(e), str(e)
    else:
        raise AssertionError("a meta parameter without an initializer was accepted")
    model3 = ZeroDDP(RawParam().to("meta"), device="cpu", param_init_fn=lambda m: torch.nn.init.ones_(m.w))
    assert torch.equal(model3.state_dict()["w"], torch.ones(4, 4))
    return True
