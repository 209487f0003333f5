"""A rank that crashes after recording `done` (an abort in the backend's shutdown) must not turn a complete run
into a failed one; a rank that crashes before `done` still fails the run, naming it."""

import json
import os
import subprocess
import sys

import pytest

from dtlab.launching.handle import Handle
from dtlab.results.status import RunFailed


def _run_dir(tmp_path, kinds_by_rank, exits):
    os.makedirs(tmp_path / "events")
    os.makedirs(tmp_path / "logs")
    for r, kinds in kinds_by_rank.items():
        with open(tmp_path / "events" / f"rank{r}.jsonl", "w") as f:
            for k in kinds:
                f.write(json.dumps({"kind": k, "rank": r, "time": 1.0, "step": 0, "pid": 2**22 + r}) + "\n")
    (tmp_path / "exits.json").write_text(json.dumps(exits))
    return str(tmp_path)


def _ended_handle(run_dir, code):
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])
    proc.wait()
    return Handle(run_dir, proc, 2, 1, 60, "test", loader=lambda d: {"loaded": d})


def test_abort_after_done_keeps_the_run(tmp_path, caplog):
    d = _run_dir(
        tmp_path,
        {0: ["start", "done"], 1: ["start", "done"]},
        {"1": {"exitcode": -6, "signal": "SIGABRT", "timestamp": 2.0}},
    )
    h = _ended_handle(d, 1)
    assert h.wait(progress=False) == {"loaded": d} and h.status() == "finished"
    status = json.loads(open(os.path.join(d, "status.json")).read())
    assert "rank 1 ended by SIGABRT" in status["shutdown_crash"]
    assert "during shutdown" in caplog.text  # a warning on logging.getLogger("dtlab")


@pytest.mark.parametrize("rank1", [["start"], ["start", "error", "done"]])
def test_crash_before_done_still_fails(tmp_path, rank1):
    d = _run_dir(
        tmp_path, {0: ["start", "done"], 1: rank1}, {"1": {"exitcode": -6, "signal": "SIGABRT", "timestamp": 2.0}}
    )
    h = _ended_handle(d, 1)
    with pytest.raises(RunFailed) as e:
        h.wait(progress=False)
    assert h.status() == "failed" and e.value.rank == 1
