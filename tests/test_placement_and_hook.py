"""The GPU rules that CPU can check: where ranks are placed on machines with 0, 1 or many GPUs (pure), and the
DDP hook's order of operations (divide, then "ready", then issue; end in the completion callback), which is
one code path for gloo and NCCL."""

import pytest
import torch

import dtlab
from dtlab.rank import recorder as rec_mod
from dtlab.placement import plan


@pytest.mark.parametrize("ngpu,nccl,nproc,backend,device,expect", [
    (0, None, 2, "auto", "auto", ("gloo", "cpu", 0, 0)),
    (8, "2.27.5", 8, "auto", "auto", ("nccl", "cuda", 8, 1)),
    (8, "2.27.5", 4, "auto", "auto", ("nccl", "cuda", 4, 1)),
    (1, "2.30.3", 2, "auto", "auto", ("nccl", "cuda", 1, 2)),   # NCCL >= 2.30: two ranks share the GPU
    (1, "2.27.5", 2, "auto", "auto", ("gloo", "cuda", 1, 2)),   # older NCCL: gloo on CUDA tensors, never CPU
    (1, "2.30.3", 3, "auto", "auto", ("gloo", "cuda", 1, 3)),   # NCCL allows at most 2 per GPU
    (2, "2.30.0", 4, "nccl", "auto", ("nccl", "cuda", 2, 2)),
    (1, "2.27.5", 1, "nccl", "auto", ("nccl", "cuda", 1, 1)),
    (4, "2.27.5", 2, "gloo", "auto", ("gloo", "cuda", 2, 1)),
    (4, "2.27.5", 2, "auto", "cpu", ("gloo", "cpu", 0, 0)),
])
def test_placement_rules(ngpu, nccl, nproc, backend, device, expect):
    p = plan(nproc, backend, device, ngpu, nccl)
    assert (p.backend, p.device, p.gpus, p.ranks_per_gpu) == expect
    assert p.label
    if p.ranks_per_gpu > 1 or p.device == "cpu" or p.backend == "gloo":
        assert p.note  # every compromise says what it means for the numbers
    assert (p.env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}) == (p.backend == "nccl" and p.ranks_per_gpu > 1)
    if p.device == "cuda":  # ranks fill the GPUs round-robin
        assert [p.device_index(r) for r in range(nproc)] == [r % p.gpus for r in range(nproc)]


@pytest.mark.parametrize("ngpu,nccl,nproc,backend,device,field", [
    (0, None, 2, "nccl", "auto", "backend 'nccl'"),
    (0, None, 2, "auto", "cuda", "device 'cuda'"),
    (1, "2.27.5", 2, "nccl", "auto", "nproc must be <= 1"),
    (1, "2.30.0", 3, "nccl", "auto", "nproc must be <= 1"),
    (1, None, 2, "nccl", "cpu", "device 'cpu'"),
    (0, None, 2, "mpi", "auto", "backend must be one of"),
    (0, None, 2, "auto", "tpu", "device must be one of"),
])
def test_placement_refuses_by_name(ngpu, nccl, nproc, backend, device, field):
    with pytest.raises(ValueError, match=field):
        plan(nproc, backend, device, ngpu, nccl)


def test_config_uses_the_placement_and_refuses_zero3_on_gloo_cuda():
    cfg = dtlab.tiny(nproc=2)
    assert cfg.resolved_backend(1, "2.30.0") == "nccl" and cfg.resolved_backend(1, "2.28.9") == "gloo"
    assert cfg.resolved_backend(0) == "gloo"
    cfg.validate(cuda_device_count=1)  # DDP: gloo on CUDA tensors is allowed
    z = dtlab.tiny(nproc=2, strategy="zero3", baseline_steps=0)
    assert z.placement(1, "2.27.5").backend == "gloo"
    with pytest.raises(ValueError, match="zero3"):
        # validate() reads the NCCL version of this machine (none): 1 GPU -> gloo on CUDA -> refused
        z.validate(cuda_device_count=1)
    with pytest.raises(ValueError, match="device must be one of"):
        dtlab.tiny(device="gpu").validate()


class _FakeBucket:
    def __init__(self, values):
        self._buf = torch.tensor(values, dtype=torch.float32)

    def buffer(self):
        return self._buf

    def index(self):
        return 3

    def parameters(self):
        return [None, None]


class _FakeWork:
    def __init__(self, fut):
        self._fut = fut

    def get_future(self):
        return self._fut

    def _get_duration(self):
        raise RuntimeError("gloo has no timing")


def test_hook_divides_before_ready_and_issues_at_ready(monkeypatch):
    """Order of operations inside the hook: the bucket is averaged before the "ready" mark (so nothing of
    dtlab's sits between two all-reduces on the channel), the collective sees the averaged buffer, t_start is
    the ready mark, and t_end comes from the completion callback."""
    log = []
    r = rec_mod.BucketRecorder(world_size=4, device=torch.device("cpu"))
    r.begin_step(100.0)
    bucket = _FakeBucket([4.0, 8.0, 12.0])
    clock = iter([101.0, 102.5])

    def mark():
        log.append(("mark", bucket.buffer().tolist()))
        return next(clock)

    fut = torch.futures.Future()

    def all_reduce(buf, async_op):
        assert async_op
        log.append(("all_reduce", buf.tolist()))
        return _FakeWork(fut)

    monkeypatch.setattr(r, "_mark", mark)
    monkeypatch.setattr(rec_mod.dist, "all_reduce", all_reduce)
    out = r.hook(None, bucket)
    assert log == [("mark", [1.0, 2.0, 3.0]), ("all_reduce", [1.0, 2.0, 3.0])]  # divided, then ready, then issued
    assert not out.done()
    fut.set_result([bucket.buffer()])  # the backend completes: the callback takes the end mark
    assert out.wait().tolist() == [1.0, 2.0, 3.0]
    (b,) = r.collect()
    assert b == {"bucket": 3, "nbytes": 12, "nparams": 2, "t_ready": 1.0, "t_start": 1.0, "t_end": 2.5,
                 "backend_ms": None, "wire_bytes": 12}


def test_hook_noop_mode_sends_nothing(monkeypatch):
    r = rec_mod.BucketRecorder(world_size=2, device=torch.device("cpu"))
    r.mode = "noop"
    monkeypatch.setattr(rec_mod.dist, "all_reduce", lambda *a, **k: pytest.fail("no-op mode communicated"))
    bucket = _FakeBucket([2.0, 4.0])
    out = r.hook(None, bucket)
    assert out.wait().tolist() == [2.0, 4.0] and r.collect() == []


def test_backend_duration_reads_nccl_timing():
    class W:
        def _get_duration(self):
            return 0.25
    assert rec_mod.backend_duration_ms(W()) == 0.25
    assert rec_mod.backend_duration_ms(_FakeWork(None)) is None


def _run_with(buckets, ddp_stats, backend="nccl"):
    import pandas as pd

    from dtlab.results import Run
    empty = pd.DataFrame()
    return Run(path="x", config={"warmup": 1, "strategy": "ddp"}, resolved={"backend": backend, "world_size": 2},
               status={}, steps=empty, baseline_steps=empty, buckets=pd.DataFrame(buckets), collectives=empty,
               memory=empty, ddp_stats=pd.DataFrame(ddp_stats))


def test_crosscheck_pairs_service_time_with_nccl_and_span_with_ddp():
    cols = ["rank", "step", "bucket", "nbytes", "t_ready", "t_start", "t_end", "backend_ms"]
    rows = [  # step 0 is warm-up and must be ignored; in step 1 bucket 1 queues behind bucket 0
        (0, 0, 0, 8, 0.0, 0.0, 9.0, 9000.0),
        (0, 1, 0, 8, 1.0, 1.0, 2.0, 1000.0),     # service 1.0 s, NCCL 1.0 s
        (0, 1, 1, 8, 1.5, 1.5, 4.0, 1000.0),     # issued at 1.5, channel free at 2.0: service 2.0 s, NCCL 1.0 s
    ]
    run = _run_with([dict(zip(cols, r)) for r in rows],
                    [{"rank": 0, "step": 1, "backward_comm_time": 2.0}, {"rank": 0, "step": 0, "backward_comm_time": 50.0}])
    x = run.crosscheck().set_index("quantity")
    n = x.loc["bucket all-reduce duration vs NCCL"]
    assert n["pairs"] == 2 and n["median_rel_diff"] == pytest.approx(0.5)   # median of 0.0 and +1.0
    d = x.loc["backward communication span vs DDP's timer"]
    assert d["pairs"] == 1 and d["dtlab_s"] == pytest.approx(3.0) and d["median_rel_diff"] == pytest.approx(0.5)


def test_crosscheck_says_when_the_backend_has_no_timer():
    cols = ["rank", "step", "bucket", "nbytes", "t_ready", "t_start", "t_end", "backend_ms"]
    run = _run_with([dict(zip(cols, (0, 1, 0, 8, 0.0, 0.0, 1.0, None)))], [], backend="gloo")
    row = run.crosscheck().set_index("quantity").loc["bucket all-reduce duration vs NCCL"]
    assert row["pairs"] == 0 and "not available on gloo" in row["what"]


def test_ddp_run_records_ddp_timer_beside_its_own(tiny_run):
    """The real 2-rank run writes DDP's own per-step timer for the measured steps, and dtlab's span of the
    same rank-steps lands near it (two clocks on the same events: a 50% band catches a unit or step mix-up,
    e.g. nanoseconds read as seconds or step k paired with step k-1)."""
    st = tiny_run.ddp_stats
    assert set(st["rank"]) == {0, 1}
    measured = set(range(tiny_run.warmup, tiny_run.config["steps"]))
    assert measured - {tiny_run.config["steps"] - 1} <= set(st["step"])
    row = tiny_run.crosscheck().set_index("quantity").loc["backward communication span vs DDP's timer"]
    assert row["pairs"] >= 2 and abs(row["median_rel_diff"]) < 0.5
