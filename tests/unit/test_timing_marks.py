"""One way to take marks for every strategy (dtlab.rank.marks), without a GPU: a fake CUDA (tests/fake_cuda.py)
whose device clock moves one tick with every event it reaches while the host's calls return at once.

- the pipeline's p2p records survive a backend that coalesces a batch into one Work (NCCL's batch_isend_irecv;
  1F1B fuses a forward send with a backward receive), through torch's own `_batch_p2p` and `_wait_batch_p2p`;
- a wait or blocking call on a side stream (FSDP2's all-gather stream) is an interval but not time blocked;
- owned streams are made before the first step, and one made inside a step is counted;
- the summary and the breakdown say the method the run recorded, never "CUDA events" for host-clock figures;
- the launcher keeps the user's NCCL settings and says what it set.
"""

import json
import types

import pytest
import torch
import torch.distributed as dist
from fake_cuda import FakeCudaFuture, FakeStream, FakeTorch, TickClock, make_owned

from dtlab.config.environment import ENV_SET, env_record, set_default
from dtlab.rank.collectives import CommRecorder
from dtlab.rank.marks import Marks
from dtlab.rank.strategies import pp_p2p as pp


class Writer:
    def __init__(self):
        self.events = []

    def write(self, kind, **fields):
        self.events.append((kind, fields))

    def of(self, kind):
        return [f for k, f in self.events if k == kind]


def _fake_marks(calls=None):
    clock = TickClock()
    fake = FakeTorch(clock)
    m = Marks(
        torch.device("cpu"),
        "gloo",
        torch_mod=fake,
        clock=clock,
        make_stream=make_owned([] if calls is None else calls),
        path="nccl",
    )
    return m, fake.cuda


class OneWork:
    """The one Work a coalescing backend returns for a whole batch."""

    waited = 0

    def wait(self):
        OneWork.waited += 1
        return True


class Op:
    """What torch's `_batch_p2p` and the recorder read of a P2POp: the function, the tensor and the peer."""

    def __init__(self, fn, n: int, peer: int = 1):
        # group: torch 2.14's _batch_p2p sorts a fused batch's ops by their group's name (one group here)
        self.op, self.tensor, self.peer, self.tag, self.group_peer = fn, torch.zeros(n), peer, 0, peer
        self.group = types.SimpleNamespace(group_name="0")


def test_a_helper_that_returns_one_work_instead_of_a_list_is_recorded():
    marks, _ = _fake_marks()
    writer = Writer()
    rec = CommRecorder(writer, 0, marks)
    p2p = pp.P2PRecorder(lambda ops, desc=None: OneWork(), lambda work: work.wait())
    pp.ACTIVE["recorder"] = rec
    try:
        p2p.wait_p2p(p2p.batch_p2p([Op(dist.isend, 4), Op(dist.irecv, 4)], desc="fwd_send_bwd_recv"))
        rec.flush()
    finally:
        pp.ACTIVE["recorder"] = None
    assert [f["t_end"] is not None for f in writer.of("collective")] == [True, True]


def test_a_helper_that_calls_itself_through_the_module_is_recorded_once(monkeypatch):
    """A torch whose `_batch_p2p` splits a batch and calls `_batch_p2p` again through the module (the wrapped name):
    the inner call is not recorded a second time."""
    import types

    mod = types.SimpleNamespace()

    def batch_p2p(ops, desc=None):
        if len(ops) > 1:
            return [w for op in ops for w in mod._batch_p2p([op], desc=desc)]
        return [OneWork()]

    marks, _ = _fake_marks()
    writer = Writer()
    rec = CommRecorder(writer, 0, marks)
    p2p = pp.P2PRecorder(batch_p2p, lambda works: [w.wait() for w in works])
    mod._batch_p2p = p2p.batch_p2p
    monkeypatch.setitem(pp.ACTIVE, "recorder", rec)
    p2p.wait_p2p(mod._batch_p2p([Op(dist.isend, 4), Op(dist.irecv, 8)], desc="fwd_send_bwd_recv"))
    rec.flush()
    assert sorted(f["nbytes"] for f in writer.of("collective")) == [16, 32]


def test_a_call_on_a_side_stream_is_an_interval_but_not_time_blocked():
    marks, cuda = _fake_marks()
    writer = Writer()
    rec = CommRecorder(writer, 0, marks)
    rec.begin(0, marks.now())
    rec.record_call("all_reduce", 8, "dp", 2, lambda: None)  # on the compute stream: the stream waits for it
    with cuda.stream(FakeStream(0, "all_gather_stream")):  # FSDP2's own stream: only that stream waits
        rec.record_call("all_gather", 16, "dp", 2, lambda: None)
    a = marks.compute_mark()
    rec.block_here("all_gather", a, marks.compute_mark(), "wait_for_unshard")
    blocked = rec.flush()
    assert [f["op"] for f in writer.of("collective")] == ["all_reduce", "all_gather"]
    assert [(f["op"], f["how"]) for f in writer.of("blocked")] == [
        ("all_reduce", "blocking_call"),
        ("all_gather", "wait_for_unshard"),
    ]
    assert blocked == 2.0  # two intervals of one tick each


def test_step_clock_and_timeline_read_the_device_clock():
    from dtlab.rank.recorder import Mark, StepClock

    marks, cuda = _fake_marks()
    clock = StepClock(marks)
    clock.mark(Mark.START)
    clock.mark(Mark.FWD)
    clock.mark(Mark.OPT)
    assert clock.read() == {Mark.START: 0.0, Mark.FWD: 1.0, Mark.OPT: 2.0}
    assert all(rec[3] is cuda.current_stream() for rec in cuda.log if rec[0] == "record")  # the compute stream


def test_a_mark_is_typed_and_a_misspelt_one_is_refused():
    """A string mark ("fwd0" for "fwd 0", "optm") once changed a time silently; a mark is a Mark now."""
    from dtlab.rank.loop import step_times
    from dtlab.rank.recorder import Mark, StepClock

    marks, _ = _fake_marks()
    clock = StepClock(marks)
    with pytest.raises(TypeError, match=r"one of Mark.START, .*Mark.OPT.*got 'fwd'"):
        clock.mark("fwd")
    for m in (Mark.START, (Mark.FWD, 0), (Mark.BWD, 0), (Mark.FWD, 1), (Mark.BWD, 1), Mark.OPTIM, Mark.OPT):
        clock.mark(*m) if isinstance(m, tuple) else clock.mark(m)
    t = clock.read()  # one tick per mark: fwd0 1, bwd0 2, fwd1 3, bwd1 4, optim 5, opt 6
    assert step_times(t) == {"t_fwd": 2.0, "t_bwd": 2.0, "t_opt": 2.0, "t_step": 6.0}
    assert step_times(t, optimizer_s=1.0) == {"t_fwd": 2.0, "t_bwd": 2.0, "t_opt": 1.0, "t_step": 5.0}


def test_owned_streams_are_made_before_the_first_step_and_late_ones_are_counted():
    calls = []
    marks, cuda = _fake_marks(calls)
    g1, g2 = object(), object()
    marks.prepare([g1, dist.group.WORLD])
    assert len(calls) == 2  # the default group's (WORLD is it) and g1's
    marks.seal()
    marks.after(FakeCudaFuture(cuda), g1)
    marks.after(FakeCudaFuture(cuda), None)
    assert marks.facts()["streams_made_in_steps"] == 0
    marks.after(FakeCudaFuture(cuda), g2)  # a group first met inside a step
    assert len(calls) == 3 and marks.facts()["streams_made_in_steps"] == 1
    assert marks.facts()["method"] == "cuda_events"


def _run_dir(tmp_path, name, resolved, strategy="tp"):
    d = tmp_path / name
    (d / "events").mkdir(parents=True)
    (d / "config.json").write_text(
        json.dumps(
            {
                "config": {"strategy": strategy, "warmup": 0, "nproc": 1},
                "resolved": {"world_size": 1, "backend": "nccl", **resolved},
            }
        )
    )
    ev = [
        {
            "kind": "step",
            "rank": 0,
            "step": s,
            "t_fwd": 0.1,
            "t_bwd": 0.2,
            "t_opt": 0.1,
            "t_step": 0.4,
            "loss": 0.7,
            "t_blocked": 0.05,
        }
        for s in range(3)
    ]
    ev += [
        {
            "kind": "collective",
            "rank": 0,
            "step": s,
            "op": "all_reduce",
            "nbytes": 8,
            "phase": "forward",
            "seq": s,
            "t_start": 0.0,
            "t_end": 0.1,
        }
        for s in range(3)
    ]
    (d / "events" / "rank0.jsonl").write_text("\n".join(json.dumps(e) for e in ev) + "\n")
    from dtlab.results.run import load_run

    with pytest.warns(Warning):
        return load_run(str(d))


CUDA_PLACEMENT = {"label": "NCCL, 1 rank, one GPU each", "timing": "CUDA events, read once per step: ..."}


@pytest.mark.parametrize(
    "resolved,words,where",
    [
        (
            {"device_type": "cuda", "placement": CUDA_PLACEMENT, "timing_method": {"method": "cuda_events"}},
            "CUDA events on the compute stream",
            "compute stream",
        ),
        (
            {
                "device_type": "cpu",
                "placement": {"label": "gloo on CPU", "timing": "wall clocks (time.perf_counter): ..."},
                "timing_method": {"method": "wall_clock"},
            },
            "wall clock (time.perf_counter)",
            "training thread",
        ),
        # a tensor-parallel run recorded on CUDA before its marks were events: host launch times under a placement
        # that says "CUDA events"; the screen must not repeat that claim
        (
            {
                "device_type": "cuda",
                "placement": CUDA_PLACEMENT,
                "collective_timing": "host wall clocks (time.perf_counter), seconds from the step start",
            },
            "wall clock (time.perf_counter)",
            "training thread",
        ),
    ],
)
def test_the_screens_words_follow_the_recorded_timing_method(tmp_path, resolved, words, where):
    run = _run_dir(tmp_path, "r", resolved)
    table = run.summary()
    s = table.set_index("quantity")
    assert words in s.loc["T_step", "how"] and where in s.loc["exposed", "how"]
    timing = [ln for ln in run.breakdown_table(table).splitlines() if ln.startswith("  timing:")]
    assert len(timing) == 1 and timing[0].startswith(f"  timing: {words}")
    cuda = words.startswith("CUDA")
    assert ("CUDA events" in " ".join(s["how"]) + timing[0]) == cuda
    if resolved["device_type"] == "cuda" and not cuda:
        assert "launch" in timing[0]  # says what host clocks measure on CUDA


def test_nccl_settings_are_set_only_where_unset_and_recorded():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_DEBUG": "INFO", "PATH": "/bin"}
    assert not set_default(env, "TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    assert set_default(env, "TORCH_NCCL_ENABLE_TIMING", "1")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and env[ENV_SET] == "TORCH_NCCL_ENABLE_TIMING"
    assert env_record(env) == {
        "set_by_dtlab": {"TORCH_NCCL_ENABLE_TIMING": "1"},
        "from_user": {"NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
    }


@pytest.mark.parametrize("user", [None, "0"])
def test_the_launcher_keeps_the_users_error_handling(monkeypatch, tmp_path, user):
    from dtlab.launching import torchrun

    seen = {}

    class Proc:
        pid = 0

    def popen(args, **kw):
        seen.update(kw["env"])
        return Proc()

    monkeypatch.setattr(torchrun.subprocess, "Popen", popen)
    monkeypatch.setenv("DTLAB_WARM_AGENT", "0")
    if user is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", user)
    proc = torchrun.start_torchrun(str(tmp_path), 2, "dtlab.rank.worker", gloo_threads=True)
    import os

    os.close(proc.dtlab_lifeline)
    assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == (user or "3")
    assert ("TORCH_NCCL_ASYNC_ERROR_HANDLING" in seen.get(ENV_SET, "").split(",")) == (user is None)
