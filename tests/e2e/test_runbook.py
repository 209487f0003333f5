"""The GPU runbook (tools/gpu_runbook.py, tools/gpu_wheels.py): a whole dry run of its two commands on this CPU
machine within their limits (each under 600 s, small flat output folders, a summary with the plan rewritten after
every step), and a command run twice on the same machine."""

import json
import os
import re
import subprocess
import sys
import tarfile
import time

import pytest
from runbook_tools import ROOT, TOOLS, _fake_folder, _load, _wheel, runbook, wheels  # noqa: F401


def _part(part, tmp_path, wheel_dir, *extra):
    out, work = tmp_path / part / "out", tmp_path / part / "work"
    cmd = [
        sys.executable,
        str(TOOLS / "gpu_runbook.py"),
        part,
        "--dry-run",
        "--wheels",
        str(wheel_dir),
        "--out",
        str(out),
        "--work",
        str(work),
        "--site",
        str(tmp_path / "site"),
        *extra,
    ]
    return out, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1")
    )


def _fits(out):
    listing = runbook.out_listing(str(out))
    assert len(listing["files"]) <= runbook.MAX_FILES and listing["depth"] <= runbook.MAX_DEPTH, listing
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for f, _ in listing["files"] for part in f.split(os.sep))
    return {f for f, _ in listing["files"]}


@pytest.mark.parametrize("part", list(runbook.PARTS))
def test_dry_run_walks_each_part_within_the_limits(part, tmp_path):
    """Each of the runbook's two commands, dry-run on this CPU machine, one test per command (each is its own command
    on the GPU machine, under its limit): the plan first, every step in order, small flat files in --out."""
    wheel_dir = _fake_folder(tmp_path)
    steps = [s for s in runbook.PARTS[part] if s not in runbook.OPTIONAL]  # no --nccl here: no NCCL proof
    t0 = time.monotonic()
    out, proc = _part(part, tmp_path, wheel_dir)
    partial = set()
    while proc.poll() is None:  # the summary is rewritten after every step, not only at the end
        try:
            s = json.loads((out / "summary.json").read_text())
            partial.add(tuple(s["steps"]))
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    log = proc.stdout.read()
    wall = time.monotonic() - t0
    assert proc.returncode == 0, log[-3000:]
    assert wall < runbook.COMMAND_LIMIT_S, f"{part} took {wall:.0f} s"
    s = json.loads((out / "summary.json").read_text())
    assert s["dry_run"] and s["ok"] and list(s["steps"]) == list(steps) and s["planned"] == list(steps)
    assert all(v["ok"] for v in s["steps"].values())
    assert s["writes"] >= len(steps) + 2 and s["out_files"]["depth"] <= runbook.MAX_DEPTH
    assert s["limits"]["budget_s"] == runbook.BUDGETS[part] and s["plan"]["session"]["fits"]
    assert s["plan"]["planned_s"] + runbook.RESERVE_S <= runbook.BUDGETS[part]
    files = _fits(out)
    assert {"summary.json", "logs.tar.gz"} <= files
    assert all(size <= runbook.OUT_FILE_MAX_BYTES for _, size in s["out_files"]["files"])
    assert not (out / "site").exists() and not runbook._inside(s["work"], str(out))
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    if part == "proof":
        _check_proof(s, names, partial, files)
    else:
        _check_labs(s)


def _check_proof(s, names, partial, files):
    assert {"main-job.log", "zero3.log", "first/config.json", "zero3/config.json"} <= names
    assert ("wheels", "install", "deps", "main-job") in partial  # seen while zero3 ran
    assert set(s["calibration"]) >= {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(len(s["calibration"][op]["alpha_ci_us"]) == 2 for op in ("all_reduce", "reduce_scatter", "all_gather"))
    m = s["main_job"]
    assert m["bytes_per_rank_step"] == [m["grad_bytes"]] and m["T_step_ms"] > 0
    assert "gloo on CPU" in m["placement"]["label"] and m["bucket_timing"]["path"] == "wall"
    assert s["zero3"]["unfinished_collectives"] == 0
    from runbook_figures import ddp_figures

    figs, ok = ddp_figures(os.path.join(s["work"], "first"), nccl=True)  # asked for NCCL, given gloo on CPU
    assert not ok and figs["nccl_pairs"] == 0 and ddp_figures(os.path.join(s["work"], "first"))[1]
    assert s["model_error"]["steps"] > 0 and s["model_error"]["median_abs_t_step_error"] >= 0  # priced, on CPU
    for step, xml in (("strategies", "strategies-junit.xml"), ("gpu-suite", "gpu-junit.xml")):
        suite = s["steps"][step]
        assert xml in files and suite["tests"] >= 10 and suite["skipped"] == suite["tests"]  # no GPU here: all skip...
        assert all("CUDA" in r for r in suite["skip_reasons"])  # ...with a reason naming CUDA
    assert s["steps"]["wheels"]["carried"]["travels_mib"] < wheels.TREE_MAX_BYTES / 2**20
    assert "planned, not run" in s["overhead"]["note"]  # the overhead is measured on the GPU


def _check_labs(s):
    labs = s["steps"]["labs"]
    notebooks = sorted(p.name for p in (ROOT / "labs").glob("*.ipynb"))
    assert sorted(labs["planned"]) == notebooks and not labs["refused"]  # planned, none refused
    # each lab at its slowest clean GPU time, or at the per-lab cap where no record has one, saying which
    for p in labs["planned"].values():
        assert p["placed"] and 0 < p["planned_s"] <= runbook.LAB_CAP_S
        assert p["from"].startswith("the slowest clean record (") or (
            p["planned_s"] == runbook.LAB_CAP_S and p["from"].startswith("no clean GPU record")
        )
    ran = [n for b in labs["schedule"] for n in b["labs"]]
    assert sorted(ran + list(labs["left_over"])) == notebooks  # every lab scheduled or written down, once
    assert labs["left_over_s"] == pytest.approx(sum(labs["planned"][n]["planned_s"] for n in labs["left_over"]))
    assert labs["left_over"] == s["plan"]["left_over_labs"]  # the summary's plan says the same
    assert {p["what"] for p in labs["planned"]["04_zero3_vs_ddp.ipynb"]["placed"]} == {
        "ZeRO-3 run",
        "DDP run",
        "calibration",
    }


def test_each_lab_is_planned_at_its_slowest_clean_gpu_time():
    """An H100 was slower than the H200 for most labs: the plan takes the slower; a lab that crashed or was cut
    on a machine has no time from that machine (lab 10 crashed on the H200 after 21 s: not its time)."""
    from runbook_figures import recorded_lab_seconds

    got = recorded_lab_seconds()
    assert got["03_buckets_and_gpu_count.ipynb"]["record"].startswith("h100")  # 70 s there, 27 s on the H200
    assert "10_tensor_and_pipeline.ipynb" not in got


def test_a_part_runs_again_on_the_same_machine(tmp_path):
    """The same part twice in a row without --work (its first run step, the smallest): each invocation works in a
    new folder, so the second does not stop at "already holds a run" as it did with one fixed folder per part."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path))
    for i in (1, 2):
        cp = subprocess.run(
            [
                sys.executable,
                str(TOOLS / "gpu_runbook.py"),
                "suite",
                "--dry-run",
                "--steps",
                "main-job",
                "--out",
                str(tmp_path / f"out{i}"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-2000:]
        s = json.loads((tmp_path / f"out{i}" / "summary.json").read_text())
        assert s["ok"] and s["steps"]["main-job"]["ok"] and s["work"].startswith(str(tmp_path / "dtlab-gpu-work"))
    assert len(list((tmp_path / "dtlab-gpu-work").iterdir())) == 2
