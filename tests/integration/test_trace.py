"""Chrome / Perfetto trace export: valid Trace Event JSON whose slices match the run's DataFrames."""

import json
import subprocess
import sys
from collections import Counter

import pytest


def check_trace(run, trace):
    """What any exported run must satisfy; returns the complete ('X') events."""
    trace = json.loads(json.dumps(trace))  # plain JSON, nothing numpy-typed left in it
    ev = trace["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all((e["pid"], e["tid"]) in names for e in xs)  # every slice sits on a named track
    for rank in range(run.nproc):
        mine = [e for e in xs if e["pid"] == rank]
        steps = [e for e in mine if e["cat"] in ("step", "baseline")]
        assert len(steps) == (run.steps["rank"] == rank).sum() + (run.baseline_steps["rank"] == rank).sum()
        assert sum(e["cat"] == "baseline" for e in steps) == (run.baseline_steps["rank"] == rank).sum()
        phases = Counter(e["name"] for e in mine if e["cat"] == "compute")
        assert phases == {p: len(steps) for p in ("forward", "backward", "optimizer")}
        comm = run.buckets if not run.buckets.empty else run.collectives
        stepped = set(run.steps.loc[run.steps["rank"] == rank, "step"])
        comm = comm[(comm["rank"] == rank) & comm["step"].isin(stepped)].dropna(subset=["t_start", "t_end"])
        slices = [e for e in mine if e["cat"] == "communication"]
        assert len(slices) == len(comm) and sum(e["args"]["nbytes"] for e in slices) == comm["nbytes"].sum()
        for tid in {e["tid"] for e in mine}:  # slices on one track must nest: here they never overlap
            lane = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["tid"] == tid and e["cat"] != "compute")
            assert all(a[1] <= b[0] + 1e-3 for a, b in zip(lane, lane[1:]))
        # each step's compute phases tile its step slice exactly
        for s in steps:
            kids = sorted(
                (
                    e
                    for e in mine
                    if e["cat"] == "compute"
                    and e["args"]["step"] == s["args"]["step"]
                    and e["args"]["baseline"] == (s["cat"] == "baseline")
                ),
                key=lambda e: e["ts"],
            )
            assert kids[0]["ts"] == pytest.approx(s["ts"], abs=1e-2)
            assert sum(k["dur"] for k in kids) == pytest.approx(s["dur"], abs=1e-2)
    return xs


def test_ddp_trace_matches_the_run(tiny_run, tmp_path):
    xs = check_trace(tiny_run, tiny_run.to_chrome_trace())
    comm = [e for e in xs if e["cat"] == "communication"]
    assert {e["name"].split(" bucket ")[0] for e in comm} == {"all_reduce"}
    # a bucket's all-reduce lies inside its own step
    steps = {(e["pid"], e["args"]["step"]): e for e in xs if e["cat"] == "step"}
    for e in comm:
        s = steps[(e["pid"], e["args"]["step"])]
        assert s["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1

    out = tmp_path / "t.json"
    cp = subprocess.run(
        [sys.executable, "-m", "dtlab", "trace", tiny_run.path, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cp.returncode == 0 and "ui.perfetto.dev" in cp.stdout
    assert json.loads(out.read_text()) == json.loads(json.dumps(tiny_run.to_chrome_trace()))


def test_trace_cli_refuses_a_non_run(tmp_path):
    cp = subprocess.run(
        [sys.executable, "-m", "dtlab", "trace", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert cp.returncode == 2 and "not a dtlab run directory" in cp.stderr
