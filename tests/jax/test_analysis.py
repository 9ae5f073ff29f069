"""Sharding-layout measurement: HLO collective counting, the chunk layout's collective counts,
the cost model's per-device state bytes against ``memory_analysis()``, the table, plots and the
``chunkzero layout`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import optax
import pytest
from zero_utils import BATCH, CHUNK_SIZE, SEQ, WORLD, tiny_program

from chunkzero import ChunkLayout
from chunkzero.cli import main as cli_main
from jax_backend import make_mesh
from jax_backend.analysis import (
    chunk_size_sweep,
    compare_layouts,
    count_collectives,
    parse_collectives,
    plot_comparison,
    plot_sweep,
)
from jax_backend.blocks import gpt_program
from jax_backend.gpt import GPTConfig
from jax_backend.zero import ZeroTrainer

STATE_BYTES_RTOL = 0.05
"""The cost model's resident per-device bytes vs memory_analysis() argument bytes."""

HLO = """\
HloModule jit_step, num_partitions=4
  %all_gather.3 = f32[24704]{0} all-gather(%param.21), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %reduce_scatter.4 = bf16[4144]{0} reduce-scatter(%fusion), channel_id=2, replica_groups=[1,4]<=[4], use_global_device_ids=true, dimensions={0}, to_apply=%add
  %all-reduce = (f32[100]{0}, f32[28]{0}, /*index=2*/f32[4,2]{1,0}) all-reduce(%a, %b, %c), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %ags = ((f32[8]{0}), f32[32]{0}) all-gather-start(%p), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = f32[32]{0} all-gather-done(%ags)
  %not_a_collective = f32[8]{0} add(%x, %y), metadata={op_name="all-gather"}
"""  # noqa: E501 - HLO text as XLA prints it, one instruction per line


def test_parse_collectives_of_hlo_text():
    ops = parse_collectives(HLO)
    assert [c.kind for c in ops] == ["all-gather", "reduce-scatter", "all-reduce", "all-gather"]
    ag, rs, ar, ags = ops
    assert ag.result_bytes == (24704 * 4,) and ag.group_size == 4 and ag.buffer_bytes == 24704 * 4
    assert ag.wire_bytes == 3 * 24704  # (W-1)/W of the gathered buffer
    assert rs.group_size == 4 and rs.buffer_bytes == 4 * 4144 * 2 and rs.wire_bytes == 3 * 4144 * 2
    assert ar.buffers == 3 and ar.group_size == 2 and ar.buffer_bytes == (100 + 28 + 8) * 4
    assert ar.wire_bytes == ar.buffer_bytes  # 2(n-1)/n with n = 2
    assert ags.result_bytes == (32 * 4,)
    counts = count_collectives(HLO)
    assert counts.ops == {
        "all-gather": 2,
        "reduce-scatter": 1,
        "all-reduce": 1,
        "all-to-all": 0,
        "collective-permute": 0,
    }
    assert counts.buffers["all-reduce"] == 3


@pytest.fixture(scope="module")
def comparison():
    """gpt-tiny on 4 simulated devices, all three strategies compiled for abstract inputs."""
    return compare_layouts(tiny_program(), WORLD, chunk_size=CHUNK_SIZE, measure=True, batch_size=BATCH, seq_len=SEQ)


def test_chunk_layout_collectives_equal_sharded_chunks_per_direction(comparison):
    layout = comparison.layout
    sharded = [c for c in layout.chunks if not c.keep_gathered]
    assert len(sharded) == len(layout.chunks) == 6
    row = comparison.row("chunk-zero3")
    c = row.measured.collectives
    assert c.ops["all-gather"] == c.buffers["all-gather"] == 2 * len(sharded)  # forward + backward
    assert c.ops["reduce-scatter"] == c.buffers["reduce-scatter"] == len(sharded)
    assert c.buffers["all-reduce"] == c.buffers["all-to-all"] == c.buffers["collective-permute"] == 0
    assert (row.predicted.num_allgathers, row.predicted.num_reduce_scatters) == (2 * len(sharded), len(sharded))
    # gathers move whole chunks: each chunk's bytes once per direction; ring bytes equal the cost model's
    assert c.buffer_bytes["all-gather"] == 2 * 4 * layout.total_numel
    assert c.buffer_bytes["reduce-scatter"] == 4 * layout.total_numel
    assert c.total_wire_bytes == row.predicted.comm_bytes


@pytest.mark.parametrize("strategy", ["chunk-zero3", "fsdp", "ddp"])
def test_cost_model_state_bytes_within_5pct_of_memory_analysis(comparison, strategy):
    row = comparison.row(strategy)
    args = row.measured.memory.argument_bytes
    assert abs(row.predicted_state_bytes / args - 1) < STATE_BYTES_RTOL, (strategy, row.predicted_state_bytes, args)
    assert abs(row.state_error) < STATE_BYTES_RTOL
    # the state's shards are the resident prediction plus optax's int32 step count; the batch is the rest
    assert 0 <= row.measured.resident_bytes - row.predicted_state_bytes <= 8
    assert args - row.measured.resident_bytes <= 2 * 4 * BATCH * SEQ // WORLD + 64


def test_comparison_table_and_plots(comparison, tmp_path):
    table = comparison.table()
    assert table.count("\n| chunk-zero3 |") == 1 and "| fsdp |" in table and "| ddp |" in table
    assert "12 / 12" in table  # chunk all-gathers, predicted / measured
    assert comparison.row("ddp").measured.replicated_numel == (WORLD - 1) * comparison.layout.utilized_numel
    fig = plot_comparison(comparison, str(tmp_path / "cmp.png"))
    assert (tmp_path / "cmp.png").stat().st_size > 10_000
    rows = chunk_size_sweep("hf-gpt2-medium", 8)
    assert sum(r["searched"] for r in rows) == 1
    assert rows[0]["num_chunks"] >= rows[-1]["num_chunks"]
    assert all(r["allgathers"] == 2 * r["num_chunks"] for r in rows)
    plot_sweep(rows)
    import matplotlib.pyplot as plt

    plt.close("all")
    del fig


@pytest.mark.parametrize("remat", [True, False])
def test_gathered_chunks_are_not_kept_from_forward_to_backward(remat):
    """A parameter-heavy GPT (activations tiny) with 4 and with 8 blocks: doubling the gathered model
    leaves the step's temp memory flat, so chunks are released after their use in forward and gathered
    again in backward (kept alive, temp would grow by the added blocks' bytes, and more) — also with
    ``remat=False``, whose stages keep their activations but not their gathered tensors."""
    temps, full = [], []
    for n_layer in (4, 8):
        program = gpt_program(GPTConfig(block_size=16, vocab_size=256, n_layer=n_layer, n_head=2, n_embd=128))
        layout = ChunkLayout.build(program.specs, 100_000, WORLD)
        trainer = ZeroTrainer(program, layout, make_mesh(WORLD), optax.sgd(0.1), remat=remat)
        compiled = trainer.lower(WORLD, 8).compile(compiler_options={"xla_backend_optimization_level": 0})
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
        full.append(4 * layout.total_numel)
        assert count_collectives(compiled.as_text(), WORLD).buffers["all-gather"] == 2 * len(layout.chunks)
    print(f"temp {temps} bytes for gathered models of {full} bytes")
    assert temps[1] - temps[0] < 0.1 * (full[1] - full[0])
    assert temps[1] < full[1] / 2


def test_no_remat_keeps_only_the_weight_products_from_forward_to_backward():
    """``remat=False``: per block, the step's temp memory grows by the kept outputs of the products with weights
    (q/k/v, the MLP's input projection), the block's input and what backward holds at once, about 12·C floats
    per token; not by the GELU's and the normalizations' elementwise intermediates, which backward recomputes.
    Were XLA to merge that recompute with the forward's (the kept residuals not made to depend on the cotangent),
    they would be kept from forward to backward too: about 24·C per token."""
    temps = []
    n_embd, tokens = 64, WORLD * 8 * 64
    for n_layer in (2, 4):
        program = gpt_program(GPTConfig(block_size=64, vocab_size=256, n_layer=n_layer, n_head=2, n_embd=n_embd))
        layout = ChunkLayout.build(program.specs, 100_000, WORLD)
        trainer = ZeroTrainer(program, layout, make_mesh(WORLD), optax.sgd(0.1), remat=False)
        temps.append(trainer.lower(WORLD * 8, 64).compile().memory_analysis().temp_size_in_bytes)
    per_block = (temps[1] - temps[0]) / 2
    per_token_floats = per_block / 4 / (tokens // WORLD)
    print(f"temp {temps} bytes: {per_block:.0f} per block, {per_token_floats / n_embd:.1f}·C floats per token")
    assert per_token_floats < 16 * n_embd


def test_cli_layout_predicted(capsys):
    assert cli_main(["layout", "--model", "hf-gpt2-medium", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "| chunk-zero3 |" in out and "| fsdp |" in out and "| ddp |" in out
    assert "(86 chunks)" in out  # Hugging Face GPT-2 medium's layout (the README's table)
    assert cli_main(["layout", "--model", "gpt-9000"]) == 2
    assert "unknown model 'gpt-9000'" in capsys.readouterr().err
    assert cli_main(["layout", "--model", "gpt-tiny", "--world-size", "4", "--batch-size", "6", "--measure"]) == 2


def test_cli_layout_measure_sets_device_count_and_plots(tmp_path):
    """A fresh process with no XLA_FLAGS: the command sets the device count before importing jax."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    plot = tmp_path / "layout.png"
    r = subprocess.run(
        [sys.executable, "-m", "chunkzero.cli", "layout", "--model", "gpt-tiny", "--world-size", "2", "--measure",
         "--seq-len", "16", "--json", "--plot", str(plot)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["world_size"] == 2 and [row["strategy"] for row in doc["rows"]] == ["chunk-zero3", "fsdp", "ddp"]
    zero = doc["rows"][0]
    assert (
        zero["meas_allgathers"] == zero["pred_allgathers"]
        and zero["meas_reduce_scatters"] == zero["pred_reduce_scatters"]
    )
    assert all(abs(row["state_error"]) < STATE_BYTES_RTOL for row in doc["rows"])
    assert plot.stat().st_size > 10_000


def test_only_plotting_imports_matplotlib():
    """Predicting, measuring and tabulating leave matplotlib unloaded; the first plot loads it."""
    code = ("import sys\n"
            "from jax_backend.analysis import compare_layouts\n"
            "cmp = compare_layouts('gpt-tiny', 2, measure=True, seq_len=16)\n"
            "assert '| chunk-zero3 |' in cmp.table()\n"
            "before = 'matplotlib' in sys.modules\n"
            "cmp.plot()\n"
            "print(before, 'matplotlib' in sys.modules)\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "True"]
