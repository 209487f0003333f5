"""Real 2-process DeepSpeed ZeRO-3 run of the tiny model on CPU/gloo: every byte accounted for, memory
against DDP, and ZeRO-specific bad input refused before launch."""

import ast
import inspect
import os

import pytest

import dtlab
from dtlab.results.events import read_events

PLAIN_OPS = {"all_gather", "reduce_scatter", "all_reduce", "broadcast"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(ZeRO-3 run, DDP run) of the tiny model, launched side by side to halve the wall time (their
    timings are then meaningless, their bytes are not)."""
    out = tmp_path_factory.mktemp("zero3")
    z = dtlab.launch(dtlab.tiny(strategy="zero3", out=str(out / "zero3"), baseline_steps=0))
    d = dtlab.launch(dtlab.tiny(out=str(out / "ddp"), steps=2, baseline_steps=0))
    return z.wait(progress=False), d.wait(progress=False)


@pytest.fixture(scope="module")
def z3(runs):
    return runs[0]


def _per_step(run, op, phase=None):
    c = run.collectives
    c = c[(c["op"] == op) & (c["step"] >= 0)]
    if phase is not None:
        c = c[c["phase"] == phase]
    return c.groupby(["rank", "step"])["nbytes"].sum()


def _steps(run):
    return [(r, s) for r in range(run.nproc) for s in range(run.config.steps)]


def test_reduce_scatter_carries_every_padded_gradient_byte_each_step(z3):
    res = z3.resolved
    assert res["grad_bytes"] == res["num_parameters"] * 4 == res["grad_bytes_unpadded"]
    assert res["padded_grad_bytes"] == res["grad_bytes"] + res["padding_bytes"]
    assert res["expected_reduce_scatter_bytes_per_step"] == res["padded_grad_bytes"]
    rs = _per_step(z3, "reduce_scatter", "backward")
    assert sorted(rs.index) == _steps(z3)
    assert (rs == res["padded_grad_bytes"]).all()


def test_all_gather_bytes_match_the_engine(z3):
    res, st = z3.resolved, z3.steps.set_index(["rank", "step"])
    for phase, col in (("forward", "fwd"), ("backward", "bwd"), ("optimizer", "opt")):
        got = _per_step(z3, "all_gather", phase).reindex(_steps(z3), fill_value=0)
        # per step: what the engine had not materialised when the phase began (or, for the optimizer,
        # the persistent parameters it re-gathers after the update)
        assert (got == st[f"allgather_expected_{col}_bytes"]).all(), phase
        steady = got[got.index.get_level_values("step") >= 1]  # step 0 records the trace
        assert (steady == res[f"expected_allgather_bytes_{phase}"]).all(), phase
    # step 0 records the parameter trace: everything is gathered in forward and again in backward
    total = res["padded_grad_bytes"]
    step0 = st.xs(0, level="step")
    assert (step0["allgather_expected_fwd_bytes"] == total).all() and (
        step0["allgather_expected_bwd_bytes"] == total
    ).all()
    # steady: each parameter exactly once per step, non-persistent in forward, persistent in the optimizer
    assert res["expected_allgather_bytes_forward"] + res["expected_allgather_bytes_optimizer"] == total
    assert res["persistent_params"] > 0 and res["nonpersistent_params"] > 0
    # DeepSpeed's default stage3_max_reuse_distance keeps forward's parameters for backward
    assert res["zero_effective"]["stage3_max_reuse_distance"] == 10**9
    assert res["expected_allgather_bytes_backward"] == 0


def test_collectives_are_plain_phased_and_ordered(z3):
    c = z3.collectives
    assert set(c["op"]) <= PLAIN_OPS
    assert set(c["phase"]) == {"init", "forward", "backward", "optimizer"}
    assert set(c.loc[c["phase"] == "init", "step"]) == {-1}
    opt = c[c["phase"] == "optimizer"]
    assert set(opt["op"]) == {"all_reduce", "all_gather"}  # gradient norm, persistent re-gather
    assert c[["t_start", "t_end"]].notna().all().all()
    assert (c["t_start"] <= c["t_end"]).all()
    assert c["fn"].str.startswith("deepspeed/").all()
    st = z3.steps.set_index(["rank", "step"])["t_step"]
    ran = c[c["step"] >= 0]
    assert all(row.t_end <= st[(row.rank, row.step)] for row in ran.itertuples())
    for rank in (0, 1):  # every rank records the same traffic
        a = ran[ran["rank"] == 0].groupby(["step", "phase", "op"])["nbytes"].sum()
        assert a.equals(ran[ran["rank"] == rank].groupby(["step", "phase", "op"])["nbytes"].sum())


def test_steps_and_resolved_facts(z3):
    s, res = z3.steps, z3.resolved
    assert z3.status["state"] == "finished" and len(s) == 2 * z3.config.steps
    assert (abs(s["t_fwd"] + s["t_bwd"] + s["t_opt"] - s["t_step"]) < 1e-9).all()
    assert (s["t_step"] > 0).all() and s["loss"].notna().all()
    assert res["backend"] == "gloo" and res["ds_accelerator"] == "cpu"
    assert res["ds_config"]["zero_optimization"]["stage"] == 3
    assert "completion callback" in res["collective_recording"]
    assert res["versions"]["deepspeed"]


def _last_memory_event(run, rank):
    ev = read_events(os.path.join(run.path, "events", f"rank{rank}.jsonl"))
    return [e for e in ev if e["kind"] == "memory"][-1]


def test_zero3_holds_about_half_of_ddp_per_rank(runs):
    z3, ddp = runs
    res, world = z3.resolved, z3.nproc
    zm, dm = z3.memory.set_index("rank"), ddp.memory.set_index("rank")
    partition = res["padded_grad_bytes"] // world
    for r in range(world):
        z, d, extra = zm.loc[r], dm.loc[r], _last_memory_event(z3, r)
        assert d["params_bytes"] == res["grad_bytes"]
        # a 1/world slice of every parameter, plus the persistent ones held whole
        assert z["params_bytes"] == partition + res["persistent_bytes"]
        assert abs(z["params_bytes"] - d["params_bytes"] / 2) <= res["persistent_bytes"] + res["padding_bytes"]
        assert z["grads_bytes"] == partition
        # AdamW's two moments: half of DDP's (DDP also holds one 4-byte step per parameter tensor)
        n_tensors = res["persistent_params"] + res["nonpersistent_params"]
        assert abs(extra["adam_state_bytes"] - d["opt_bytes"] / 2) <= 4 * n_tensors
        # opt_bytes also counts the fp32 master partition: a separate copy in fp32 on DeepSpeed 0.19.8
        assert z["opt_bytes"] == extra["fp32_master_bytes"] + extra["adam_state_bytes"]
        assert extra["fp32_master_bytes"] in (0, partition)
        assert z["peak_kind"] == "peak_rss" and z["peak_bytes"] > z["params_bytes"]
        # the gradient bucket is sized by the (auto) knob, not DeepSpeed's 5e8-element (2 GB) default
        assert extra["ipg_bucket_bytes"] == res["zero_effective"]["reduce_bucket_size"] * 4


def test_auto_zero_knobs_are_sized_from_the_model(z3):
    res, hidden = z3.resolved, 32  # the tiny model's dim
    auto = res["zero_auto"]
    assert auto["hidden_size"] == hidden and "h^2" in auto["rule"]
    assert sorted(auto["auto_fields"]) == [
        "reduce_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_prefetch_bucket_size",
    ]
    want = {
        "reduce_bucket_size": hidden**2,
        "stage3_prefetch_bucket_size": int(0.9 * hidden**2),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    assert auto["resolved"] == want
    for k, v in want.items():  # what DeepSpeed's engine says it uses, not just what we asked for
        assert res["zero_effective"][k] == v and res["ds_config"]["zero_optimization"][k] == v
    # the reduce-scatters come in reduce_bucket_size buckets: more calls than one, same bytes (checked above)
    rs = z3.collectives[(z3.collectives["op"] == "reduce_scatter") & (z3.collectives["step"] >= 0)]
    assert rs.groupby(["rank", "step"]).size().min() > 1


def test_blocked_time_is_measured_and_bounded(z3):
    st, b, c = z3.steps, z3.blocked, z3.collectives
    assert {"t_blocked", "t_blocked_fwd", "t_blocked_bwd", "t_blocked_opt"} <= set(st.columns)
    assert ((st["t_blocked"] >= 0) & (st["t_blocked"] <= st["t_step"])).all()
    # phases follow each other, so the per-phase unions add up to the step's union
    parts = st["t_blocked_fwd"] + st["t_blocked_bwd"] + st["t_blocked_opt"]
    assert (abs(parts - st["t_blocked"]) < 1e-9).all()
    assert (st["t_blocked"] > 0).all()  # gloo on CPU: the backward reduce-scatters block the training thread
    steps = b[b["step"] >= 0]
    assert set(steps["how"]) <= {"wait", "blocking_call"}  # stream_sync is GPU-only
    assert (steps["t_start"] <= steps["t_end"]).all()
    tstep = st.set_index(["rank", "step"])["t_step"]
    assert all(0 <= r.t_start and r.t_end <= tstep[(r.rank, r.step)] + 1e-6 for r in steps.itertuples())
    # every blocked interval names a recorded collective of its rank, and each blocking collective blocked
    for rank in range(z3.nproc):
        seqs = set(c.loc[c["rank"] == rank, "seq"])
        assert set(b.loc[b["rank"] == rank, "seq"]) <= seqs
        sync = c[(c["rank"] == rank) & (~c["async_op"].astype(bool))]
        calls = b[(b["rank"] == rank) & (b["how"] == "blocking_call")]
        assert sorted(calls["seq"]) == sorted(sync["seq"])
    s = z3.summary().set_index("quantity")
    assert s.loc["T_comp", "how"].startswith("measured: T_step - time blocked")
    ps = z3.per_step()
    assert (ps["t_comp_est"] == ps["t_step"] - ps["t_blocked"]).all()
    assert s.loc["exposed", "value"] <= s.loc["T_step", "value"]


def test_zero3_trace_matches_the_run(z3):
    from integration.test_trace import check_trace

    xs = check_trace(z3, z3.to_chrome_trace())
    ops = {e["args"]["op"] for e in xs if e["cat"] == "communication"}
    assert {"all_gather", "reduce_scatter"} <= ops


# DeepSpeed's own source, read where the recorder wraps it: importing deepspeed costs a test process about 2
# CPU-seconds, so this check lives here, not in the fast tier
def _group_index(method: str) -> int:
    """Position of `group` in DeepSpeed's TorchBackend method (after self), read from its source."""
    import importlib

    dst = importlib.import_module("deepspeed.comm.torch")  # `import deepspeed.comm.torch` binds torch itself
    tree = ast.parse(inspect.getsource(dst))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "TorchBackend":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == method:
                    return [a.arg for a in fn.args.args][1:].index("group")
    raise LookupError(method)


def test_group_sits_just_before_async_op_in_every_wrapped_method():
    """The recorder reads a collective's group at async_op's index - 1 (one owned end stream per group)."""
    pytest.importorskip("deepspeed")
    from dtlab.rank.strategies.zero3.comm import _METHODS

    for method, (_, _, async_spec) in _METHODS.items():
        if async_spec is not None:
            assert _group_index(method) == async_spec[0] - 1, method
