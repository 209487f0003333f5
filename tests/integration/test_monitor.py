"""The live monitor on real runs (tiny model, 2 gloo ranks) in text mode: a run watched to its breakdown, a rank
killed mid-run (DTLAB_FAULT, dtlab.rank.lifecycle.maybe_inject_fault) shown and named before RunFailed, and a
keyboard interrupt shown where it stopped the run."""

import json
import signal
import subprocess
import sys
import time

import pytest

import dtlab
from dtlab.results.events import read_events


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("dtlab watch: ")]


def test_a_watched_run_prints_lines_then_its_breakdown(tmp_path, capsys):
    run = dtlab.run(dtlab.tiny(out=str(tmp_path / "watched"), steps=8, baseline_steps=2), watch="text")
    out = capsys.readouterr().out
    lines = _lines(out)
    assert lines, out
    last = lines[-1]
    assert "8 steps of 8" in last and last.endswith("finished"), last
    assert "T_step" in last and " ms (slowest rank, median of steps" in last and "% of T_step" in last
    assert "GB/s (no calibration)" in last and "exposed" in last  # 2 no-op baseline steps were paired
    breakdown = out.split(last, 1)[1]
    assert "T_step" in breakdown and "T_comm" in breakdown and "overlap" in breakdown  # run.summary()'s table
    assert run.status["state"] == "finished"


def test_a_killed_rank_is_shown_and_named_before_run_failed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DTLAB_FAULT", "1:4:kill")  # launch() hands the environment to torchrun
    with pytest.raises(dtlab.RunFailed) as info:
        dtlab.run(dtlab.tiny(out=str(tmp_path / "killed"), steps=30), watch="text")
    assert (info.value.rank, info.value.signal) == (1, "SIGKILL")
    lines = _lines(capsys.readouterr().out)
    last = lines[-1]
    assert "failed: rank 1 (SIGKILL)" in last, lines
    assert "4 steps of 30" in last  # steps 0 to 3 completed on both ranks; rank 1 died at the start of step 4


def test_an_interrupt_is_shown_where_it_stopped(tmp_path):
    """A kernel interrupt is SIGINT to the process waiting in dtlab.run: the monitor's last line says so."""
    out = tmp_path / "interrupted"
    code = f"import dtlab; dtlab.run(dtlab.tiny(out={str(out)!r}, steps=10000, timeout_s=600), watch='text')"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in tests/integration/test_faults.py
    )
    ev = out / "events" / "rank1.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (ev.exists() and sum(e["kind"] == "step" for e in read_events(str(ev))) > 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in stderr
    last = _lines(stdout)[-1]
    assert "of 10000" in last and "interrupted: stopped by a keyboard (kernel) interrupt" in last, stdout[-2000:]
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"
