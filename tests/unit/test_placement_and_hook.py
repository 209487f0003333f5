"""The GPU rules that CPU can check: where ranks are placed on machines with 0, 1 or many GPUs (pure), and the
DDP hook's order of operations (divide, then "ready", then issue; end in the completion callback), which is
one code path for gloo and NCCL."""

import pytest
import torch

import dtlab
from dtlab.config.placement import plan
from dtlab.config.run import RunConfig
from dtlab.rank import recorder as rec_mod
from dtlab.rank.marks import Marks


@pytest.mark.parametrize(
    "ngpu,nccl,nproc,backend,device,expect",
    [
        (0, None, 2, "auto", "auto", ("gloo", "cpu", 0, 0)),
        (8, "2.27.5", 8, "auto", "auto", ("nccl", "cuda", 8, 1)),
        (8, "2.27.5", 4, "auto", "auto", ("nccl", "cuda", 4, 1)),
        (1, "2.30.3", 2, "auto", "auto", ("nccl", "cuda", 1, 2)),  # NCCL >= 2.30: two ranks share the GPU
        (1, "2.27.5", 2, "auto", "auto", ("gloo", "cuda", 1, 2)),  # older NCCL: gloo on CUDA tensors, never CPU
        (1, "2.30.3", 3, "auto", "auto", ("gloo", "cuda", 1, 3)),  # NCCL allows at most 2 per GPU
        (2, "2.30.0", 4, "nccl", "auto", ("nccl", "cuda", 2, 2)),
        (1, "2.27.5", 1, "nccl", "auto", ("nccl", "cuda", 1, 1)),
        (4, "2.27.5", 2, "gloo", "auto", ("gloo", "cuda", 2, 1)),
        (4, "2.27.5", 2, "auto", "cpu", ("gloo", "cpu", 0, 0)),
    ],
)
def test_placement_rules(ngpu, nccl, nproc, backend, device, expect):
    p = plan(nproc, backend, device, ngpu, nccl)
    assert (p.backend, p.device, p.gpus, p.ranks_per_gpu) == expect
    assert p.label
    if p.ranks_per_gpu > 1 or p.device == "cpu" or p.backend == "gloo":
        assert p.note  # every compromise says what it means for the numbers
    assert (p.env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}) == (p.backend == "nccl" and p.ranks_per_gpu > 1)
    if p.device == "cuda":  # ranks fill the GPUs round-robin
        assert [p.device_index(r) for r in range(nproc)] == [r % p.gpus for r in range(nproc)]


@pytest.mark.parametrize(
    "ngpu,nccl,nproc,backend,device,field",
    [
        (0, None, 2, "nccl", "auto", "backend 'nccl'"),
        (0, None, 2, "auto", "cuda", "device 'cuda'"),
        (1, "2.27.5", 2, "nccl", "auto", "nproc must be <= 1"),
        (1, "2.30.0", 3, "nccl", "auto", "nproc must be <= 1"),
        (1, None, 2, "nccl", "cpu", "device 'cpu'"),
        (0, None, 2, "mpi", "auto", "backend must be one of"),
        (0, None, 2, "auto", "tpu", "device must be one of"),
    ],
)
def test_placement_refuses_by_name(ngpu, nccl, nproc, backend, device, field):
    with pytest.raises(ValueError, match=field):
        plan(nproc, backend, device, ngpu, nccl)


@pytest.mark.parametrize(
    "ngpu,nccl,nproc,expect",
    [
        (1, "2.28.9", 2, ("gloo", "cpu")),  # gloo would carry CUDA tensors: the pipeline runs on CPU, labelled
        (1, "2.30.1", 2, ("nccl", "cuda")),  # NCCL's multi-rank mode sends CUDA tensors itself
        (2, "2.28.9", 2, ("nccl", "cuda")),  # one GPU per rank
        (2, "2.28.9", 4, ("gloo", "cpu")),  # 4 ranks on 2 GPUs without multi-rank NCCL: gloo again
    ],
)
def test_a_pipeline_never_sends_cuda_tensors_over_gloo(ngpu, nccl, nproc, expect):
    """On an H200 (torch 2.11) every pipeline stage on gloo with CUDA tensors failed at its first send with
    'writev: Bad address'; tensor parallelism and FSDP2 on gloo with CUDA tensors ran."""
    p = plan(nproc, "auto", "auto", ngpu, nccl, strategy="pp")
    assert (p.backend, p.device) == expect
    if p.device == "cpu":
        assert "cannot use gloo on CUDA tensors" in p.label and "Bad address" in p.note and "not used" in p.note
        with pytest.raises(ValueError, match="device 'cuda' cannot host strategy 'pp'"):
            plan(nproc, "auto", "cuda", ngpu, nccl, strategy="pp")
    assert plan(nproc, "auto", "auto", ngpu, nccl, strategy="tp").device == "cuda"


def test_config_uses_the_placement_for_every_strategy():
    cfg = dtlab.tiny(nproc=2)
    assert cfg.resolved_backend(1, "2.30.0") == "nccl" and cfg.resolved_backend(1, "2.28.9") == "gloo"
    assert cfg.resolved_backend(0) == "gloo"
    cfg.validate(cuda_device_count=1, nccl_version="2.28.9")  # DDP: gloo on CUDA tensors
    with pytest.raises(ValueError, match="device must be one of"):
        dtlab.tiny(device="gpu").validate()


@pytest.mark.parametrize(
    "path,device,backend", [("wall", "cpu", "gloo"), ("nccl", "cuda", "nccl"), ("gloo_cuda", "cuda", "gloo")]
)
def test_each_placement_names_how_it_is_timed(path, device, backend):
    """The banner, the doctor and the run record say how times are taken, from one table (and so does the
    rank, which picks its marks by the same rule)."""
    from dtlab.config.placement import TIMING, timing_path

    assert timing_path(device, backend) == path
    ngpu = 0 if device == "cpu" else 1
    p = plan(2 if backend == "gloo" else 1, backend, "auto", ngpu, "2.28.9")
    assert p.timing == TIMING[path] and p.to_dict()["timing"] == TIMING[path]
    assert ("CUDA events" in p.timing) == (device == "cuda")
    if path == "gloo_cuda":
        assert "host memory" in p.timing and "own" in p.timing


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
    r = rec_mod.BucketRecorder(world_size=4, marks=Marks(torch.device("cpu"), "gloo"))
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
    assert b == {
        "bucket": 3,
        "nbytes": 12,
        "nparams": 2,
        "t_ready": 1.0,
        "t_start": 1.0,
        "t_end": 2.5,
        "backend_ms": None,
        "wire_bytes": 12,
    }


def test_baseline_hook_is_the_recording_hook_minus_the_collective(monkeypatch):
    """The no-op baseline pays what the measured hook pays besides communication (division, ready mark,
    callback with its end mark), so T_step - T_comp does not count the hook's own cost as exposed."""
    r = rec_mod.BucketRecorder(world_size=2, marks=Marks(torch.device("cpu"), "gloo"))
    r.mode = "noop"
    marks = []
    monkeypatch.setattr(r, "_mark", lambda: marks.append("mark") or float(len(marks)))
    monkeypatch.setattr(rec_mod.dist, "all_reduce", lambda *a, **k: pytest.fail("no-op mode communicated"))
    r.begin_step(0.0)
    out = r.hook(None, _FakeBucket([2.0, 4.0]))
    assert out.wait().tolist() == [1.0, 2.0]  # divided like the measured hook, nothing exchanged
    assert marks == ["mark", "mark"]  # ready and end, as the measured hook takes them
    (b,) = r.collect()
    assert b["t_start"] == b["t_ready"] == 1.0 and b["t_end"] == 2.0


def test_backend_duration_reads_nccl_timing():
    class W:
        def _get_duration(self):
            return 0.25

    assert rec_mod.backend_duration_ms(W()) == 0.25
    assert rec_mod.backend_duration_ms(_FakeWork(None)) is None


def _run_with(buckets, ddp_stats, backend="nccl"):
    import pandas as pd

    from dtlab.results.run import Run

    empty = pd.DataFrame()
    return Run(
        path="x",
        config=RunConfig(warmup=1, strategy="ddp"),
        resolved={"backend": backend, "world_size": 2},
        status={},
        steps=empty,
        baseline_steps=empty,
        buckets=pd.DataFrame(buckets),
        collectives=empty,
        memory=empty,
        ddp_stats=pd.DataFrame(ddp_stats),
    )


def test_crosscheck_pairs_service_time_with_nccl_and_span_with_ddp():
    cols = ["rank", "step", "bucket", "nbytes", "t_ready", "t_start", "t_end", "backend_ms"]
    rows = [  # step 0 is warm-up and must be ignored; in step 1 bucket 1 queues behind bucket 0
        (0, 0, 0, 8, 0.0, 0.0, 9.0, 9000.0),
        (0, 1, 0, 8, 1.0, 1.0, 2.0, 1000.0),  # service 1.0 s, NCCL 1.0 s
        (0, 1, 1, 8, 1.5, 1.5, 4.0, 1000.0),  # issued at 1.5, channel free at 2.0: service 2.0 s, NCCL 1.0 s
    ]
    run = _run_with(
        [dict(zip(cols, r)) for r in rows],
        [{"rank": 0, "step": 1, "backward_comm_time": 2.0}, {"rank": 0, "step": 0, "backward_comm_time": 50.0}],
    )
    x = run.crosscheck().set_index("quantity")
    n = x.loc["bucket all-reduce duration vs NCCL"]
    assert n["pairs"] == 2 and n["median_rel_diff"] == pytest.approx(0.5)  # median of 0.0 and +1.0
    d = x.loc["backward communication span vs DDP's timer"]
    assert d["pairs"] == 1 and d["dtlab_s"] == pytest.approx(3.0) and d["median_rel_diff"] == pytest.approx(0.5)


def test_crosscheck_says_when_the_backend_has_no_timer():
    cols = ["rank", "step", "bucket", "nbytes", "t_ready", "t_start", "t_end", "backend_ms"]
    run = _run_with([dict(zip(cols, (0, 1, 0, 8, 0.0, 0.0, 1.0, None)))], [], backend="gloo")
    row = run.crosscheck().set_index("quantity").loc["bucket all-reduce duration vs NCCL"]
    assert row["pairs"] == 0 and "not available on gloo" in row["what"]


def test_crosscheck_does_not_compare_durations_on_one_nccl_rank():
    """One NCCL rank reduces nothing and launches no kernel: NCCL's duration is ~0 there, so a relative
    difference against it means nothing and is not computed."""
    import pandas as pd

    from dtlab.results.run import Run

    cols = ["rank", "step", "bucket", "nbytes", "t_ready", "t_start", "t_end", "backend_ms"]
    run = _run_with([dict(zip(cols, (0, 1, 0, 8, 0.0, 0.0, 1e-3, 1e-5)))], [])
    assert run.crosscheck().set_index("quantity").loc["bucket all-reduce duration vs NCCL", "pairs"] == 1
    empty = pd.DataFrame()
    one = Run(
        path="x",
        config=RunConfig(warmup=1, strategy="ddp"),
        resolved={"backend": "nccl", "world_size": 1},
        status={},
        steps=empty,
        baseline_steps=empty,
        buckets=run.buckets,
        collectives=empty,
        memory=empty,
        ddp_stats=empty,
    )
    row = one.crosscheck().set_index("quantity").loc["bucket all-reduce duration vs NCCL"]
    assert row["pairs"] == 0 and "one rank" in row["what"] and row["median_rel_diff"] != row["median_rel_diff"]


def _marks(path_backend, device, clock, calls):
    from fake_cuda import FakeTorch, make_owned

    from dtlab.rank.marks import Marks

    fake = FakeTorch(clock)
    m = Marks(device, path_backend, torch_mod=fake, clock=clock, make_stream=make_owned(calls))
    return m, fake.cuda


def test_gloo_cuda_end_mark_is_on_the_ranks_own_stream_and_device_from_gloos_thread():
    """gloo's completion callback runs on a thread with no CUDA device (device 0, default stream): the end
    mark must still land on the rank's GPU (cuda:1 here), on dtlab's own stream, not on any current stream."""
    import threading

    from fake_cuda import Clock

    clock, calls = Clock(), []
    m, cuda = _marks("gloo", torch.device("cuda", 1), clock, calls)
    cuda.set_device(1)
    m.prepare()  # the rank's main thread makes the stream, on its own device
    assert calls == [(1, threading.current_thread().name)]
    clock.t = 2.5
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("ev", m.end()), name="gloo-worker")
    t.start()
    t.join()
    ev = out["ev"]
    assert ev.recorded_on_device == 1 and ev.stream.device == 1 and ev.stream.name == "owned1"
    assert ev.t == 2.5 and len(calls) == 1  # no second stream made on gloo's thread
    assert cuda.current_device() == 1  # the guard restored the caller's device


def test_nccl_end_marks_wait_on_the_collective_on_an_owned_stream_per_group():
    """ZeRO-3 on NCCL: the end mark is taken at issue on a stream dtlab owns, made to wait on the CUDA future,
    one stream per process group; never on the (pool) stream that happens to be current."""
    from fake_cuda import Clock, FakeCudaFuture

    clock, calls = Clock(1.0), []
    m, cuda = _marks("nccl", torch.device("cuda", 0), clock, calls)
    g1, g2 = object(), object()
    a, b, c = (m.after(FakeCudaFuture(cuda), g) for g in (g1, g1, g2))
    assert [w.name for w in cuda.waits] == ["owned1", "owned1", "owned2"]  # each waited on its group's stream
    assert a.stream is b.stream and c.stream is not a.stream and a.stream.name == "owned1"
    assert m.after(FakeCudaFuture(cuda, done=False)) is None  # not completed at issue: left to the callback
    assert m.end().stream.name == "default"  # DDP's callback stream is the CUDA future's (current) one


def test_wall_path_uses_the_clock_and_needs_no_cuda():
    from fake_cuda import Clock

    from dtlab.rank.marks import Marks

    clock = Clock(3.0)
    m = Marks(torch.device("cpu"), "gloo", clock=clock)
    assert m.path == "wall" and m.now() == 3.0 and m.end() == 3.0 and m.after(object()) is None
    assert m.seconds(1.0, 3.5) == 2.5 and m.seconds(None, 1.0) is None
    with pytest.raises(ValueError, match="backend must be"):
        Marks(torch.device("cuda", 0), "mpi")


def test_ddp_hook_on_gloo_cuda_times_buckets_on_the_ranks_gpu(monkeypatch):
    """The whole bucket record on gloo with CUDA tensors, rank on cuda:1: ready on the compute stream, end from
    gloo's thread on the rank's own stream; before the fix the end landed on cuda:0 and elapsed_time raised."""
    import threading

    from fake_cuda import Clock

    clock, calls = Clock(0.0), []
    m, cuda = _marks("gloo", torch.device("cuda", 1), clock, calls)
    cuda.set_device(1)
    r = rec_mod.BucketRecorder(world_size=2, marks=m)
    start = cuda.Event()
    start.record()  # the step clock's first mark, on the compute stream of cuda:1
    r.begin_step(start)
    fut = torch.futures.Future()
    monkeypatch.setattr(rec_mod.dist, "all_reduce", lambda buf, async_op: _FakeWork(fut))
    clock.t = 1.0
    out = r.hook(None, _FakeBucket([2.0, 4.0]))
    clock.t = 2.5
    t = threading.Thread(target=fut.set_result, args=([torch.tensor([1.0, 2.0])],), name="gloo-worker")
    t.start()
    t.join()
    assert out.wait().tolist() == [1.0, 2.0]
    (b,) = r.collect()
    assert (b["t_ready"], b["t_start"], b["t_end"]) == (1.0, 1.0, 2.5)
    ends = [e for e in cuda.log if e[1] == "gloo-worker"]
    assert ends == [("record", "gloo-worker", 1, ends[0][3])] and ends[0][3].name == "owned1"
