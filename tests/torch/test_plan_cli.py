"""``chunkzero plan`` in-process: the table, ``--json``, ``--fit --memory`` and its one-line refusals."""

from __future__ import annotations

import json

import pytest

from chunkzero.cli import main

TINY = ["--model", "gpt-tiny", "--nproc", "2", "--batch-size", "8", "--seq-len", "64", "--device", "cpu"]


def test_json_gives_the_peak_and_every_term(capsys):
    assert main(["plan", *TINY, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["peak_bytes_per_rank"] == doc["host_peak_bytes"] == sum(doc["host"].values())
    assert doc["device"] is None and doc["settings"]["world_size"] == 2
    for term in ("baseline", "parameters", "gradients", "optimizer_states", "gathered_chunks", "gradient_buffers",
                 "activations", "communication_buffers", "allocator_overhead"):
        assert term in doc["host"], term
    assert doc["host"]["activations"] > 0


def test_table_and_options_change_the_plan(capsys):
    assert main(["plan", *TINY]) == 0
    table = capsys.readouterr().out
    assert "| activations |" in table and "**peak per rank**" in table
    assert main(["plan", *TINY, "--json", "--ema-decay", "0.9", "--mixed-precision", "bf16"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["host"]["ema"] == doc["host"]["fp32_master"] > 0 and doc["host"]["parameters"] == 0


def test_fit_chooses_a_setting_within_the_memory(capsys):
    assert main(["plan", *TINY, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["peak_bytes_per_rank"]
    budget = full - full // 100  # just below the plan as given: a smaller batch or checkpointing fits
    assert main(["plan", *TINY, "--fit", "--memory", str(budget), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["peak_bytes_per_rank"] <= budget < full
    assert doc["zero_ddp"]["mixed_precision"] == "fp32" and doc["train_flags"] != "(as given)"


@pytest.mark.parametrize(("args", "message"), [
    (["--fit"], "--fit and --memory go together"),
    (["--fit", "--memory", "lots"], "--memory: expected a size"),
    (["--fit", "--memory", "1MiB"], "no setting tried fits --memory 1MiB"),
    (["--engine", "ddp"], "the memory plan is ZeroDDP's"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert main(["plan", *TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_a_gpu_run_is_planned_on_any_machine(capsys):
    """``--device cuda`` needs no GPU to plan: the device column holds the step, the host the build; full
    optimizer offload moves the master and optimizer shards to the host."""
    cuda = [*TINY[:-2], "--device", "cuda", "--mixed-precision", "bf16", "--json"]
    assert main(["plan", *cuda]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["peak_bytes_per_rank"] == doc["device_peak_bytes"] == sum(doc["device"].values())
    assert doc["device"]["activations"] > 0 and doc["host"]["activations"] == 0
    assert main(["plan", *cuda, "--offload-optim-frac", "1"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["device"]["optimizer_states"] == 0 < off["host"]["optimizer_states"] == doc["device"]["optimizer_states"]
