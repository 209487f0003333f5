"""Real 2-process gloo DDP runs of the tiny model: bytes conserved, both ranks, events in order, a timeout.
Fault drills (a rank killed, raising, frozen; an interrupt) are in test_faults.py."""

import json
import os

import pytest

import dtlab
from dtlab.config.baseline import run_order


def test_every_gradient_byte_is_all_reduced_once_per_step(tiny_run):
    run = tiny_run
    grad_bytes = run.resolved["grad_bytes"]
    assert grad_bytes == run.resolved["num_parameters"] * 4  # fp32
    per = run.buckets.groupby(["rank", "step"])["nbytes"].sum()
    assert set(per.index.get_level_values("rank")) == {0, 1}
    assert set(per.index.get_level_values("step")) == set(range(run.config.steps))
    assert (per == grad_bytes).all()
    # DDP reduces everything in one bucket on the first iteration, then rebuilds buckets in ready order
    counts = run.buckets[run.buckets["step"] >= 1].groupby(["rank", "step"]).size()
    assert counts.min() >= 2


def test_bucket_events_are_ordered(tiny_run):
    b = tiny_run.buckets
    assert (b["t_ready"] <= b["t_start"]).all()
    assert (b["t_start"] <= b["t_end"]).all()
    # every all-reduce finishes within its step
    st = tiny_run.steps.set_index(["rank", "step"])["t_step"]
    assert all(row.t_end <= st[(row.rank, row.step)] for row in b.itertuples())


def test_steps_baseline_and_metadata(tiny_run):
    run = tiny_run
    assert run.status["state"] == "finished"
    assert len(run.steps) == 2 * run.config.steps
    assert len(run.baseline_steps) == 2 * run.config.measurement.baseline_steps
    for col in ("t_fwd", "t_bwd", "t_opt", "t_step"):
        assert (run.steps[col] > 0).all()
    # t_step is checked against a clock it was not computed from: the wall time between the step events a rank
    # wrote. A step cannot last longer than the time from the previous step's end to its own end (this fails
    # for a cumulative clock, milliseconds instead of seconds, or marks taken before the step began).
    for r in (0, 1):
        ev = [json.loads(line) for line in open(os.path.join(run.path, "events", f"rank{r}.jsonl"))]
        st = [e for e in ev if e["kind"] in ("step", "baseline_step")]
        # baseline steps interleaved, each right after the training step it is paired with (dtlab.config.baseline)
        order = run_order(run.config.steps, run.config.warmup, run.config.measurement.baseline_steps)
        assert [(e["step"], e.get("paired_step")) for e in st] == order
        assert [e["step"] for e in st if e["kind"] == "baseline_step"] == [s for s, p in order if p is not None]
        for prev, cur in zip(st, st[1:]):
            # a baseline step's t_opt is its paired step's optimizer time: its own clock ran forward and backward
            own = cur["t_fwd"] + cur["t_bwd"] if cur["kind"] == "baseline_step" else cur["t_step"]
            assert 0 < own <= cur["time"] - prev["time"] + 1e-3
    assert run.resolved["backend"] == "gloo" and run.resolved["world_size"] == 2
    assert "random init" in run.resolved["model_source"]
    assert "not SST-2" in run.resolved["data_source"]
    assert run.resolved["versions"]["torch"]
    assert set(run.ddp_logging) == {0, 1}
    s = run.summary().set_index("quantity")
    assert s.loc["T_comp", "how"].startswith("measured")
    assert s.loc["T_step", "value"] > 0 and s.loc["T_comm", "value"] > 0


def test_memory_is_from_tensors(tiny_run):
    m = tiny_run.memory.set_index("rank")
    n = tiny_run.resolved["num_parameters"]
    assert (m["params_bytes"] == 4 * n).all() and (m["grads_bytes"] == 4 * n).all()
    # AdamW: exp_avg and exp_avg_sq (4 B per parameter each) plus one fp32 `step` scalar per parameter tensor
    n_tensors = len(tiny_run.resolved["param_nbytes"])
    assert (m["opt_bytes"] == 2 * 4 * n + 4 * n_tensors).all()
    assert (m["peak_kind"] == "peak_rss").all() and (m["peak_bytes"] > m["params_bytes"]).all()


def test_show_prints_the_breakdown(tiny_run, capsys):
    from dtlab.cli.main import main

    assert main(["show", tiny_run.path]) == 0
    out = capsys.readouterr().out
    assert "T_comm" in out and "ms" in out and "exposed" in out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_stop_and_timeout_leave_no_process(tmp_path):
    handle = dtlab.launch(dtlab.tiny(out=str(tmp_path / "slow"), steps=100000, timeout_s=8.0))
    with pytest.raises(dtlab.RunFailed, match="timeout") as info:
        handle.wait(progress=False)
    assert handle.status() == "timeout" and info.value.state == "timeout"
    # every live rank's stack was dumped into its log before the stop, and the error says where each one was
    for rank in (0, 1):
        assert "(most recent call first)" in (tmp_path / "slow" / "logs" / f"rank{rank}.log").read_text()
    assert str(info.value).count(", at ") == 2
    assert "where the ranks were" in json.loads((tmp_path / "slow" / "status.json").read_text())["error"]
    assert handle.proc.poll() is not None
    pids = handle.rank_pids()
    assert len(pids) == 2 and not [p for p in pids if _alive(p)]  # gone when wait() raised: no sleep needed
