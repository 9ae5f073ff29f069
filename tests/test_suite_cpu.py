"""benchmarks/suite_cpu.py gives each test its own CPU, its subprocesses' CPU and its wall time, once per test, with
xdist's workers or without."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TESTS = '''
import subprocess, sys, time

def burn(seconds):
    import resource
    def cpu():
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime
    start = cpu()
    while cpu() - start < seconds:
        sum(i * i for i in range(10_000))

def test_in_process():
    burn(0.4)

def test_in_a_subprocess():
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, %r); from test_toy import burn; burn(0.4)"],
                   check=True)

def test_asleep():
    time.sleep(0.4)
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_each_test_gets_its_own_and_its_subprocesses_cpu_once(tmp_path, workers):
    toy = tmp_path / "toy"
    toy.mkdir()
    (toy / "test_toy.py").write_text(TESTS % str(toy))
    (toy / "pytest.ini").write_text("[pytest]\n")
    records = tmp_path / "cpu.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "suite_cpu.py"), "--json", str(records), "--",
                           "-q", "-p", "no:cacheprovider", "-c", str(toy / "pytest.ini"), "--rootdir", str(toy),
                           *workers, str(toy)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["test"].split("::")[-1]: r for r in map(json.loads, records.read_text().splitlines())}
    assert sorted(rows) == ["test_asleep", "test_in_a_subprocess", "test_in_process"]
    assert len(records.read_text().splitlines()) == 3  # once each: not by xdist's controller too
    assert rows["test_in_process"]["self_cpu_s"] >= 0.35 and rows["test_in_process"]["children_cpu_s"] < 0.2
    assert rows["test_in_a_subprocess"]["children_cpu_s"] >= 0.35 and rows["test_in_a_subprocess"]["self_cpu_s"] < 0.2
    asleep = rows["test_asleep"]
    assert asleep["wall_s"] >= 0.4 and asleep["self_cpu_s"] + asleep["children_cpu_s"] < 0.2
    assert "| `test_toy.py` | 3 |" in proc.stdout, proc.stdout
