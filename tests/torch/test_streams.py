"""The engine's stream discipline, checked on CPU: a recording stand-in for the stream layer of
``collectives.py`` (``stream_recorder.py``) runs real ZeroDDP steps through the engine's CUDA paths and
checks, per buffer, allocate → use → wait on the using stream → free (or ``record_stream``)."""

import pytest
import stream_cases
import torch
from stream_recorder import StreamRecorder

from torch_backend._testing import run_distributed
from torch_backend.zero import collectives

PLACEMENTS = {
    "offload_optim": dict(offload_optim_frac=1.0),
    "offload_param": dict(offload_param_frac=1.0, offload_optim_frac=0.0),
    "offload_both": dict(offload_param_frac=1.0, offload_optim_frac=1.0),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_recorded_step_has_every_buffer_ordered(world, name):
    reports = run_distributed(stream_cases.worker_recorded_step, world, PLACEMENTS[name], timeout=300)
    for r in reports:
        assert r["violations"] == [], "\n".join(r["violations"])
        assert r["max_diff"] == 0.0  # the stream paths compute what the plain CPU paths do
        assert r["comm_buffers"] > 0  # collectives and copies did run on the communication stream
    if world > 1:
        assert all(r["freed_cross_stream"] > 0 for r in reports)  # frees of cross-stream buffers were checked


def test_the_old_finish_reduces_fails_the_check():
    """The ordering before the fix (the reduce-scatter waited for on the communication stream, its
    buffers freed to the compute stream's pool at once) is caught at W=2."""
    reports = run_distributed(stream_cases.worker_recorded_step, 2, PLACEMENTS["offload_optim"], True, timeout=300)
    for r in reports:
        assert any("freed" in v and "without record_stream" in v for v in r["violations"]), r["violations"]


# ---------------------------------------------------------------------------- the recorder itself
def _recorded(fn):
    rec = StreamRecorder()
    previous = collectives.set_stream_layer(rec)
    try:
        with rec:
            fn(rec)
        return rec.check()
    finally:
        collectives.set_stream_layer(previous)


def test_recorder_flags_a_read_before_the_hand_over():
    def body(rec):
        x = torch.ones(4)
        with collectives.communication_stream(torch.empty(0)):
            x.mul_(2)  # written on the communication stream
        x.sum()  # read on the compute stream without waiting

    assert any("not ordered after the write on communication" in v for v in _recorded(body))


def test_recorder_accepts_hand_over_and_free_after():
    def body(rec):
        x = torch.ones(4)
        with collectives.communication_stream(torch.empty(0)):
            x.mul_(2)
        collectives.hand_over(rec.comm, rec.compute)
        x.sum()
        y = torch.ones(4)
        with collectives.communication_stream(torch.empty(0)):
            y.sum()  # read on the communication stream
        collectives.free_after(y, rec.comm)
        del y

    assert _recorded(body) == []


def test_recorder_flags_a_free_before_the_using_stream_is_waited_for():
    def body(rec):
        y = torch.ones(4)
        with collectives.communication_stream(torch.empty(0)):
            y.sum()
        del y

    assert any("freed" in v for v in _recorded(body))


# ---------------------------------------------------------------------------- pinned memory sizes
def test_pinned_block_bytes_is_the_host_allocators_power_of_two():
    from torch_backend.zero.pinned import pinned_block_bytes

    assert [pinned_block_bytes(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [0, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    # an 8M-element fp32 master plus one element takes a 64 MiB block: the waste the report must show
    assert pinned_block_bytes(4 * (8 * 2**20 + 1)) == 64 * 2**20
    with pytest.raises(ValueError, match="nbytes"):
        pinned_block_bytes(-1)


def test_held_bytes_of_unpinned_tensors_is_their_size():
    from torch_backend.zero.chunk_io import held_bytes

    assert held_bytes(torch.empty(1000, dtype=torch.bfloat16)) == 2000


# ---------------------------------------------------------------------------- every wait bounded
@pytest.fixture
def gloo_world(tmp_path):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=77))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_process_group_timeout_reads_the_groups_own(gloo_world):
    import datetime

    from torch_backend.zero.torch_internals import process_group_timeout

    assert process_group_timeout(gloo_world) == datetime.timedelta(seconds=77)


def test_nccl_vote_group_gets_the_process_groups_timeout(gloo_world, monkeypatch):
    """The gloo group an NCCL run votes on is created with the run's timeout, not torch's 30 minutes."""
    import datetime

    from torch_backend.zero import torch_internals

    own = torch_internals.process_group_timeout(gloo_world)
    created = []
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(collectives, "process_group_timeout", lambda group: own)
    monkeypatch.setattr(collectives.dist, "new_group", lambda ranks, **kw: created.append((ranks, kw)) or "votes")
    assert collectives.agreement_group(gloo_world) == "votes"
    assert created == [([0], dict(backend="gloo", use_local_synchronization=True, timeout=own))]
    collectives.agreement_group(gloo_world, timeout=datetime.timedelta(seconds=5))
    assert created[-1][1]["timeout"] == datetime.timedelta(seconds=5)


def test_cuda_workers_limit_their_threads(monkeypatch):
    """8 CUDA workers on 16 cores run 2 intra-op threads each, as CPU workers do."""
    import chunkzero.workers
    from chunkzero.train_config import TrainConfig
    from torch_backend.train import worker

    threads = []
    monkeypatch.setattr(chunkzero.workers, "available_cpu_cores", lambda: 16)  # threads_per_worker's count
    monkeypatch.setattr(worker, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    rank, world, local_rank, device = worker.init_distributed(TrainConfig(device="cuda"))
    assert device == torch.device("cuda", 3) and threads == [2]
