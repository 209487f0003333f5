"""Results math on hand-made run directories: definitions checked against numbers worked out by hand."""

import json

import numpy as np
import pytest

from dtlab.intervals import frame_union_length
from dtlab.results.run import load_run


def write_run(tmp_path, events_by_rank, config=None, torn_tail=False, state="finished"):
    """A run directory as the launcher and ranks leave it: config.json, status.json, one event file per rank
    (ending with `done` when the run finished)."""
    cfg = {"strategy": "ddp", "nproc": len(events_by_rank), "warmup": 1, "bucket_mb": 25}
    cfg.update(config or {})
    (tmp_path / "events").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"config": cfg, "resolved": {"world_size": len(events_by_rank)}}))
    (tmp_path / "status.json").write_text(json.dumps({"state": state}))
    for r, evs in events_by_rank.items():
        with open(tmp_path / "events" / f"rank{r}.jsonl", "w") as f:
            for e in evs + ([{"kind": "done", "rank": r}] if state == "finished" else []):
                f.write(json.dumps(e) + "\n")
            if torn_tail:
                f.write('{"kind": "step", "rank": 0, "st')  # a crash mid-line
    return str(tmp_path)


def step(rank, s, fwd, bwd, opt, kind="step"):
    return {
        "kind": kind,
        "rank": rank,
        "step": s,
        "t_fwd": fwd,
        "t_bwd": bwd,
        "t_opt": opt,
        "t_step": fwd + bwd + opt,
        "loss": 0.7,
    }


def bucket(rank, s, i, nbytes, ready, start, end):
    return {
        "kind": "bucket",
        "rank": rank,
        "step": s,
        "bucket": i,
        "nbytes": nbytes,
        "nparams": 1,
        "t_ready": ready,
        "t_start": start,
        "t_end": end,
    }


def test_union_length_counts_overlaps_once():
    import pandas as pd

    df = pd.DataFrame({"t_start": [0.0, 1.0, 1.5, 5.0], "t_end": [2.0, 3.0, 2.5, 6.0]})
    assert frame_union_length(df) == pytest.approx(3.0 + 1.0)


def test_summary_by_hand(tmp_path):
    # Two ranks, steps 0 (warm-up, ignored) .. 2. Rank 1 is the slower one.
    ev = {0: [], 1: []}
    for s in range(3):
        ev[0] += [step(0, s, 0.1, 0.5, 0.1), bucket(0, s, 0, 100, 0.3, 0.3, 0.5), bucket(0, s, 1, 50, 0.55, 0.55, 0.65)]
        ev[1] += [step(1, s, 0.1, 0.6, 0.1), bucket(1, s, 0, 100, 0.3, 0.3, 0.6), bucket(1, s, 1, 50, 0.6, 0.6, 0.7)]
    ev[0] += [step(0, 3, 0.1, 0.3, 0.1, kind="baseline_step"), step(0, 4, 0.1, 0.3, 0.1, kind="baseline_step")]
    ev[1] += [step(1, 3, 0.1, 0.4, 0.1, kind="baseline_step"), step(1, 4, 0.1, 0.5, 0.1, kind="baseline_step")]
    run = load_run(write_run(tmp_path, ev))
    assert len(run.steps) == 6 and len(run.buckets) == 12 and len(run.baseline_steps) == 4
    s = run.summary().set_index("quantity")["value"]
    assert s["T_step"] == pytest.approx(0.8)  # slowest rank: 0.1 + 0.6 + 0.1
    assert s["T_comm"] == pytest.approx(0.4)  # rank 1: [0.3,0.6] + [0.6,0.7]; rank 0: 0.2 + 0.1
    assert s["T_comp"] == pytest.approx(np.median([0.6, 0.7]))  # baseline: per-step max over ranks
    assert s["exposed"] == pytest.approx(0.8 - 0.65)
    assert s["overlap"] == pytest.approx(1 - 0.15 / 0.4)


def test_summary_without_baseline_estimates_comp(tmp_path):
    ev = {0: [step(0, s, 0.1, 0.5, 0.1) for s in range(2)] + [bucket(0, s, 0, 10, 0.45, 0.45, 0.7) for s in range(2)]}
    run = load_run(write_run(tmp_path, ev))
    s = run.summary().set_index("quantity")
    # compute ends when the last bucket was ready (0.45 s from step start), plus the optimizer (0.1 s)
    assert s.loc["T_comp", "value"] == pytest.approx(0.55)
    assert s.loc["T_comp", "how"].startswith("estimated")
    assert s.loc["exposed", "value"] == pytest.approx(0.7 - 0.55)


def test_partial_run_with_torn_line_loads(tmp_path):
    ev = {
        0: [step(0, 0, 0.1, 0.2, 0.1), step(0, 1, 0.1, 0.2, 0.1)],
        1: [
            step(1, 0, 0.1, 0.2, 0.1),
            {
                "kind": "error",
                "rank": 1,
                "time": 1.0,
                "error": "RuntimeError: x",
                "traceback": "Traceback\nRuntimeError: x",
            },
        ],
    }
    run = load_run(write_run(tmp_path, ev, torn_tail=True, state="failed"))
    assert sorted(run.steps["rank"].tolist()) == [0, 0, 1]
    assert run.errors[0]["rank"] == 1
    assert list(run.steps.columns[:7]) == ["rank", "step", "t_fwd", "t_bwd", "t_opt", "t_step", "loss"]
    assert run.status["state"] == "failed" and run.warnings == []  # torn last lines: tolerated, counted
    assert len(run.damage) == 2 and run.damage["tolerated"].all()


def test_not_a_run_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a dtlab run directory"):
        load_run(str(tmp_path))
