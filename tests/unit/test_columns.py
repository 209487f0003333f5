"""A finished run's columnar copy (dtlab.results.columns): `load_run` reads it when it matches the JSON lines, and the
frames it gives are the frames the lines give, for every recorded run; a stale, damaged or foreign copy is rebuilt
from the lines, never trusted."""

import json
import os
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pytest

import dtlab
from dtlab.results import run as run_mod
from dtlab.results.columns import FOLDER, INDEX, read_copy, same_frame
from dtlab.results.run import COPIED, load_run
from dtlab.runfiles import RunDamageWarning

FIXTURES = Path(__file__).parent.parent / "fixtures"


def recorded_dirs() -> list:
    """Every recorded run: the v1 fixtures and the shipped GPU runs."""
    paths = [FIXTURES / "run-v1-ddp", FIXTURES / "run-v1-pp"]
    runs = dtlab.recorded_runs()
    return paths + [Path(dtlab.recorded_run(n).run.path) for n in runs.loc[runs["kind"] == "run", "name"]]


def copied(src, tmp_path) -> str:
    dst = tmp_path / Path(src).name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(FOLDER))
    return str(dst)


def assert_same_run(a, b):
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, pd.DataFrame):
            assert same_frame(value, other), name
        elif name == "config":
            assert value.to_dict() == other.to_dict()
        else:
            assert value == other, name


def quiet_load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_run(path)


@pytest.mark.parametrize("index", range(4))
def test_every_recorded_run_loads_the_same_through_its_copy(tmp_path, index):
    path = copied(recorded_dirs()[index], tmp_path)
    first = quiet_load(path)  # from the lines, a rank file at a time; writes the copy
    assert read_copy(path) is not None
    again = quiet_load(path)  # from the copy
    assert_same_run(first, again)
    whole, _ = run_mod._from_lines(path, by_file=False)  # every rank file's rows at once, as pandas types them
    assert_same_run(first, whole)
    assert sorted(COPIED) == sorted(n for n, v in vars(first).items() if isinstance(v, pd.DataFrame))


def test_a_stale_copy_is_rebuilt_from_the_lines(tmp_path):
    path = copied(FIXTURES / "run-v1-ddp", tmp_path)
    before = quiet_load(path)
    with open(os.path.join(path, "events", "rank1.jsonl"), "a") as f:  # a line written after the copy
        f.write(
            json.dumps({"kind": "step", "rank": 1, "step": 99, "t_fwd": 0.1, "t_bwd": 0.1, "t_opt": 0.1, "t_step": "x"})
            + "\n"
        )
    assert read_copy(path) is None
    after = quiet_load(path)
    assert len(after.damage) == len(before.damage) + 1  # reported from the lines, not the stale copy
    assert read_copy(path) is not None and len(quiet_load(path).damage) == len(after.damage)


def test_a_changed_byte_of_the_same_size_is_seen(tmp_path):
    path = copied(FIXTURES / "run-v1-ddp", tmp_path)
    quiet_load(path)
    f = Path(path) / "events" / "rank0.jsonl"
    data = f.read_bytes()
    i = data.index(b'"loss": ') + len(b'"loss": ')
    digit = b"1" if data[i : i + 1] != b"1" else b"2"
    f.write_bytes(data[:i] + digit + data[i + 1 :])
    assert read_copy(path) is None
    run = quiet_load(path)
    assert_same_run(run, run_mod._from_lines(path)[0])


@pytest.mark.parametrize("damage", ["flip", "truncate", "index", "version", "missing"])
def test_a_damaged_or_foreign_copy_is_never_trusted(tmp_path, damage):
    path = copied(FIXTURES / "run-v1-pp", tmp_path)
    good = quiet_load(path)
    folder = Path(path) / FOLDER
    steps = folder / "steps.arrow"
    if damage == "flip":
        data = bytearray(steps.read_bytes())
        data[len(data) // 2] ^= 0xFF
        steps.write_bytes(bytes(data))
    elif damage == "truncate":
        steps.write_bytes(steps.read_bytes()[:-100])
    elif damage == "index":
        (folder / INDEX).write_text("{oops")
    elif damage == "version":
        index = json.loads((folder / INDEX).read_text())
        (folder / INDEX).write_text(json.dumps({**index, "columns_version": index["columns_version"] + 1}))
    else:
        steps.unlink()
    assert read_copy(path) is None
    assert_same_run(good, quiet_load(path))
    assert read_copy(path) is not None  # rebuilt


def test_damaged_lines_are_reported_the_same_through_the_copy(tmp_path):
    path = copied(FIXTURES / "run-v1-ddp", tmp_path)
    f = Path(path) / "events" / "rank0.jsonl"
    lines = f.read_bytes().split(b"\n")
    f.write_bytes(b"\n".join(lines[:3] + [b"{not json", b""] + lines[3:-1]) + b'\n{"kind": "do')
    with pytest.warns(RunDamageWarning) as caught:
        first = load_run(path)
    with pytest.warns(RunDamageWarning) as again:
        second = load_run(path)
    assert read_copy(path) is not None
    assert [str(w.message) for w in caught] == [str(w.message) for w in again]
    assert_same_run(first, second)
    assert list(first.damage["tolerated"]) == [False, True]  # the bad line (the empty one after it is its own)


def test_columns_typed_differently_in_two_rank_files_give_the_frame_of_all_rows(tmp_path):
    """A field that is an integer in one rank's file and missing or null in the other's: pandas types the column
    from every row at once, and so does load_run."""
    path = copied(FIXTURES / "run-v1-ddp", tmp_path)
    for r, extra in ((0, 3), (1, None)):
        f = Path(path) / "events" / f"rank{r}.jsonl"
        evs = [json.loads(line) for line in f.read_text().splitlines()]
        evs = [{**e, "extra": extra} if e["kind"] == "step" else e for e in evs]
        f.write_text("".join(json.dumps(e) + "\n" for e in evs))
    run = quiet_load(path)
    assert run.steps["extra"].dtype == "float64" and run.steps["extra"].isna().any()
    assert_same_run(run, run_mod._from_lines(path, by_file=False)[0])


def test_a_running_run_gets_no_copy(tmp_path, monkeypatch):
    path = copied(FIXTURES / "run-v1-ddp", tmp_path)
    monkeypatch.setattr(run_mod, "settle_status", lambda rec: None)
    real = run_mod.read_run_dir

    def running(*a, **k):
        rec = real(*a, **k)
        rec.status = {"state": "running"}
        return rec

    monkeypatch.setattr(run_mod, "read_run_dir", running)
    assert quiet_load(path).status["state"] == "running"
    assert not (Path(path) / FOLDER).exists()
