"""Who a run lives and dies with: a launch from a worker thread that exits runs on (the agent is tied to the
launching process, not to a thread); a launcher that dies takes its ranks with it, and its run is never read as
'running' afterwards ('abandoned', with what was recorded); a status whose processes are gone is judged by pid and
start time, on the host and boot that wrote it. Also the explicit small cases: OMP_NUM_THREADS=0 is refused, and a
calibration that did not finish says so when its profile is asked for."""

import json

import pandas as pd
import pytest

import dtlab


@pytest.mark.parametrize("value", ["0", "-1", "two", ""])
def test_omp_num_threads_that_is_not_a_positive_number_is_refused(tmp_path, monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ValueError, match=rf"OMP_NUM_THREADS must be a whole number >= 1 .*got {value!r}"):
        dtlab.launch(dtlab.tiny(out=str(tmp_path / "never")))
    assert not (tmp_path / "never").exists()


def _calibration_dir(tmp_path, state):
    (tmp_path / "events").mkdir()
    cal = {"nproc": 2, "ops": ["all_reduce"], "rounds": 3, "iters": 3, "form": "ring", "nnodes": 1}
    (tmp_path / "config.json").write_text(json.dumps({"calibration": cal, "resolved": {"world_size": 2}}))
    for r in (0, 1):
        ev = [{"kind": "start", "rank": r, "pid": 1}]
        ev += [
            {
                "kind": "sample",
                "rank": r,
                "op": "all_reduce",
                "nbytes": n,
                "nproc": 2,
                "iter": i,
                "seconds": 1e-4 + n * 1e-9 + i * 1e-6,
            }
            for n in (4096, 65536, 1 << 20)
            for i in range(2)
        ]
        ev += [{"kind": "calib", "rank": r, "round": 0, "rounds": 3}]
        (tmp_path / "events" / f"rank{r}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (tmp_path / "status.json").write_text(json.dumps({"state": state}))
    return str(tmp_path)


def test_an_interrupted_calibration_says_so(tmp_path):
    from dtlab.results.calibration import load_calibration

    d = _calibration_dir(tmp_path, "interrupted")
    with pytest.raises(dtlab.RunFailed) as info:
        dtlab.load_profile(d)
    e = info.value
    assert e.state == "interrupted" and "was interrupted before it finished" in str(e)
    assert "12 rank samples recorded, 1 of 3 rounds done" in str(e) and "partial=True" in str(e)
    with pytest.raises(dtlab.RunFailed) as info:
        load_calibration(d)
    assert info.value.state == "interrupted" and isinstance(info.value.run, pd.DataFrame)
    prof = load_calibration(d, partial=True)  # what was recorded, fitted and labelled
    assert prof.meta["partial"] and "all_reduce" in prof.fits
    assert any(c.startswith("partial: the sweep interrupted") for c in prof.caveats)
    assert dtlab.load_profile(d).meta["partial"]  # the partial profile was saved


@pytest.mark.parametrize("value", ["forkserver", "Fork", "x"])
def test_a_start_method_other_than_fork_or_spawn_is_refused_before_anything_starts(tmp_path, monkeypatch, value):
    monkeypatch.setenv("DTLAB_START_METHOD", value)
    with pytest.raises(ValueError, match=rf"DTLAB_START_METHOD must be one of fork, spawn, got {value!r}"):
        dtlab.launch(dtlab.tiny(out=str(tmp_path / "never")))
    assert not (tmp_path / "never").exists()


def test_nccl_ranks_are_always_spawned_and_gloo_ranks_forked_unless_asked(monkeypatch):
    from dtlab.launching.agent import start_method

    assert start_method(True, {}) == "fork" and start_method(True, {"DTLAB_START_METHOD": "spawn"}) == "spawn"
    assert start_method(False, {}) == "spawn" and start_method(False, {"DTLAB_START_METHOD": "fork"}) == "spawn"
