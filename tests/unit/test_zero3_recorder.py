"""The ZeRO-3 collective recorder against a fake comm backend: no process group, no DeepSpeed engine.

The fake backend has DeepSpeed 0.19.8 TorchBackend's method signatures (checked against DeepSpeed's source
below) and returns fake Work objects with get_future(). Every positional tensor gets a different size, so a
wrong index in `_METHODS` shows up as wrong bytes, and a wrong async_op index as a wrong async flag.
"""

import ast
import importlib.util
import inspect
import os
import time

import numpy as np
import pandas as pd
import pytest
import torch

from dtlab.model.prediction import replay_zero3
from dtlab.rank.strategies.zero3.blocked import blocked_seconds
from dtlab.rank.strategies.zero3.comm import _METHODS, CollectiveRecorder, _TimedWork

SUM = "sum"


class FakeFuture:
    def __init__(self):
        self._cbs, self.done = [], False

    def add_done_callback(self, cb):
        self._cbs.append(cb)
        if self.done:
            cb(self)

    def complete(self):
        self.done = True
        for cb in self._cbs:
            cb(self)


class FakeWork:
    """Completes when waited on (after `delay_s`), or raises `wait_error`."""

    def __init__(self, delay_s=0.0, wait_error=None):
        self.fut, self.delay_s, self.wait_error, self.waited = FakeFuture(), delay_s, wait_error, 0

    def get_future(self):
        return self.fut

    def is_completed(self):
        return self.fut.done

    def wait(self, timeout=None):
        self.waited += 1
        if self.wait_error is not None:
            raise self.wait_error
        time.sleep(self.delay_s)
        self.fut.complete()
        return True


class FakeBackend:
    """DeepSpeed 0.19.8 TorchBackend's collective signatures (deepspeed/comm/torch.py), fake bodies."""

    def __init__(self, delay_s=0.0, raise_in=None, wait_error=None):
        self.delay_s, self.raise_in, self.wait_error = delay_s, raise_in, wait_error
        self.calls = []

    def _do(self, name, async_op):
        self.calls.append(name)
        if self.raise_in == name:
            raise RuntimeError(f"{name} failed in the fake backend")
        if async_op:
            return FakeWork(self.delay_s, self.wait_error)
        time.sleep(self.delay_s)
        return None

    def all_reduce(self, tensor, op=SUM, group=None, async_op=False):
        return self._do("all_reduce", async_op)

    def inference_all_reduce(self, tensor, op, group=None):
        return self._do("inference_all_reduce", False)

    def all_reduce_coalesced(self, tensors, op=SUM, group=None, async_op=False):
        return self._do("all_reduce_coalesced", async_op)

    def reduce(self, tensor, dst, op=SUM, group=None, async_op=False):
        return self._do("reduce", async_op)

    def reduce_scatter(self, output, input_list, op=SUM, group=None, async_op=False):
        return self._do("reduce_scatter", async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        return self._do("broadcast", async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        return self._do("all_gather", async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        return self._do("all_gather_into_tensor", async_op)

    def all_gather_base(self, output_tensor, input_tensor, group=None, async_op=False):
        return self._do("all_gather_base", async_op)

    def all_gather_coalesced(self, output_tensors, input_tensors, group=None, async_op=False):
        return self._do("all_gather_coalesced", async_op)

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=SUM, group=None, async_op=False):
        return self._do("reduce_scatter_tensor", async_op)

    def all_to_all_single(
        self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
    ):
        return self._do("all_to_all_single", async_op)

    def all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op=False):
        return self._do("all_to_all", async_op)


def _params(method):
    """Parameter names after self, from the fake backend."""
    return list(inspect.signature(getattr(FakeBackend, method)).parameters)[1:]


def _deepspeed_signatures():
    """{method: [parameter names after self]} of TorchBackend, read from DeepSpeed's source (no import, so the
    test process's accelerator is left alone)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepspeed is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "comm", "torch.py")
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TorchBackend")
    return {f.name: [a.arg for a in f.args.args][1:] for f in cls.body if isinstance(f, ast.FunctionDef)}


def test_methods_table_matches_deepspeed_torch_backend():
    ds = _deepspeed_signatures()
    for method, (_op, (b_idx, b_name), async_spec) in _METHODS.items():
        assert method in ds, f"{method} is not a TorchBackend method"
        params = ds[method]
        assert params == _params(method), f"the fake {method} drifted from DeepSpeed's signature"
        assert params[b_idx] == b_name, f"{method}: bytes tensor {b_name!r} is not at index {b_idx}: {params}"
        if async_spec is None:
            assert "async_op" not in params, method
        else:
            a_idx, a_name = async_spec
            assert params[a_idx] == a_name == "async_op", f"{method}: async_op is not at index {a_idx}: {params}"


def _call_args(method):
    """Positional arguments for `method`: every tensor (or list of tensors) a different size, so the recorded
    bytes name the argument that was read. Returns (args, bytes of each argument)."""
    args, nbytes = [], []
    for i, name in enumerate(_params(method)):
        n = 4 * (i + 1) + 1  # distinct element counts: 5, 9, 13, ...
        if name in (
            "tensor_list",
            "input_list",
            "output_tensors",
            "input_tensors",
            "tensors",
            "output_tensor_list",
            "input_tensor_list",
        ):
            v = [torch.zeros(n), torch.zeros(n + 100)]
        elif name in ("tensor", "output", "input", "output_tensor", "input_tensor"):
            v = torch.zeros(n, dtype=torch.float64)
        elif name in ("src", "dst"):
            v = 0
        elif name == "op":
            v = SUM
        else:  # group, split sizes, async_op
            v = None
        args.append(v)
        nbytes.append(
            sum(t.numel() * t.element_size() for t in v)
            if isinstance(v, list)
            else v.numel() * v.element_size()
            if isinstance(v, torch.Tensor)
            else None
        )
    return args, nbytes


CASES = [
    (m, style, a)
    for m, spec in _METHODS.items()
    for style in ("positional", "keyword")
    for a in ((False,) if spec[2] is None else (False, True))
]


@pytest.mark.parametrize(
    "method,style,async_op", CASES, ids=[f"{m}-{s}-{'async' if a else 'sync'}" for m, s, a in CASES]
)
def test_every_wrapped_method_records_bytes_and_async_flag(method, style, async_op):
    backend = FakeBackend()
    rec = CollectiveRecorder(torch.device("cpu"))
    assert method in rec.install(backend)
    rec.begin(3, "forward", time.perf_counter())
    op, (b_idx, _), async_spec = _METHODS[method]
    args, nbytes = _call_args(method)
    names = _params(method)
    if async_spec is not None:
        args[async_spec[0]] = async_op
    if style == "positional":
        out = getattr(backend, method)(*args)
    else:
        out = getattr(backend, method)(**dict(zip(names, args)))
    assert backend.calls == [method]  # the real method ran, once
    if async_op:
        assert isinstance(out, _TimedWork) and out.is_completed() is False  # forwarded to the real Work
        assert out.wait() is True
    else:
        assert out is None
    (r,) = rec.collect(wait_s=1.0)
    assert (r["op"], r["method"], r["step"], r["phase"]) == (op, method, 3, "forward")
    assert r["nbytes"] == nbytes[b_idx]
    assert r["async_op"] is async_op
    assert r["error"] is None and 0 <= r["t_start"] <= r["t_end"]
    (b,) = rec.collect_blocked()
    assert b["how"] == ("wait" if async_op else "blocking_call")
    assert (b["op"], b["method"], b["seq"], b["step"]) == (op, method, r["seq"], 3)
    assert 0 <= b["t_start"] <= b["t_end"]


def test_async_op_given_positionally_false_is_not_async():
    """A positional async_op=False must not be read as True from some other argument (e.g. a wrong index
    landing on a truthy tensor list), and must not be wrapped in a timed Work."""
    backend = FakeBackend()
    rec = CollectiveRecorder(torch.device("cpu"))
    rec.install(backend)
    rec.begin(0, "backward", time.perf_counter())
    out = backend.all_to_all_single(torch.zeros(4), torch.zeros(8), [4], [4], None, True)
    assert isinstance(out, _TimedWork)
    out.wait()
    backend.all_to_all_single(torch.zeros(4), torch.zeros(8), [4], [4], None, False)
    recs = rec.collect(wait_s=1.0)
    assert [r["async_op"] for r in recs] == [True, False]
    assert [r["nbytes"] for r in recs] == [32, 32]  # the input tensor, not the output


def test_wait_is_timed_as_blocked_and_completion_sets_the_end():
    backend = FakeBackend(delay_s=0.05)
    rec = CollectiveRecorder(torch.device("cpu"))
    rec.install(backend)
    rec.begin(1, "forward", time.perf_counter())
    work = backend.all_gather_into_tensor(torch.zeros(8), torch.zeros(4), None, True)
    assert rec.collect_blocked() == []  # issuing an async op blocks nothing
    time.sleep(0.03)  # "compute" while the collective is in flight: not blocked
    work.wait()
    backend.reduce_scatter_tensor(torch.zeros(4), torch.zeros(8), async_op=False)  # blocks ~0.05 s
    recs, blocked = rec.collect(wait_s=1.0), rec.collect_blocked()
    assert [b["how"] for b in blocked] == ["wait", "blocking_call"]
    w, bc = blocked
    assert 0.045 <= w["t_end"] - w["t_start"] < 0.5
    assert w["t_start"] >= recs[0]["t_start"] + 0.025  # the wait began after the compute
    assert recs[0]["t_end"] >= w["t_end"] - 1e-3  # the completion callback ran at the end of the wait
    assert (bc["t_start"], bc["t_end"]) == (recs[1]["t_start"], recs[1]["t_end"])
    assert blocked_seconds(blocked) == pytest.approx((w["t_end"] - w["t_start"]) + (bc["t_end"] - bc["t_start"]))
    assert blocked_seconds(blocked, "backward") == 0.0


def test_collective_that_raises_is_recorded_with_its_error():
    backend = FakeBackend(raise_in="reduce_scatter_tensor")
    rec = CollectiveRecorder(torch.device("cpu"))
    rec.install(backend)
    rec.begin(2, "backward", time.perf_counter())
    with pytest.raises(RuntimeError, match="failed in the fake backend"):
        backend.reduce_scatter_tensor(torch.zeros(4), torch.zeros(8), SUM, None, False)
    with pytest.raises(RuntimeError, match="failed in the fake backend"):
        backend.reduce_scatter_tensor(torch.zeros(4), torch.zeros(8), async_op=True)
    recs = rec.collect(wait_s=0.01)  # must not hang on a collective that never completed
    assert len(recs) == 2
    for r in recs:
        assert "failed in the fake backend" in r["error"] and r["t_end"] is None and r["nbytes"] == 32
    (b,) = rec.collect_blocked()  # the blocking call blocked until it raised; the async one never waited
    assert b["how"] == "blocking_call" and "failed" in b["error"] and b["t_end"] >= b["t_start"]


def test_wait_that_raises_is_recorded_and_reraised():
    backend = FakeBackend(wait_error=RuntimeError("NCCL watchdog timeout"))
    rec = CollectiveRecorder(torch.device("cpu"))
    rec.install(backend)
    rec.begin(0, "forward", time.perf_counter())
    work = backend.all_gather_into_tensor(torch.zeros(8), torch.zeros(4), async_op=True)
    with pytest.raises(RuntimeError, match="watchdog"):
        work.wait()
    (b,) = rec.collect_blocked()
    assert b["how"] == "wait" and "watchdog" in b["error"]
    (r,) = rec.collect(wait_s=0.01)
    assert r["t_end"] is None  # never completed


def test_install_wraps_each_method_once():
    backend = FakeBackend()
    rec = CollectiveRecorder(torch.device("cpu"))
    assert sorted(rec.install(backend)) == sorted(_METHODS)
    again = CollectiveRecorder(torch.device("cpu"))
    assert again.install(backend) == []  # already wrapped: a second recorder does not double-count
    rec.begin(0, "forward", time.perf_counter())
    backend.all_reduce(torch.zeros(2))
    assert len(rec.collect()) == 1 and again.collect() == []


def test_caller_skips_the_comm_layers_and_the_recorders_own_frames():
    """A collective issued from inside another wrapped one (via a deepspeed/comm frame) is attributed to the
    code that asked for the outer one: neither the comm layer nor the recorder's wrapper (comm.py) is named."""
    ns = {}
    src = (
        "def all_gather_coalesced(self, output_tensors, input_tensors, group=None, async_op=False):\n"
        "    for o, i in zip(output_tensors, input_tensors):\n"
        "        self.all_gather_into_tensor(o, i, group, async_op)\n"
    )
    exec(compile(src, os.path.join("site-packages", "deepspeed", "comm", "fake.py"), "exec"), ns)
    backend = type("NestedBackend", (FakeBackend,), {"all_gather_coalesced": ns["all_gather_coalesced"]})()
    rec = CollectiveRecorder(torch.device("cpu"))
    rec.install(backend)
    rec.begin(0, "forward", time.perf_counter())
    backend.all_gather_coalesced([torch.zeros(8)], [torch.zeros(4)])
    recs = rec.collect(wait_s=1.0)
    assert [r["method"] for r in recs] == ["all_gather_coalesced", "all_gather_into_tensor"]
    for r in recs:
        assert r["fn"].endswith(":test_caller_skips_the_comm_layers_and_the_recorders_own_frames"), r["fn"]


def test_blocked_seconds_is_a_union():
    bl = [
        {"t_start": 0.0, "t_end": 1.0, "phase": "forward"},
        {"t_start": 0.5, "t_end": 1.5, "phase": "forward"},
        {"t_start": 2.0, "t_end": 2.5, "phase": "backward"},
        {"t_start": 3.0, "t_end": None, "phase": "backward"},
    ]
    assert blocked_seconds(bl) == pytest.approx(2.0)
    assert blocked_seconds(bl, "forward") == pytest.approx(1.5)


def _coll(rows):
    return pd.DataFrame(rows, columns=["seq", "t_start", "t_end"])


def test_replay_with_measured_durations_reproduces_the_measurement():
    # seq 0: async all-gather, hidden by compute then waited on briefly; seq 1: blocking reduce-scatter
    c = _coll([(0, 0.0, 1.0), (1, 2.0, 2.5)])
    b = pd.DataFrame({"t_start": [0.8, 2.0], "t_end": [1.0, 2.5], "seq": [0, 1]})
    r = replay_zero3(c, b, c["t_end"] - c["t_start"])
    assert r["measured_exposed"] == pytest.approx(0.7) and r["predicted_exposed"] == pytest.approx(0.7)
    assert r["measured_t_comm"] == pytest.approx(1.5) and r["predicted_t_comm"] == pytest.approx(1.5)
    assert r["shift"] == pytest.approx(0.0)


def test_replay_hides_what_compute_covers_and_exposes_the_rest():
    c = _coll([(0, 0.0, 1.0), (1, 2.0, 2.5)])
    b = pd.DataFrame({"t_start": [0.8, 2.0], "t_end": [1.0, 2.5], "seq": [0, 1]})
    faster = replay_zero3(c, b, [0.5, 0.5])  # the gather now ends before its wait: nothing exposed there
    assert faster["predicted_exposed"] == pytest.approx(0.5)
    slower = replay_zero3(c, b, [1.0, 1.5])  # the blocking call takes 1 s longer: all of it exposed
    assert slower["predicted_exposed"] == pytest.approx(0.2 + 1.5)
    # in flight: [0, 1] and the blocking call shifted by nothing before it: [2, 3.5]
    assert slower["predicted_t_comm"] == pytest.approx(2.5)


def test_replay_queues_collectives_in_issue_order():
    # two async collectives issued together, both waited at 0.1: the second starts after the first ends
    c = _coll([(0, 0.0, 0.6), (1, 0.0, 1.2)])
    b = pd.DataFrame({"t_start": [0.1, 0.6], "t_end": [0.6, 1.2], "seq": [0, 1]})
    r = replay_zero3(c, b, [0.6, 0.6])
    assert r["predicted_exposed"] == pytest.approx(1.1)  # blocked from 0.1 until 1.2
    assert r["predicted_t_comm"] == pytest.approx(1.2)  # a union, not 0.6 + 0.6 + anything


def test_replay_shifts_later_collectives_by_earlier_extra_blocking():
    c = _coll([(0, 0.0, 0.5), (1, 1.0, 1.5)])  # both blocking calls, 0.5 s of compute between them
    b = pd.DataFrame({"t_start": [0.0, 1.0], "t_end": [0.5, 1.5], "seq": [0, 1]})
    r = replay_zero3(c, b, [1.0, 1.0])
    assert r["predicted_exposed"] == pytest.approx(2.0) and r["shift"] == pytest.approx(1.0)
    assert r["predicted_t_comm"] == pytest.approx(2.0)  # [0, 1] and [1.5, 2.5]


def _write_run(tmp_path, with_blocked=True):
    import json

    d = tmp_path / "z3"
    (d / "events").mkdir(parents=True)
    (d / "config.json").write_text(
        json.dumps(
            {"config": {"strategy": "zero3", "warmup": 1, "nproc": 2}, "resolved": {"world_size": 2, "backend": "gloo"}}
        )
    )
    for rank in (0, 1):
        ev = []
        for step in range(3):
            t_step = 1.0 + 0.1 * rank
            blocked = 0.2 if rank == 1 else 0.4  # the slow rank waits less
            st = {
                "kind": "step",
                "rank": rank,
                "step": step,
                "t_fwd": 0.4,
                "t_bwd": 0.5,
                "t_opt": t_step - 0.9,
                "t_step": t_step,
                "loss": 0.7,
            }
            if with_blocked:
                st["t_blocked"] = blocked
            ev.append(st)
            ev.append(
                {
                    "kind": "collective",
                    "rank": rank,
                    "step": step,
                    "op": "all_gather",
                    "nbytes": 8,
                    "phase": "forward",
                    "seq": 2 * step,
                    "t_start": 0.0,
                    "t_end": 0.3,
                }
            )
            ev.append(
                {
                    "kind": "collective",
                    "rank": rank,
                    "step": step,
                    "op": "reduce_scatter",
                    "nbytes": 8,
                    "phase": "backward",
                    "seq": 2 * step + 1,
                    "t_start": 0.5,
                    "t_end": 0.6 + 0.1 * rank,
                }
            )
            if with_blocked:
                ev.append(
                    {
                        "kind": "blocked",
                        "rank": rank,
                        "step": step,
                        "phase": "forward",
                        "op": "all_gather",
                        "how": "wait",
                        "seq": 2 * step,
                        "t_start": 0.3 - blocked / 2,
                        "t_end": 0.3,
                    }
                )
                ev.append(
                    {
                        "kind": "blocked",
                        "rank": rank,
                        "step": step,
                        "phase": "backward",
                        "op": "reduce_scatter",
                        "how": "blocking_call",
                        "seq": 2 * step + 1,
                        "t_start": 0.6 + 0.1 * rank - blocked / 2,
                        "t_end": 0.6 + 0.1 * rank,
                    }
                )
        (d / "events" / f"rank{rank}.jsonl").write_text("\n".join(json.dumps(e) for e in ev) + "\n")
    from dtlab.results.run import load_run

    return load_run(str(d))


def test_zero3_summary_uses_measured_blocked_time(tmp_path):
    run = _write_run(tmp_path)
    assert run.measures_blocked and len(run.blocked) == 12
    s = run.summary().set_index("quantity")
    assert s.loc["T_step", "value"] == pytest.approx(1.1)
    assert s.loc["exposed", "value"] == pytest.approx(0.2)  # the slowest rank's blocked time
    assert s.loc["T_comp", "value"] == pytest.approx(0.9)  # T_step - blocked, not T_step - T_comm
    assert s.loc["T_comm", "value"] == pytest.approx(0.5)  # union on the rank where longest: 0.3 + 0.2
    assert s.loc["overlap", "value"] == pytest.approx(1 - 0.2 / 0.5)
    assert s.loc["T_comp", "how"].startswith("measured: T_step - time blocked on collectives")
    assert s.loc["exposed", "how"].startswith("measured")
    ps = run.per_step()
    assert list(ps["t_blocked"]) == [0.2, 0.2] and np.allclose(ps["t_comp_est"], 0.9)


def test_zero3_summary_without_blocked_times_is_labelled_as_assumed(tmp_path):
    run = _write_run(tmp_path, with_blocked=False)
    assert not run.measures_blocked
    s = run.summary().set_index("quantity")
    assert "assumes no overlap" in s.loc["T_comp", "how"] and s.loc["overlap", "how"] == "not measured"


def test_predict_zero3_is_consistent_with_the_summary(tmp_path):
    from dtlab.model.prediction import predict

    class Profile:  # prices every collective at what was measured for it on rank 1
        fits = {"all_gather": None, "reduce_scatter": None}

        def predict(self, op, nbytes, p):
            return np.full(len(nbytes), 0.3 if op == "all_gather" else 0.2)

    run = _write_run(tmp_path)
    pred = predict(run, Profile())
    assert len(pred) == 2 and set(pred["rank"]) == {1}
    assert np.allclose(pred["measured_exposed"], 0.2) and np.allclose(pred["measured_t_comp"], 0.9)
    assert np.allclose(pred["predicted_exposed"], 0.2)  # the waits end when the priced collectives end
    assert np.allclose(pred["predicted_t_step"], pred["measured_t_step"])
    assert np.allclose(pred["measured_t_comm"], 0.5) and np.allclose(pred["predicted_t_comm"], 0.5)
    assert (pred["exposed_from"] == "measured: recorded blocked intervals").all()
