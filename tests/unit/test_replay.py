"""dtlab.launching.replay on hand-made run directories: the recorded machine, matching a config, and a clear
error when the submission lacks the run a notebook asks for (no launch happens in replay mode)."""

import json

import pytest

import dtlab
from dtlab.config.run import tiny
from dtlab.course.labs import lab_config, quick_mode
from dtlab.launching import replay


def _record(root, name, cfg, quick, gpus, t, state="finished"):
    d = root / "runs" / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(
        json.dumps({"config": cfg.to_dict(), "launch": {"time": t, "quick": quick, "gpus": gpus}})
    )
    (d / "status.json").write_text(json.dumps({"state": state}))
    return d


def test_replay_finds_the_matching_run_and_the_recorded_machine(tmp_path, monkeypatch):
    monkeypatch.delenv("DTLAB_QUICK", raising=False)
    monkeypatch.setenv(replay.ENV, str(tmp_path))
    # recorded on a 4-GPU machine in full mode: the labs must rebuild those configs, not quick ones
    _record(tmp_path, "old", tiny(bucket_mb=1.0), False, 4, 1.0)
    assert replay.recorded_machine() == {"quick": False, "gpus": 4}
    assert not quick_mode() and lab_config().nproc == 4
    a = _record(tmp_path, "a", tiny(bucket_mb=2.0), False, 4, 2.0)
    _record(tmp_path, "failed", tiny(bucket_mb=2.0), False, 4, 3.0, state="failed")
    assert replay.find("config", tiny(bucket_mb=2.0).to_dict()) == str(a)  # the finished one, not the failed
    log = tmp_path / "replay.jsonl"
    monkeypatch.setenv(replay.LOG_ENV, str(log))
    h = dtlab.launch(tiny(bucket_mb=2.0))
    assert isinstance(h, replay.Replayed) and h.status() == "finished" and h.run_dir == str(a)
    with pytest.raises(replay.ReplayMissing, match=r"bucket_mb: asked 3\.0, recorded 2\.0"):
        dtlab.launch(tiny(bucket_mb=3.0))
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries[0] == {"kind": "config", "run_dir": str(a)} and "bucket_mb: asked 3.0" in entries[1]["missing"]
    assert not (tmp_path / "runs" / "tiny").exists() and len(list((tmp_path / "runs").iterdir())) == 3


def test_no_replay_without_the_variable(monkeypatch):
    monkeypatch.delenv(replay.ENV, raising=False)
    assert replay.replay_root() is None and replay.recorded_machine() is None and replay.find("config", {}) is None


def test_a_recording_older_than_a_field_matches_that_fields_default(tmp_path, monkeypatch):
    """Runs recorded before dtlab gained a field (say checkpoint_every), in the flat form of config version 1,
    behaved as its default: dtlab.results.upgrade brings them to today's form, so they still replay for a notebook
    that leaves it at the default, and not for one that sets it or another option."""
    from dtlab.config.options import FLAT

    monkeypatch.setenv(replay.ENV, str(tmp_path))
    d = _record(tmp_path, "old", tiny(bucket_mb=2.0, comm_hook="fp16"), True, 0, 1.0)
    doc = json.loads((d / "config.json").read_text())
    new = doc["config"]
    old = {k: v for k, v in new.items() if not isinstance(v, dict) or k == "zero"}  # version 1: flat, no version
    old.update({flat: new[group][field] for flat, (group, field) in FLAT.items()})
    del old["config_version"], old["checkpoint_every"], old["straggler"]
    (d / "config.json").write_text(json.dumps({**doc, "config": old}))
    defaults = type(tiny())().to_dict()
    asked = tiny(bucket_mb=2.0, comm_hook="fp16")
    assert replay.find("config", asked.to_dict(), defaults) == str(d)
    assert replay.find("config", asked.to_dict()) == str(d)  # the upgraded recording has every field
    assert replay.find("config", asked.replace(checkpoint_every=2).to_dict(), defaults) is None
    assert replay.find("config", tiny(bucket_mb=2.0).to_dict(), defaults) is None  # it ran fp16
    assert isinstance(dtlab.launch(asked), replay.Replayed)


def test_a_field_left_at_none_must_be_none_in_the_recording(tmp_path, monkeypatch):
    """A reference run and a newer straggler run of the same config: the reference (straggler None) must replay
    the reference, not the newest run that agrees on every field the notebook set to something."""
    monkeypatch.setenv(replay.ENV, str(tmp_path))
    ref = _record(tmp_path, "ref", tiny(bucket_mb=2.0), True, 0, 1.0)
    slow = _record(tmp_path, "slow", tiny(bucket_mb=2.0, straggler="1:2"), True, 0, 2.0)
    defaults = type(tiny())().to_dict()
    assert replay.find("config", tiny(bucket_mb=2.0).to_dict(), defaults) == str(ref)
    assert replay.find("config", tiny(bucket_mb=2.0, straggler="1:2").to_dict(), defaults) == str(slow)
    # where and how a launch met its peers is not part of what ran
    assert replay.find("config", tiny(bucket_mb=2.0, rdzv_endpoint="127.0.0.1:1234").to_dict(), defaults) == str(ref)
