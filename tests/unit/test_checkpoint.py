"""Checkpoint and resume (dtlab.results.restarts, dtlab.rank.restarts): a rank killed with SIGKILL makes torchrun
restart the group, training resumes from the newest checkpoint and finishes with every step once, on one timeline, with
the same losses as a run never interrupted; without restarts left the run fails naming the rank (with max_restarts 0:
the kill drill of tests/test_faults.py, which runs with checkpoints on). Plus the pure parts: checks before launch, the
timeline on hand-made events, torn event lines, attempt-aware fault injection, the watchdog during a restart, and the
Young/Daly intervals.

The three real runs (tiny model, 2 gloo ranks) are launched together, as the fault drills are."""

import pytest

import dtlab
from dtlab.model.restarts import checkpoint_tradeoff, daly_interval, young_interval
from dtlab.results.events import read_events
from dtlab.results.restarts import final_timeline


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(checkpoint_every=-1), "checkpoint_every must be an integer >= 0"),
        (dict(max_restarts=-2), "max_restarts must be an integer >= 0"),
        (dict(checkpoint_every=5, steps=4), "checkpoint_every must be <= steps (4)"),
        (dict(checkpoint_every=True), "checkpoint_every must be an integer"),
        (
            dict(strategy="zero3", checkpoint_every=2, baseline_steps=0),
            "checkpoint_every 2 applies to strategy 'ddp' only",
        ),
        (dict(strategy="zero3", max_restarts=1, baseline_steps=0), "max_restarts 1 applies to strategy 'ddp' only"),
        (dict(comm_hook="powersgd", checkpoint_every=2), "PowerSGD's error-feedback state"),
    ],
)
def test_bad_settings_are_refused_before_launch(tmp_path, fields, needle):
    out = tmp_path / "never"
    with pytest.raises(ValueError) as info:
        dtlab.launch(dtlab.tiny(out=str(out), device="cpu", **fields))
    assert needle in str(info.value)
    assert not out.exists()


def test_the_final_attempt_wins_and_redone_steps_are_lost_work():
    ev = lambda kind, rank, step, attempt, **kw: {"rank": rank, "step": step, "attempt": attempt, **kw}  # noqa: E731
    rows = {
        "step": [ev("step", 0, s, 0, t_step=0.1, loss=s, time=s) for s in range(5)]
        + [ev("step", 0, s, 1, t_step=0.2, loss=10 + s, time=10 + s) for s in range(2, 6)]
        + [ev("step", 0, s, 2, t_step=0.3, loss=20 + s, time=20 + s) for s in range(4, 7)],
        "bucket": [ev("bucket", 0, 3, 0), ev("bucket", 0, 3, 1)],
        "restart": [{"rank": 0, "attempt": 1, "resumed_from": 2}, {"rank": 0, "attempt": 2, "resumed_from": 4}],
    }
    out, lost = final_timeline(rows)
    assert [(e["step"], e["attempt"]) for e in out["step"]] == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]
    assert [(e["step"], e["attempt"]) for e in out["bucket"]] == [(3, 1)]
    assert sorted((d["step"], d["attempt"]) for d in lost) == [(2, 0), (3, 0), (4, 0), (4, 1), (5, 1)]
    plain = {"step": rows["step"][:5]}  # no restart: nothing changes
    assert final_timeline(plain) == (plain, [])


def test_a_baseline_step_belongs_to_the_training_step_it_is_paired_with():
    """Baseline steps run right after their paired training step and are numbered after the training steps (4
    steps: baseline 4 after step 1, baseline 5 after step 2). Resumed at step 2, baseline 4 (paired with step 1)
    stays with its buckets, baseline 5 was redone with step 2; only training steps are lost work."""
    ev = lambda rank, step, attempt, **kw: {"rank": rank, "step": step, "attempt": attempt, **kw}  # noqa: E731
    rows = {
        "step": [ev(0, s, 0, t_step=0.1) for s in range(3)] + [ev(0, s, 1, t_step=0.2) for s in (2, 3)],
        "baseline_step": [ev(0, 4, 0, paired_step=1), ev(0, 5, 0, paired_step=2), ev(0, 5, 1, paired_step=2)],
        "bucket": [ev(0, 4, 0), ev(0, 5, 0), ev(0, 5, 1)],
        "restart": [{"rank": 0, "attempt": 1, "resumed_from": 2}],
    }
    out, lost = final_timeline(rows)
    assert [(e["step"], e["attempt"]) for e in out["baseline_step"]] == [(4, 0), (5, 1)]
    assert [(e["step"], e["attempt"]) for e in out["bucket"]] == [(4, 0), (5, 1)]
    assert [(d["step"], d["attempt"]) for d in lost] == [(2, 0)]


def test_a_torn_last_line_does_not_swallow_the_restarted_ranks_first_event(tmp_path):
    from dtlab.rank.recorder import EventWriter

    path = tmp_path / "events" / "rank1.jsonl"
    path.parent.mkdir()
    path.write_text('{"kind": "step", "step": 0}\n{"kind": "step", "st')  # SIGKILL in the middle of a line
    w = EventWriter(str(path), attempt=1)
    w.write("start", rank=1)
    w.close()
    assert [(e["kind"], e.get("attempt")) for e in read_events(str(path))] == [("step", None), ("start", 1)]


def test_fault_injection_fires_on_the_attempt_it_names(monkeypatch):
    from dtlab.rank.lifecycle import maybe_inject_fault

    for spec, attempt, fires in [
        ("1:3", "0", True),
        ("1:3", "1", False),
        ("1:3:raise:1", "1", True),
        ("1:3:raise:1", "0", False),
        ("1:3:raise:*", "2", True),
    ]:
        monkeypatch.setenv("DTLAB_FAULT", spec)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        maybe_inject_fault(1, 2)  # another step: never
        maybe_inject_fault(0, 3)  # another rank: never
        if fires:
            with pytest.raises(RuntimeError, match="injected fault"):
                maybe_inject_fault(1, 3)
        else:
            maybe_inject_fault(1, 3)
    monkeypatch.setenv("DTLAB_FAULT", "1:3:kill:first")
    with pytest.raises(ValueError, match="attempt must be a number"):
        maybe_inject_fault(1, 3)
    for bad in ("x:3", "1", "1:y:kill"):  # refused at the first step, not only at the fault's
        monkeypatch.setenv("DTLAB_FAULT", bad)
        with pytest.raises(ValueError, match="RANK and STEP must be numbers"):
            maybe_inject_fault(0, 0)


def test_every_rank_meets_at_a_barrier_before_the_fault_fires(monkeypatch):
    """The peers of the failing rank wait for it at the fault's step, so each has recorded the steps before it
    (without the barrier a slow peer could be stopped by torchrun mid-step and the lost work would vary)."""
    import torch.distributed as dist

    from dtlab.rank.lifecycle import maybe_inject_fault

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setenv("DTLAB_FAULT", "1:3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    maybe_inject_fault(0, 2)
    maybe_inject_fault(1, 2)
    assert calls == []  # not at another step
    maybe_inject_fault(0, 3)  # the peer: meets the barrier, then goes on
    assert calls == ["barrier"]
    with pytest.raises(RuntimeError, match="injected fault"):
        maybe_inject_fault(1, 3)
    assert calls == ["barrier", "barrier"]  # the failing rank met it too, before it failed
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    maybe_inject_fault(1, 3)  # another attempt: no fault and no barrier, on any rank
    assert calls == ["barrier", "barrier"]


def test_young_and_daly_intervals():
    # Daly (2006), figures 3-5: M = 24 h, 6 h and 15 min with a 5 min dump give 117, 57 and 9.1 min
    assert [round(daly_interval(5.0, m), 1) for m in (1440.0, 360.0, 15.0)] == [116.7, 56.7, 9.1]
    assert young_interval(5.0, 1440.0) == pytest.approx(120.0)  # sqrt(2 x 5 x 1440)
    assert daly_interval(10.0, 4.0) == 4.0  # C >= 2M: checkpoint once per MTBF
    t = checkpoint_tradeoff(0.5, 2.0, 3600.0, every=(1, 10, 100, 1000), restart_s=30.0)
    assert t.attrs["young_every"] == pytest.approx(120.0 / 0.5)
    assert list(t["lost_per_failure_s"]) == [30.25, 32.5, 55.0, 280.0]
    best = t.loc[t["waste"].idxmin(), "every"]
    assert best == 100  # the tabulated N nearest Young's 240 steps wastes least
    with pytest.raises(ValueError, match="mtbf_s"):
        young_interval(1.0, 0.0)
