"""``chunkzero layout --nodes N --gpus-per-node G``: the two-level table, from the core alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chunkzero.cli import main
from chunkzero.configs import model_specs
from chunkzero.network_cost import Topology, compare_network
from chunkzero.search import build_layout


def test_layout_nodes_prints_the_table(capsys):
    assert main(["layout", "--model", "gpt-mini", "--precision", "bf16", "--nodes", "2", "--gpus-per-node", "4",
                 "--inter-gbps", "100", "--tokens-per-gpu", "4096"]) == 0
    out = capsys.readouterr().out
    for name in ("| zero3 | 8 | 1 |", "| hybrid S=2 | 2 | 4 |", "| hybrid S=4 | 4 | 2 |", "| hpz |", "| ddp | 1 | 8 |"):
        assert name in out, name
    assert "2 x 4 GPUs = 8" in out and "inter 100 Gbit/s" in out and "bound at 4,096 tok/GPU" in out


def test_layout_nodes_json_is_the_model():
    """In a fresh process: the numbers are compare_network's, and no framework was imported."""
    code = ("import json, sys; from chunkzero.cli import main; main(['layout', '--model', 'gpt-mini', '--nodes', '2', "
            "'--gpus-per-node', '4', '--inter-gbps', '100', '--algorithm', 'hierarchical', '--json']); "
            "print(json.dumps(sorted(m for m in ('torch', 'jax') if m in sys.modules)), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stderr.strip().splitlines()[-1]) == []
    doc = json.loads(r.stdout)
    specs = model_specs("gpt-mini")
    topo = Topology.from_gbps(2, 4, 3600, 100, 1, 5)
    want = compare_network(specs, topo, layout=build_layout(specs, 8), precision="fp32", algorithm="hierarchical")
    assert [row["strategy"] for row in doc["rows"]] == [w.name for w in want]
    assert [row["inter_bytes"] for row in doc["rows"]] == [w.inter_bytes for w in want]
    assert [row["time_s"] for row in doc["rows"]] == [w.time_s for w in want]


def test_layout_nodes_bad_input(capsys):
    assert main(["layout", "--model", "gpt-mini", "--nodes", "2", "--world-size", "4"]) == 2
    assert "--world-size 4 is not --nodes 2 x --gpus-per-node 8 = 16" in capsys.readouterr().err
    assert main(["layout", "--model", "gpt-mini", "--nodes", "2", "--measure"]) == 2
    assert "--measure does not go with --nodes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["layout", "--nodes", "0"])
    assert e.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err
