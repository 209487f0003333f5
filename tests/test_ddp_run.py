"""Real 2-process gloo DDP runs of the tiny model: bytes conserved, both ranks, events in order, faults."""

import os
import time

import pytest

import dtlab
from dtlab.results import load_run


def test_every_gradient_byte_is_all_reduced_once_per_step(tiny_run):
    run = tiny_run
    grad_bytes = run.resolved["grad_bytes"]
    assert grad_bytes == run.resolved["num_parameters"] * 4  # fp32
    per = run.buckets.groupby(["rank", "step"])["nbytes"].sum()
    assert set(per.index.get_level_values("rank")) == {0, 1}
    assert set(per.index.get_level_values("step")) == set(range(run.config["steps"]))
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
    assert len(run.steps) == 2 * run.config["steps"] and len(run.baseline_steps) == 2 * run.config["baseline_steps"]
    for col in ("t_fwd", "t_bwd", "t_opt", "t_step"):
        assert (run.steps[col] > 0).all()
    assert (abs(run.steps["t_fwd"] + run.steps["t_bwd"] + run.steps["t_opt"] - run.steps["t_step"]) < 1e-9).all()
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
    assert (m["optim_bytes"] == 2 * 4 * n + 0).sum() >= 0  # AdamW: exp_avg + exp_avg_sq (+ step scalars)
    assert (m["optim_bytes"] >= 2 * 4 * n).all()
    assert (m["peak_kind"] == "peak_rss").all() and (m["peak_bytes"] > m["params_bytes"]).all()


def test_show_prints_the_breakdown(tiny_run, capsys):
    from dtlab.cli import main
    assert main(["show", tiny_run.path]) == 0
    out = capsys.readouterr().out
    assert "T_comm" in out and "ms" in out and "exposed" in out


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
        return f.read().split()[2] != "Z"


def test_rank_that_raises_gives_runfailed_and_partial_events(tmp_path, monkeypatch):
    monkeypatch.setenv("DTLAB_FAULT", "1:2")  # rank 1 raises at the start of step 2
    handle = dtlab.launch(dtlab.tiny(out=str(tmp_path / "fail"), steps=5, bucket_mb=0.05))
    with pytest.raises(dtlab.RunFailed) as info:
        handle.wait(progress=False)
    e = info.value
    assert e.rank == 1 and "injected fault" in e.error and "RuntimeError" in e.traceback_tail
    run = load_run(str(tmp_path / "fail"))
    assert run.status["state"] == "failed"
    assert set(run.steps[run.steps["rank"] == 1]["step"]) == {0, 1}  # what rank 1 did before it raised
    assert not run.buckets.empty
    time.sleep(0.5)
    assert not [p for p in handle.rank_pids() if _alive(p)]
    assert handle.proc.poll() is not None


def test_stop_and_timeout_leave_no_process(tmp_path):
    handle = dtlab.launch(dtlab.tiny(out=str(tmp_path / "slow"), steps=400, timeout_s=8.0))
    with pytest.raises(dtlab.RunFailed, match="timeout"):
        handle.wait(progress=False)
    assert handle.status() == "timeout"
    time.sleep(0.5)
    assert handle.proc.poll() is not None
    assert not [p for p in handle.rank_pids() if _alive(p)]


def test_interrupt_stops_every_rank(tmp_path):
    """What a notebook's 'interrupt kernel' does: SIGINT to the process waiting in dtlab.run."""
    import json
    import signal
    import subprocess
    import sys

    out = tmp_path / "interrupted"
    code = ("import dtlab; dtlab.run(dtlab.tiny(out=%r, steps=10000, timeout_s=600), progress=False)" % str(out))
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    ev = out / "events" / "rank1.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (ev.exists() and '"kind": "step"' in ev.read_text()):
        time.sleep(0.2)  # wait until the ranks are training
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    pids = [json.loads(line)["pid"] for r in (0, 1)
            for line in (out / "events" / f"rank{r}.jsonl").read_text().splitlines() if '"start"' in line]
    assert len(pids) == 2
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)]
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"
    assert not load_run(str(out)).steps.empty  # what was recorded before the interrupt loads
