"""Damaged run directories, read as a user's notebook or `dtlab show` would: a copy of a real finished run of the tiny
model, hurt one way per test. A torn last line is tolerated and counted; every other damaged line is skipped and
reported with file, line and what is wrong (a RunDamageWarning, `run.warnings`, `run.damage`); a damaged status is
recovered from the events; a rank cut short is incomplete, not finished; a config.json that cannot be read, or a
missing events/ folder, is a DamagedRun naming the file."""

import json

from dtlab.results.events import scan_events


def test_a_line_torn_by_a_restart_is_tolerated(tmp_path):
    """torchrun restarted the rank: the killed attempt's torn line is followed by the new attempt's start."""
    f = tmp_path / "rank0.jsonl"
    f.write_text(
        '{"kind": "start", "rank": 0, "pid": 7}\n{"kind": "step", "rank": 0, "st\n'
        '{"kind": "start", "rank": 0, "pid": 8, "attempt": 1}\n{"kind": "done", "rank": 0, "attempt": 1}\n'
    )
    scan = scan_events(str(f))
    assert scan.torn == [2] and scan.damage == [] and [e["pid"] for e in scan.events if "pid" in e] == [7, 8]
    f.write_text(
        '{"kind": "start", "rank": 0, "pid": 7}\n{"kind": "step", "rank": 0, "st\n{"kind": "done", "rank": 0}\n'
    )  # no restart follows it: damage
    scan = scan_events(str(f))
    assert scan.torn == [] and [d["line"] for d in scan.damage] == [2]


def test_a_damaged_node_status_is_named(tmp_path):
    from dtlab.results.status import merged_status

    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "node0.status.json").write_text(json.dumps({"state": "finished"}))
    (tmp_path / "nodes" / "node1.status.json").write_text("{oops")
    problems = []
    st = merged_status(str(tmp_path), 2, problems)
    assert st["state"] == "running"  # node 1's state is unknown: the run cannot be called finished
    assert len(problems) == 1 and "node1.status.json, line 1" in problems[0]
