"""The GPU runbook's parts run as processes on this CPU machine (tools/gpu_runbook.py): the default plan, a part that
runs out of budget, refused sites and wheel folders, the nccl-proof step's dry run and the labs step with a stand-in
lab. The runbook's pure rules are tested in tests/unit/test_runbook.py."""

import json
import os
import subprocess
import sys

import pytest
from runbook_tools import ROOT, TOOLS, _fake_folder, _load, _wheel, runbook, wheels  # noqa: F401


def test_wheel_folder_over_its_size_limit_is_refused(tmp_path, monkeypatch):
    folder = _fake_folder(tmp_path)
    monkeypatch.setattr(wheels, "WHEELS_MAX_BYTES", 1000)
    assert any("more than 0 MiB" in p or "MiB of wheels" in p for p in wheels.check_wheels(str(folder))["problems"])
    assert wheels.WHEELS_MAX_BYTES < wheels.TREE_MAX_BYTES - wheels.tree_bytes(str(ROOT))


def test_the_default_plan_writes_down_what_does_not_fit(tmp_path):
    """`plan`: both commands planned on this machine from the records; every lab is in a batch or written down with
    its planned seconds (its record, or the cap where it has none), and each command's plan fits its budget."""
    cp = subprocess.run(
        [sys.executable, str(TOOLS / "gpu_runbook.py"), "plan", "--site", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    plans = json.loads(cp.stdout)
    for part, plan in plans.items():
        assert plan["session"]["fits"] and plan["planned_s"] + runbook.RESERVE_S <= runbook.BUDGETS[part]
        assert [r["step"] for r in plan["steps"] + plan["left_over"]] == [
            s for s in runbook.PARTS[part] if s not in runbook.OPTIONAL
        ]
    labs = next(r for r in plans["labs"]["steps"] if r["step"] == "labs")["labs"]
    notebooks = sorted(p.name for p in (ROOT / "labs").glob("*.ipynb"))
    ran = [n for b in labs["batches"] for n in b["labs"]]
    assert sorted(ran + list(labs["left_over_labs"])) == notebooks and len(set(ran)) == len(ran)
    assert labs["planned_s"] <= labs["budget_s"] and labs["left_over_labs"] == plans["labs"]["left_over_labs"]
    assert all(0 < s <= runbook.LAB_CAP_S for s in labs["left_over_labs"].values())
    assert labs["batches"][0]["side_by_side"] and all(not b["side_by_side"] for b in labs["batches"][1:])


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


def test_a_part_that_runs_out_of_budget_skips_steps_and_says_so(tmp_path):
    out, proc = _part("suite", tmp_path, _fake_folder(tmp_path), "--budget", "25")  # the old name of proof
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, log
    s = json.loads((out / "summary.json").read_text())
    assert s["part"] == "proof" and not s["ok"]
    assert all("budget: not started" in v["skipped"] for v in s["steps"].values())
    plan = s["plan"]  # the plan is written first, every step in it: planned or left over with its seconds
    assert plan["budget_s"] == 25 and "main-job" in [r["step"] for r in plan["left_over"]]
    assert [r["step"] for r in plan["steps"] + plan["left_over"]] != [] and {
        r["step"] for r in plan["steps"] + plan["left_over"]
    } == set(runbook.PARTS["proof"]) - {"nccl-proof"}


def test_site_inside_out_is_refused(tmp_path):
    cp = subprocess.run(
        [
            sys.executable,
            str(TOOLS / "gpu_runbook.py"),
            "suite",
            "--dry-run",
            "--out",
            str(tmp_path),
            "--site",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode != 0 and "inside --out" in cp.stderr


def test_missing_wheel_folder_fails_with_a_reason(tmp_path):
    cp = subprocess.run(
        [sys.executable, str(TOOLS / "gpu_runbook.py"), "check-wheels", "--wheels", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 1 and "make_gpu_wheels.sh" in cp.stdout


nccl_prepare = _load("nccl_prepare")


def _nccl_source(tmp_path, payload: bytes | None = None):
    """A source folder as the shared NCCL build's: libnccl.so.2.xz and the decompressed library's sha256. Without
    `payload`, the library is a fake libnccl compiled here whose ncclGetVersion says 23007 (2.30.7)."""
    import hashlib
    import lzma
    import shutil

    src = tmp_path / "shared-nccl"
    src.mkdir()
    if payload is None:
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            pytest.skip("no C compiler (cc or gcc) to build a fake libnccl")
        (src / "nccl.c").write_text("int ncclGetVersion(int *v){*v=23007;return 0;}\n")
        lib = src / "built.so"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src / "nccl.c")], check=True)
        payload = lib.read_bytes()
    (src / "libnccl.so.2.xz").write_bytes(lzma.compress(payload))
    (src / "libnccl.so.2.sha256").write_text(f"{hashlib.sha256(payload).hexdigest()}  libnccl.so.2\n")
    return src


def _args(tmp_path, **kw):
    import types

    base = dict(
        dry_run=True,
        out=str(tmp_path / "out"),
        work=str(tmp_path / "work"),
        site=str(tmp_path / "site"),
        budget=60,
        wheels=str(tmp_path / "whl"),
        nccl=None,
    )
    return types.SimpleNamespace(**{**base, **kw})


def test_dry_run_proves_which_nccl_two_ranks_load(tmp_path):
    """The suite's nccl-proof step on this CPU machine: both ranks loaded the --nccl library (ncclGetVersion 23007,
    the file itself, checked as dtlab's ranks check it) and said that CUDA was skipped; without --nccl the step is
    not planned."""
    src = _nccl_source(tmp_path)
    nccl_prepare.prepare(str(src), str(tmp_path / ".nccl"))
    out, proc = _part("suite", tmp_path, tmp_path / "whl", "--nccl", str(tmp_path / ".nccl"), "--steps", "nccl-proof")
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, log
    s = json.loads((out / "summary.json").read_text())
    assert s["planned"] == ["nccl-proof"] and s["steps"]["nccl-proof"]["ok"]
    proof = s["nccl_proof"]
    lib = str(tmp_path / ".nccl" / "libnccl.so.2")
    assert proof["ok"] and [r["rank"] for r in proof["ranks"]] == [0, 1]
    for r in proof["ranks"]:
        assert r["loaded"]["code"] == 23007 and r["loaded"]["path"] == lib and r["loaded"]["version"] == "2.30.7"
        assert r["check"] == "the loaded library is the one preloaded" and r["cuda"].startswith("skipped")
    out2, proc = _part("labs", tmp_path, tmp_path / "whl", "--steps", "nccl-proof")
    proc.communicate(timeout=120)
    assert json.loads((out2 / "summary.json").read_text())["planned"] == []


FAKE_LAB = """import json, os, sys, time
where = sys.argv[2]
t0 = time.time()
time.sleep(1.5)
with open(os.path.join(os.path.dirname(os.path.dirname(where)), "times.jsonl"), "a") as f:
    f.write(json.dumps({"lab": os.path.basename(where)[:2], "start": t0, "end": time.time()}) + "\\n")
sys.exit(1 if os.path.basename(where).startswith("04") else 0)
"""


def test_labs_run_in_their_batches_and_the_rest_is_written_down(tmp_path, monkeypatch):
    """The labs step at work, with a stand-in for tools/run_notebook.py: the side-by-side batch's labs overlap, a
    timed lab starts only when they have all ended, a failing lab fails the step with its log, and the lab the
    plan left over is in labs.json and the summary with its planned seconds, not started."""
    fake = tmp_path / "tools"
    fake.mkdir()
    (fake / "run_notebook.py").write_text(FAKE_LAB)
    monkeypatch.setattr(runbook, "HERE", str(fake))
    rb = runbook.Runbook("labs", _args(tmp_path, dry_run=False, budget=100))
    rb._lab_plan = {
        n: {"placed": [], "cap_s": runbook.LAB_CAP_S, "planned_s": s, "from": "a test"}
        for n, s in {"02_b.ipynb": 20, "04_c.ipynb": 20, "11_d.ipynb": 20, "00_a.ipynb": 20, "03_e.ipynb": 500}.items()
    }
    assert not rb.labs(60)  # lab 04 exits 1
    times = {}
    for line in (tmp_path / "work" / "times.jsonl").read_text().splitlines():
        t = json.loads(line)
        times[t["lab"]] = t
    assert sorted(times) == ["00", "02", "04", "11"]  # 03 not started
    batch = [times[k] for k in ("02", "04", "11")]
    assert max(t["start"] for t in batch) < min(t["end"] for t in batch)  # all three ran at once
    assert times["00"]["start"] >= max(t["end"] for t in batch)  # the timed lab alone, after them
    step = rb.summary["steps"]["labs"]
    assert step["failed"] == ["04_c.ipynb"] and step["left_over"] == {"03_e.ipynb": 500} and step["left_over_s"] == 500
    labs = json.loads((tmp_path / "out" / "labs.json").read_text())
    assert labs["03_e.ipynb"]["planned_s"] == 500 and "not started" in labs["03_e.ipynb"]["left_over"]
    assert labs["02_b.ipynb"]["beside"] == ["04_c.ipynb", "11_d.ipynb"] and labs["00_a.ipynb"]["beside"] == []
    assert labs["04_c.ipynb"]["rc"] == 1 and "log_tail" in labs["04_c.ipynb"] and labs["00_a.ipynb"]["rc"] == 0
