"""Damaged run directories, read as a user's notebook or `dtlab show` would: a copy of a real finished run of the tiny
model, hurt one way per test. A torn last line is tolerated and counted; every other damaged line is skipped and
reported with file, line and what is wrong (a RunDamageWarning, `run.warnings`, `run.damage`); a damaged status is
recovered from the events; a rank cut short is incomplete, not finished; a config.json that cannot be read, or a
missing events/ folder, is a DamagedRun naming the file."""

import os
import shutil
import warnings

import pytest

from dtlab.cli.main import main as cli_main
from dtlab.results.run import load_run
from dtlab.runfiles import DamagedRun, RunDamageWarning


@pytest.fixture
def copy(tiny_run, tmp_path):
    """A fresh copy of the shared finished run (2 ranks, 4 steps + 2 baseline steps each)."""
    dst = tmp_path / "run"
    shutil.copytree(tiny_run.path, dst)
    return dst


def _lines(path):
    return path.read_bytes().split(b"\n")


def _load_quietly(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = load_run(str(path))
    return run, [str(w.message) for w in caught if issubclass(w.category, RunDamageWarning)]


def test_the_undamaged_copy_loads_without_a_word(copy, tiny_run):
    run, said = _load_quietly(copy)
    assert said == [] and run.warnings == [] and run.damage.empty
    assert run.status["state"] == "finished" and list(run.ranks["ended"]) == ["done", "done"]
    assert len(run.steps) == len(tiny_run.steps)


def test_a_rank_file_cut_in_half_is_incomplete_not_finished(copy, capsys):
    f = copy / "events" / "rank1.jsonl"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # cut mid-line, as a truncated copy or a lost tail
    run, said = _load_quietly(copy)
    assert run.status["state"] == "incomplete" and run.status["recorded_state"] == "finished"
    assert dict(zip(run.ranks["rank"], run.ranks["ended"])) == {0: "done", 1: "incomplete"}
    assert len(said) == 1 and "rank 1 ends" in said[0] and "without `done`" in said[0]
    assert "rank 0 ends after step 5 with `done`" in said[0]  # its peer went on to the last baseline step
    assert run.damage["tolerated"].all() and list(run.damage["file"]) == ["events/rank1.jsonl"]  # the torn tail
    assert cli_main(["show", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "status incomplete" in out and "warning: status.json says finished, but rank 1" in out


def test_a_torn_line_in_the_middle_is_reported_with_file_and_line(copy):
    f = copy / "events" / "rank0.jsonl"
    lines = _lines(f)
    n = next(i for i, ln in enumerate(lines) if b'"kind": "step"' in ln and b'"step": 2' in ln)
    lines[n] = lines[n][: len(lines[n]) // 2]  # a torn line that is not the last one
    f.write_bytes(b"\n".join(lines))
    said = rf"events/rank0\.jsonl: 1 damaged line\(s\) skipped: line {n + 1}: not JSON"
    with pytest.warns(RunDamageWarning, match=said):
        run = load_run(str(copy))
    assert 2 not in set(run.steps[run.steps["rank"] == 0]["step"])  # the step is gone: said, not silent
    row = run.damage[~run.damage["tolerated"]].iloc[0]
    assert (row["file"], row["line"]) == ("events/rank0.jsonl", n + 1) and "torn or corrupted" in row["what"]
    assert run.status["state"] == "finished"  # every rank still recorded `done`


def test_a_torn_last_line_is_tolerated_and_counted(copy):
    f = copy / "events" / "rank1.jsonl"
    f.write_bytes(f.read_bytes() + b'{"kind": "step", "rank": 1, "st')
    run, said = _load_quietly(copy)
    assert said == [] and run.status["state"] == "finished"
    assert len(run.damage) == 1 and run.damage.iloc[0]["tolerated"]
    assert run.damage.iloc[0]["line"] == len(_lines(f))


@pytest.mark.parametrize(
    "line,needle",
    [
        (b"[1, 2, 3]", "a JSON array, not an event object"),
        (
            b'{"kind": "step", "rank": 0, "step": "oops", "t_fwd": 0.1, "t_bwd": 0.1, "t_opt": 0.1, "t_step": 0.3}',
            "'step' event: field 'step' must be an integer, got 'oops'",
        ),
        (
            b'{"kind": "bucket", "rank": 0, "step": 1, "bucket": 0, "nbytes": "many"}',
            "field 'nbytes' must be an integer",
        ),
        (b'{"rank": 0, "step": 1}', "no event kind"),
        (
            b'{"kind": "step", "rank": 1, "step": 9, "t_fwd": 0.1, "t_bwd": 0.1, "t_opt": 0.1, "t_step": 0.3}',
            "an event of rank 1 in rank 0's file",
        ),
    ],
)
def test_a_line_of_the_wrong_shape_is_skipped_and_named(copy, line, needle):
    f = copy / "events" / "rank0.jsonl"
    lines = _lines(f)
    lines.insert(3, line)
    f.write_bytes(b"\n".join(lines))
    with pytest.warns(RunDamageWarning, match="line 4: ") as rec:
        run = load_run(str(copy))
    assert needle in str(rec[0].message)
    assert run.summary().set_index("quantity").loc["T_step", "value"] > 0  # what is left still sums up
    assert set(run.steps["step"]) == set(range(run.config.steps))


def test_garbage_in_config_json_is_an_error_naming_the_file(copy, capsys):
    (copy / "config.json").write_text('{"config": {"strategy": "ddp",\n  oops}')
    with pytest.raises(DamagedRun) as info:
        load_run(str(copy))
    e = info.value
    assert e.path == str(copy / "config.json") and e.line == 2 and "not JSON" in str(e) and "column 3" in str(e)
    assert cli_main(["show", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json, line 2" in err


def test_a_config_json_without_a_config_is_named(copy):
    (copy / "config.json").write_text("[1, 2]")
    with pytest.raises(DamagedRun, match=r"config\.json: a JSON array, not an object"):
        load_run(str(copy))


@pytest.mark.parametrize("status", ['{"state": "fin', "", '{"state": 3}', "[]"])
def test_a_damaged_status_is_recovered_from_the_events(copy, status):
    (copy / "status.json").write_text(status)
    with pytest.warns(RunDamageWarning, match=r"status\.json.*read from the ranks' events instead: finished"):
        run = load_run(str(copy))
    assert run.status["state"] == "finished" and len(run.steps) == 2 * run.config.steps


def test_a_damaged_status_of_a_failed_run_reads_failed(copy):
    f = copy / "events" / "rank1.jsonl"
    f.write_bytes(f.read_bytes() + b'{"kind": "error", "rank": 1, "error": "RuntimeError: x"}\n')
    (copy / "status.json").write_text("garbage")
    with pytest.warns(RunDamageWarning, match="instead: failed"):
        assert load_run(str(copy)).status["state"] == "failed"


def test_a_run_without_its_events_folder_is_an_error(copy):
    shutil.rmtree(copy / "events")
    with pytest.raises(DamagedRun, match="the events folder is missing") as info:
        load_run(str(copy))
    assert info.value.path == str(copy / "events")


def test_a_missing_rank_file_makes_the_run_incomplete(copy):
    os.remove(copy / "events" / "rank1.jsonl")
    said = r"rank 1 has no event file \(peers: rank 0 ends after step 5 with `done`\)"
    with pytest.warns(RunDamageWarning, match=said):
        run = load_run(str(copy))
    assert run.status["state"] == "incomplete"
