"""Runs recorded on one NVIDIA H200 and shipped in the package (dtlab.results.recorded): each loads on a CPU with
dtlab's own loaders and gives the figures the record states (to their printed rounding), with its provenance; the
files ship as package data; the labs' tables set them beside a CPU run (dtlab.course.beside)."""

import dataclasses
import fnmatch
import json
import os
import pathlib
import re
import tarfile

import pytest

import dtlab
from dtlab.results import recorded

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(recorded.CACHE_ENV, str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """Both recorded runs, extracted and loaded once for the module (ZeRO-3's events take about a second)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(recorded.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        return {name: dtlab.recorded_run(name) for name in ("h200-ddp", "h200-zero3")}


def near(value, printed: float, decimals: int) -> bool:
    """`value` prints as `printed` with `decimals` decimals (half a unit of the last printed digit either way)."""
    return abs(value - printed) <= 0.5 * 10**-decimals + 1e-9


def test_the_ddp_run_gives_the_figures_the_record_states(shipped):
    """README main job on the H200: T_step 122.0 ms, T_comp 22.3 ms, T_comm 108.8 ms, exposed 99.8 ms, overlap 0.08,
    7 buckets a step, 267,820,040 B a rank-step; read by dtlab.load_run from the extracted directory."""
    rec = shipped["h200-ddp"]
    run = dtlab.load_run(rec.run.path)  # the public loader, on the directory as extracted
    s = run.summary().set_index("quantity")["value"] * 1e3
    assert near(s["T_step"], 122.0, 1) and near(s["T_comp"], 22.3, 1) and near(s["T_comm"], 108.8, 1)
    assert near(s["exposed"], 99.8, 1) and near(s["overlap"] / 1e3, 0.08, 2)
    steady = run.buckets[run.buckets["step"] >= run.warmup].groupby(["rank", "step"])["nbytes"]
    assert set(steady.size()) == {7} and set(steady.sum()) == {267_820_040} == {run.resolved["grad_bytes"]}
    assert run.status["state"] == "finished" and not run.warnings and run.baseline_steps["step"].nunique() == 3
    figs = recorded.run_figures(rec.run)
    assert figs["calls_per_rank_step"] == 7 and figs["bytes_per_rank_step"] == 267_820_040
    assert near(figs["T_step_ms"], 122.0, 1)


def test_the_zero3_run_gives_the_figures_the_record_states(shipped):
    """ZeRO-3 on the H200: reduce-scatter 267,820,040 B a rank-step (= expected), forward all-gather 267,565,056 B,
    T_step 832 ms, T_comp 383 ms, T_comm 727 ms, exposed 433 ms."""
    run = shipped["h200-zero3"].run
    c = run.collectives[run.collectives["step"] >= run.warmup]
    per = c.groupby(["phase", "op"])["nbytes"].sum() / (c["step"].nunique() * run.nproc)
    assert per[("backward", "reduce_scatter")] == 267_820_040 == run.resolved["expected_reduce_scatter_bytes_per_step"]
    assert per[("forward", "all_gather")] == 267_565_056
    s = run.summary().set_index("quantity")["value"] * 1e3
    assert near(s["T_step"], 832, 0) and near(s["T_comp"], 383, 0) and near(s["T_comm"], 727, 0)
    assert near(s["exposed"], 433, 0)
    assert run.status["state"] == "finished" and not run.warnings and c["t_end"].notna().all()


def test_the_calibration_gives_alpha_and_bus_bandwidth_as_recorded():
    """all_reduce alpha 175 us and bus bandwidth 2.30 GB/s (ring, 2 ranks), through dtlab's cost model; the Profile
    prices with them, and says it holds fits without samples."""
    cal = dtlab.recorded_calibration("h200-calibration")
    ar = cal.profile.fits["all_reduce"]
    assert near(ar.alpha * 1e6, 175, 0) and near(recorded.bus_bandwidth(ar, 2) / 1e9, 2.30, 2)
    rs, ag = cal.profile.fits["reduce_scatter"], cal.profile.fits["all_gather"]
    assert near(rs.alpha * 1e6, 507, 0) and near(recorded.bus_bandwidth(rs, 2) / 1e9, 1.12, 2)
    assert near(ag.alpha * 1e6, 296, 0) and near(recorded.bus_bandwidth(ag, 2) / 1e9, 0.56, 2)
    n = 32 * 2**20  # ring all-reduce at p = 2: 2 alpha + n beta
    assert cal.profile.predict("all_reduce", n, 2) == pytest.approx(2 * ar.alpha + n * ar.beta)
    assert cal.profile.samples.empty and any("did not come back" in c for c in cal.profile.caveats)
    assert cal.profile.meta["device_type"] == "cuda" and list(cal.figures["op"]) == sorted(cal.profile.fits)


def test_every_shipped_record_says_where_when_and_on_what(shipped):
    table = dtlab.recorded_runs()
    assert list(table["name"]) == ["h200-ddp", "h200-zero3", "h200-calibration"]
    for rec in shipped.values():
        p = rec.provenance
        assert p["placement"] == "gloo on CUDA tensors, 2 ranks on 1 GPU" and p["recorded"] == "2026-11-26"
        assert p["versions"]["torch"] == rec.run.resolved["versions"]["torch"] == "2.11.0+cu130"
        assert p["versions"]["python"] == rec.run.resolved["versions"]["python"] == "3.12.3"
        assert p["dtlab_commit"].startswith("2e4fb63") and "random weights" in p["random_init"]
        assert "random init" in rec.run.resolved["model_source"] and rec.run.resolved["devices"] == ["NVIDIA H200"]
        assert "H200" in rec.label() and "2026-11-26" in rec.label()
    # the record has every lab of its day (00-10); a lab written since is not in it, and nothing else is
    labs = {p.name for p in (ROOT / "labs").glob("[0-9][0-9]_*.ipynb")}
    assert set(recorded.lab_record()) == {n for n in labs if n[:2] <= "10"}
    with pytest.raises(ValueError, match="recorded runs: h200-ddp, h200-zero3"):
        dtlab.recorded_run("h100-ddp")


def test_every_recorded_file_ships_as_package_data():
    """pyproject's package-data globs match every file of the recorded sets (a file they miss would be absent
    from an installed dtlab), and every file provenance.json names exists."""
    section = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1]
    globs = json.loads(re.search(r'^"dtlab\.results" = (\[.*?\])', section, re.M).group(1))
    base = pathlib.Path(recorded.DATA).parent
    files = [p.relative_to(base).as_posix() for p in pathlib.Path(recorded.DATA).rglob("*") if p.is_file()]
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), files
    total = sum(os.path.getsize(base / f) for f in files)
    assert total < 1_000_000, f"the recorded sets take {total:,} B"
    for set_dir in pathlib.Path(recorded.DATA).iterdir():
        prov = recorded._sets()[set_dir.name]
        named = [
            e[k]
            for kind in ("runs", "calibrations")
            for e in prov[kind].values()
            for k in ("archive", "console", "file")
            if k in e
        ] + [prov["labs"]["file"]]
        assert all((set_dir / n).is_file() for n in named), named


def test_a_run_is_extracted_once_and_again_when_damaged(tmp_path):
    first = dtlab.recorded_run("h200-ddp").run.path
    assert first.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(first, "events", "rank0.jsonl"))
    mtime = os.path.getmtime(os.path.join(first, "config.json"))
    assert dtlab.recorded_run("h200-ddp").run.path == first
    assert os.path.getmtime(os.path.join(first, "config.json")) == mtime  # reused, not extracted again
    for p in (pathlib.Path(first) / "events").iterdir():
        p.unlink()
    (pathlib.Path(first) / "events").rmdir()
    assert dtlab.recorded_run("h200-ddp").run.summary().set_index("quantity").loc["T_step", "value"] > 0


def test_an_archive_with_a_path_outside_its_run_is_refused(tmp_path):
    bad = tmp_path / "set" / "bad.tar.gz"
    bad.parent.mkdir()
    (tmp_path / "evil").write_text("x")
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(tmp_path / "evil", arcname="run/../../evil")
    with pytest.raises(ValueError, match="unexpected member"):
        recorded.extract(str(bad), "run")
    assert not (tmp_path / "cache" / "evil").exists()


def _on_cpu(run):
    """The recorded run as if it had run on a CPU (the labs' tables show the record only beside CPU runs)."""
    placement = {"label": "gloo on CPU, 2 ranks", "device": "cpu"}
    return dataclasses.replace(run, resolved={**run.resolved, "device_type": "cpu", "placement": placement})


def test_the_labs_table_sets_a_cpu_run_beside_the_recorded_one(shipped):
    from dtlab.course.beside import beside, beside_calibration

    ddp, z3 = shipped["h200-ddp"].run, shipped["h200-zero3"].run
    text = beside({"DDP": _on_cpu(ddp), "ZeRO-3": _on_cpu(z3)})
    assert "The same job on one NVIDIA H200" in text and "gloo on CUDA tensors, 2 ranks on 1 GPU" in text
    assert "torch 2.11.0+cu130" in text and "2026-11-26" in text and "here:  gloo on CPU, 2 ranks" in text
    t_step = next(line for line in text.splitlines() if line.strip().startswith("T_step")).split()
    assert t_step[1:] == ["122.0", "ms", "832.4", "ms", "122.0", "ms", "832.4", "ms"]
    assert "267,820,040" in text and "535,640,088" in text and "not the same job" not in text and "nan" not in text
    # the recording itself ran gloo on CUDA tensors: its own text says so, not "the real thing"
    assert beside(ddp).startswith("your runs ran on a GPU through gloo") and 'recorded_run("h200-ddp")' in beside(ddp)
    assert "real thing" not in beside(ddp)
    tiny = _on_cpu(dataclasses.replace(ddp, config=ddp.config.replace(model="tiny", out=ddp.config.out)))
    assert "not the same job (model tiny here, distilbert there)" in " ".join(beside(tiny).split())
    prof = dtlab.recorded_calibration().profile
    assert beside_calibration(prof).startswith("your calibration ran on GPUs")
    cpu = dataclasses.replace(prof, meta={**prof.meta, "device_type": "cpu", "placement": {"label": "gloo on CPU"}})
    text = beside_calibration(cpu)
    row = next(line for line in text.splitlines() if line.strip().startswith("all_reduce")).split()
    assert row[1:5] == ["174.7", "us", "174.7", "us"] and row[5:9] == ["2.3", "GB/s", "2.3", "GB/s"]
