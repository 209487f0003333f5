"""The one follower of event files (dtlab.results.events.RankTail): its batched reader (complete lines parsed as one
JSON array) must give exactly what reading line by line gives, on healthy and damaged files alike: the same events,
the same torn lines, the same damage with the same words. Every reader of event files goes through it: the strict
reader, the monitor, the watchdog and the interrupter."""

import json
import random

import pytest

import dtlab.results.events as events_mod
from dtlab.launching.interrupts import Interrupter
from dtlab.launching.watchdog import RankFeed
from dtlab.results.events import RankTail, scan_events

GOOD = [
    {"kind": "start", "rank": 0, "pid": 7, "world_size": 2},
    {"kind": "step", "rank": 0, "step": 0, "t_fwd": 0.1, "t_bwd": 0.2, "t_opt": 0.01, "t_step": 0.31, "loss": 0.7},
    {"kind": "bucket", "rank": 0, "step": 0, "bucket": 0, "nbytes": 100, "t_ready": 0.1, "t_start": 0.1, "t_end": 0.2},
    {"kind": "exercise_note", "rank": 0, "text": "a kind dtlab does not know"},
    {"kind": "machine", "rank": 0, "phase": "end", "time": 1.5, "cpu_s": 1, "loadavg": [1.0, 0.5, 0.2]},
]
BAD = [
    b"",  # an empty line
    b"   ",
    b'{"kind": "step", "rank": 0, "st',  # torn inside the file
    b"[1, 2, 3]",
    b'{"rank": 0}',  # no kind
    b'{"kind": ["step"], "rank": 0}',
    b'{"kind": "step", "rank": 0, "step": "oops", "t_fwd": 0, "t_bwd": 0, "t_opt": 0, "t_step": 0}',
    b'{"kind": "step", "rank": true, "step": 1, "t_fwd": 0, "t_bwd": 0, "t_opt": 0, "t_step": 0}',
    b'{"kind": "step", "rank": null, "step": 1, "t_fwd": 0, "t_bwd": 0, "t_opt": 0, "t_step": 0}',
    b'{"kind": "done", "rank": 1}',  # another rank's event
    b'{"kind": "done", "rank": 0, "attempt": "2"}',
    b'{"kind": "other", "rank": 1.5}',
    b'{"kind": "start", "rank": 0, "pid": 9, "attempt": 1}',  # a restarted attempt: a torn line before it is tolerated
    b'{"a": 1}, {"kind": "done", "rank": 0}',  # two values on one line
    b"{}",
    b'{"kind": "done", "rank": 0} ',
]


def damaged_file(path, seed: int) -> bytes:
    """A seeded rank-0 file: mostly good events, some bad lines among them, maybe a torn last line."""
    rng = random.Random(seed)
    lines = []
    for i in range(rng.randint(5, 400)):
        if rng.random() < 0.08:
            lines.append(rng.choice(BAD))
        else:
            ev = dict(rng.choice(GOOD))
            if "step" in ev:
                ev["step"] = i
            lines.append(json.dumps(ev).encode())
    data = b"\n".join(lines) + (b"\n" if rng.random() < 0.6 else b"")
    if rng.random() < 0.3:
        data += b'{"kind": "step", "ra'  # torn at the end
    path.write_bytes(data)
    return data


def read(path, batch: int):
    tail = RankTail(str(path))
    tail.BATCH = batch
    evs = tail.read() + tail.close()
    return evs, tail.torn, tail.damage, tail.lines


@pytest.mark.parametrize("seed", range(40))
def test_batched_and_line_by_line_readers_agree_on_damaged_files(tmp_path, seed):
    path = tmp_path / "rank0.jsonl"
    damaged_file(path, seed)
    by_line = read(path, 1)  # a batch of one line is read line by line
    for batch in (2, 7, 4096):
        assert read(path, batch) == by_line
    scan = scan_events(str(path))
    assert (scan.events, scan.torn, scan.damage) == by_line[:3]


def test_damage_in_the_seeded_files_is_found(tmp_path):
    """The comparison above means something: the files hold damage of every sort, reported by both readers."""
    whats, torn = set(), 0
    for seed in range(40):
        path = tmp_path / f"s{seed}" / "rank0.jsonl"
        path.parent.mkdir()
        damaged_file(path, seed)
        _, t, damage, _ = read(path, 4096)
        whats |= {d["what"] for d in damage}
        torn += len(t)
    assert torn > 0 and {"an empty line", "an event of rank 1 in rank 0's file"} <= whats
    for words in ("not JSON", "must be an integer, got 'oops'", "got null", "got True", "not an event object"):
        assert any(words in w for w in whats), words


def test_a_healthy_file_is_parsed_in_batches(tmp_path, monkeypatch):
    """Complete lines are parsed as one JSON array per batch, not one decoder call per line."""
    path = tmp_path / "rank0.jsonl"
    path.write_text("".join(json.dumps({**GOOD[1], "step": i}) + "\n" for i in range(1000)))
    calls = []
    real = events_mod.json.loads
    monkeypatch.setattr(events_mod.json, "loads", lambda s: calls.append(1) or real(s))
    tail = RankTail(str(path))
    assert [e["step"] for e in tail.read()] == list(range(1000))
    assert len(calls) == 1 and tail.lines == 1000 and tail.offset == path.stat().st_size


def test_the_watchdog_and_the_interrupter_apply_the_strict_readers_rules(tmp_path):
    """An event of another rank, or with a field of the wrong type, is skipped by every follower alike."""
    ev = tmp_path / "events"
    ev.mkdir()
    (ev / "rank0.jsonl").write_text(
        '{"kind": "start", "rank": 1, "pid": 99}\n{"kind": "start", "rank": 0, "pid": 7}\n'
        '{"kind": "step", "rank": 0, "step": "x", "t_fwd": 0, "t_bwd": 0, "t_opt": 0, "t_step": 0}\n'
    )
    feed = RankFeed(0, str(ev / "rank0.jsonl"), 0.0)
    assert [e["pid"] for e in feed.read(1.0)] == [7] and feed.pid == 7 and feed.progress == 0
    killer = Interrupter(str(tmp_path), gaps=[1.0], ranks=[0], steps=10)
    killer._read()
    assert killer._pids == {(0, 0): 7} and killer._last_step == {}
