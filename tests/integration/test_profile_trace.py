"""profile=True: a real 2-rank gloo DDP run records one profiler trace per rank, and dtlab.load_trace on it agrees
with the run's own records: every bucket's all-reduce with its exact bytes, T_comm within the run's noise."""

import subprocess
import sys

import dtlab
from dtlab.intervals import union_length


def test_profiler_trace_of_a_run_agrees_with_its_records(tmp_path):
    cfg = dtlab.tiny(out=str(tmp_path / "run"), steps=4, baseline_steps=2, bucket_mb=0.05, profile=True)
    run = dtlab.run(cfg, progress=False)
    trace = dtlab.load_trace(run.path)
    assert sorted(r.rank for r in trace.ranks) == [0, 1]
    c = trace.collectives
    ar = c[c["op"] == "all_reduce"]
    assert set(ar["source"]) == {"cpu op (gloo)"}  # gloo's collectives are CPU spans
    traced = sorted(set(trace.steps.loc[~trace.steps["baseline"], "step"]))
    assert traced == list(range(cfg.warmup, cfg.steps))  # every measured step, in the run's numbering
    t_run, t_trace = [], []
    for step in traced:
        for rank in (0, 1):
            b = run.buckets[(run.buckets["rank"] == rank) & (run.buckets["step"] == step)]
            a = ar[(ar["rank"] == rank) & (ar["step"] == step)]
            assert sorted(a["nbytes"]) == sorted(b["nbytes"])  # bucket count and bytes, exactly
            t_run.append(union_length(zip(b["t_start"], b["t_end"])))
            t_trace.append(union_length(zip(a["t_start"], a["t_end"])))
    baseline = set(trace.steps.loc[trace.steps["baseline"], "step"])
    assert baseline and ar[ar["step"].isin(baseline)].empty  # the no-op hook's steps all-reduce nothing
    row = run.summary().set_index("quantity").loc["T_comm"]
    noise = row["hi"] - row["lo"]
    med = sorted(t_trace)[len(t_trace) // 2]
    assert row["lo"] - noise <= med <= row["hi"] + noise, (med, row.to_dict(), t_run, t_trace)

    cp = subprocess.run(
        [sys.executable, "-m", "dtlab", "trace", run.path], capture_output=True, text=True, timeout=120, check=False
    )
    assert cp.returncode == 0, cp.stderr
    assert "breakdown per rank and ProfilerStep" in cp.stdout and "cpu op (gloo)" in cp.stdout
    assert (tmp_path / "run" / "profiler" / "trace-report.html").stat().st_size > 10_000
