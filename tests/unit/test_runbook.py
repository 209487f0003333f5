"""The GPU runbook (tools/gpu_runbook.py, tools/gpu_wheels.py): its wheel-folder check, its limits (each
command under 600 s, small flat output folders, a summary rewritten after every step), and a whole dry run of
its parts on this CPU machine."""

import json
import os
import subprocess
import sys
import tarfile

import pytest
from runbook_tools import ROOT, TOOLS, _fake_folder, _load, _wheel, runbook, wheels  # noqa: F401


def test_runbook_sets_its_path_before_any_step():
    """Importing the runbook (here with the checkout taken off sys.path first) puts dtlab's checkout on the path:
    a failed main job can no longer leave the later steps without dtlab's loaders."""
    assert str(ROOT) in sys.path and str(TOOLS) in sys.path


def test_wheel_check_accepts_a_complete_folder(tmp_path):
    res = wheels.check_wheels(str(_fake_folder(tmp_path)))
    assert res["ok"], res["problems"]


def test_wheel_check_names_each_problem(tmp_path):
    folder = _fake_folder(tmp_path)
    next(folder.glob("hjson-*.whl")).unlink()  # missing
    _wheel(folder, "plotly", "6.0.0")  # a second version
    _wheel(folder, "mystery", "1.0", requires=["not-on-the-gpu-machine>=1"])  # unmet requirement
    _wheel(folder, "fastpkg", "1.0", tag="cp311-cp311-manylinux_2_17_x86_64")  # wrong Python
    _wheel(folder, "armpkg", "1.0", tag="py3-none-manylinux_2_17_aarch64")  # wrong machine
    _wheel(folder, "nvidia-nccl-cu13", "2.30.1", tag="py3-none-manylinux_2_17_x86_64")  # would shadow torch's
    problems = "\n".join(wheels.check_wheels(str(folder))["problems"])
    assert "hjson==3.1.0: missing" in problems
    assert "plotly: two wheels" in problems
    assert "not-on-the-gpu-machine (needed by mystery)" in problems
    assert "fastpkg-1.0-cp311" in problems and "aarch64" in problems
    assert "shadow the machine's torch stack" in problems
    assert "pywin32" not in problems  # markers are evaluated for Linux x86-64, CPython 3.12


def test_wheel_check_reads_version_specifiers(tmp_path):
    """pydantic 2.13 needs typing-extensions >= 4.14.1: a folder carrying an older one is refused by name."""
    folder = _fake_folder(tmp_path)
    next(folder.glob("typing_extensions-*.whl")).unlink()
    _wheel(folder, "typing-extensions", "4.12.2")
    problems = "\n".join(wheels.check_wheels(str(folder))["problems"])
    assert "typing-extensions>=4.14.1 (needed by pydantic; the folder has 4.12.2)" in problems


def test_abi3_wheels_for_older_pythons_are_accepted(tmp_path):
    folder = _fake_folder(tmp_path)
    next(folder.glob("tornado-*.whl")).unlink()
    _wheel(folder, "tornado", "6.6.1", tag="cp311-abi3-manylinux_2_28_x86_64")
    assert wheels.check_wheels(str(folder))["ok"]


def test_the_session_fits_its_900_seconds():
    """Two commands at most, each budget with margin under the 600 s command limit, and the machine's start plus both
    commands (each its budget and margin) within the session's 900 s; a budget too big for it is refused."""
    assert list(runbook.PARTS) == ["proof", "labs"] and runbook.ALIASES == {"suite": "proof"}
    assert all(b <= runbook.COMMAND_LIMIT_S - 60 for b in runbook.BUDGETS.values())
    plan = runbook.session_plan()
    total = runbook.START_S + sum(b + runbook.CALL_MARGIN_S for b in runbook.BUDGETS.values())
    assert plan["fits"] and plan["total_s"] == total <= runbook.SESSION_S == 900
    assert [c["part"] for c in plan["commands"]] == ["proof", "labs"]
    assert not runbook.session_plan({"labs": runbook.BUDGETS["labs"] + 1})["fits"]  # over 900 s with the start
    long_call = runbook.session_plan({"proof": runbook.COMMAND_LIMIT_S - 10, "labs": 100})
    assert long_call["total_s"] <= runbook.SESSION_S and not long_call["fits"]  # one command over its 600 s
    assert all(
        runbook.STEP_CAP[s] <= runbook.BUDGETS[p] - runbook.RESERVE_S for p, ss in runbook.PARTS.items() for s in ss
    )
    assert runbook.step_timeout(240, 540) == 240 and runbook.step_timeout(240, 100) == 90
    assert runbook.step_timeout(240, runbook.MIN_STEP_S + runbook.RESERVE_S - 1) is None


def test_the_proof_puts_the_most_valuable_first():
    """The NCCL proof before any step; DDP, ZeRO-3, the calibration, the strategies, the model's error (after both
    the main job and the calibration it prices with) and the overhead in that order; the doctor and the rest of the
    GPU suite last; the labs only in the second command, and measured nowhere else."""
    proof = list(runbook.PARTS["proof"])
    assert proof[0] == "nccl-proof" and runbook.OPTIONAL["nccl-proof"] == "nccl"
    order = ["main-job", "zero3", "calibrate", "strategies", "model-error", "overhead", "doctor", "gpu-suite"]
    assert [s for s in proof if s in order] == order and proof[-2:] == ["doctor", "gpu-suite"]
    assert proof.index("install") < proof.index("main-job")
    assert runbook.PARTS["labs"] == ("install", "labs") and "labs" not in proof
    assert set(runbook.Runbook.STRATEGY_TESTS) == {
        "tests/gpu/test_gpu_strategies.py",
        "tests/gpu/test_gpu.py::test_convergence_levers_on_cuda",  # local SGD
    }
    assert all((ROOT / t.split("::")[0]).exists() for t in runbook.Runbook.STRATEGY_TESTS)


def test_steps_are_planned_at_their_record_or_cap_and_the_rest_left_over():
    """A step with a GPU record is planned at it, one without at its cap (saying so); a step that does not fit what is
    left (with RESERVE_S kept back) is left over with its planned seconds, and a later, shorter one still fits."""
    steps = ["nccl-proof", "main-job", "gpu-suite", "doctor"]
    records = {"main-job": {"seconds": 21.4, "record": "h200"}, "doctor": {"seconds": 7.3, "record": "h200"}}
    budget = runbook.STEP_CAP["nccl-proof"] + 21.4 + 7.3 + runbook.RESERVE_S + 1
    plan = runbook.plan_steps(steps, budget, records)
    assert [r["step"] for r in plan["steps"]] == ["nccl-proof", "main-job", "doctor"]
    assert plan["steps"][0] == {
        "step": "nccl-proof",
        "planned_s": runbook.STEP_CAP["nccl-proof"],
        "from": "no GPU record: its cap",
    }
    assert plan["steps"][1]["from"] == "the slowest GPU record (h200)" and plan["steps"][1]["planned_s"] == 21.4
    assert plan["left_over"] == [
        {"step": "gpu-suite", "planned_s": runbook.STEP_CAP["gpu-suite"], "from": "no GPU record: its cap"}
    ]
    assert plan["left_over_s"] == runbook.STEP_CAP["gpu-suite"]
    assert plan["planned_s"] + runbook.RESERVE_S <= budget
    assert sum(r["planned_s"] for r in plan["steps"] + plan["left_over"]) == pytest.approx(
        plan["planned_s"] + plan["left_over_s"]
    )  # nothing dropped


def test_labs_not_judged_on_time_run_side_by_side_first_and_the_rest_alone():
    planned = {
        "00_a.ipynb": 30.0,  # timed (lab00.sizes)
        "02_b.ipynb": 20.0,  # no claims: side by side
        "04_c.ipynb": 40.0,  # no claims: side by side
        "03_d.ipynb": 90.0,  # timed, too long for what is left
        "05_e.ipynb": 25.0,  # timed, fits after 03 was left over
    }
    sched = runbook.lab_schedule(planned, 100)
    assert [b["labs"] for b in sched["batches"]] == [["02_b.ipynb", "04_c.ipynb"], ["00_a.ipynb"], ["05_e.ipynb"]]
    assert sched["batches"][0]["side_by_side"] and sched["batches"][0]["planned_s"] == 40.0  # its slowest lab
    assert [b["starts_at_s"] for b in sched["batches"]] == [0.0, 40.0, 70.0] and sched["planned_s"] == 95.0
    assert sched["left_over_labs"] == {"03_d.ipynb": 90.0} and sched["left_over_s"] == 90.0
    ran = [n for b in sched["batches"] for n in b["labs"]]
    assert sorted(ran + list(sched["left_over_labs"])) == sorted(planned)  # every lab once: run or written down
    assert runbook.lab_schedule(planned, 10)["batches"] == []  # nothing fits: all written down
    assert runbook.lab_schedule(planned, 10)["left_over_s"] == sum(planned.values())


def test_every_claim_a_lab_prints_is_classified():
    """A lab runs alone when one of its claims is about time: every claim id in dtlab/course/claims is classified
    (a new one must be), and the labs without a claim about time are the ones run side by side."""
    import re

    found = set()
    for f in (ROOT / "dtlab" / "course" / "claims").glob("lab*.py"):
        found |= set(re.findall(r'"(lab\d\d\.[a-z_0-9]+)"', f.read_text()))
    assert found == set(runbook.CLAIM_KINDS)
    assert runbook.TIMED_LABS == {"00", "01", "03", "05", "06", "07", "08", "09", "10", "12"}
    labs = sorted(p.name[:2] for p in (ROOT / "labs").glob("*.ipynb"))
    assert [n for n in labs if n not in runbook.TIMED_LABS] == ["02", "04", "11"]


def test_each_invocation_gets_a_new_work_folder(tmp_path, monkeypatch):
    """Without --work, each invocation of a part works in a new folder under TMP/dtlab-gpu-work: with the old fixed
    TMP/dtlab-gpu-work/PART, a second run of a part on the same machine failed at its first run ("already holds a
    run"). A --work given is used as it is."""
    import types

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    args = types.SimpleNamespace(
        dry_run=True,
        out=str(tmp_path / "out"),
        work=None,
        site=str(tmp_path / "site"),
        budget=60,
        wheels=str(tmp_path / "whl"),
    )
    first, second = (runbook.Runbook("labs", args).work for _ in range(2))
    assert first != second and os.path.dirname(first) == os.path.dirname(second) == str(tmp_path / "dtlab-gpu-work")
    assert all(os.path.basename(w).startswith("labs-") and os.path.isdir(w) for w in (first, second))
    args.work = str(tmp_path / "mine")
    assert runbook.Runbook("suite", args).work == args.work
    args.work, args.site = None, str(tmp_path / "out" / "site")
    with pytest.raises(SystemExit, match="inside --out"):
        runbook.Runbook("suite", args)
    assert len(list((tmp_path / "dtlab-gpu-work").iterdir())) == 2  # a refused invocation makes no work folder


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


def test_the_nccl_folder_is_decompressed_and_checked(tmp_path):
    src = _nccl_source(tmp_path, b"not really a library, but its sha256 is what is checked")
    res = nccl_prepare.prepare(str(src), str(tmp_path / ".nccl"))
    assert res["ok"] and not res["decompressed"] and res["path"] == str(tmp_path / ".nccl" / "libnccl.so.2")
    assert (tmp_path / ".nccl" / "libnccl.so.2.sha256").read_text() == (src / "libnccl.so.2.sha256").read_text()
    (tmp_path / ".nccl" / "libnccl.so.2").write_bytes(b"tampered")
    bad = nccl_prepare.ready(str(tmp_path / ".nccl"))
    assert not bad["ok"] and "sha256" in bad["problems"][0] and "libnccl.so.2.sha256 says" in bad["problems"][0]
    carried = nccl_prepare.prepare(str(src), str(tmp_path / "carried"), xz_only=True)  # the .xz travels
    assert carried["ok"] and sorted(os.listdir(tmp_path / "carried")) == ["libnccl.so.2.sha256", "libnccl.so.2.xz"]
    there = nccl_prepare.ready(str(tmp_path / "carried"))  # on the GPU machine: decompressed, then checked
    assert there["ok"] and there["decompressed"] and (tmp_path / "carried" / "libnccl.so.2").exists()
    (tmp_path / "empty").mkdir()
    assert "no libnccl.so.2.sha256" in nccl_prepare.ready(str(tmp_path / "empty"))["problems"][0]


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


def test_every_step_gets_the_nccl_library_only_when_it_checks_out(tmp_path, monkeypatch):
    monkeypatch.delenv("DTLAB_NCCL_LIBRARY", raising=False)
    src = _nccl_source(tmp_path, b"payload")
    nccl_prepare.prepare(str(src), str(tmp_path / ".nccl"), xz_only=True)
    rb = runbook.Runbook("labs", _args(tmp_path, nccl=str(tmp_path / ".nccl")))
    assert rb.env["DTLAB_NCCL_LIBRARY"] == str(tmp_path / ".nccl" / "libnccl.so.2") and rb.summary["nccl"]["ok"]
    (tmp_path / ".nccl" / "libnccl.so.2").write_bytes(b"another payload")  # a wrong library is never named
    rb = runbook.Runbook("suite", _args(tmp_path, nccl=str(tmp_path / ".nccl"), work=str(tmp_path / "w2")))
    assert "DTLAB_NCCL_LIBRARY" not in rb.env and not rb.summary["nccl"]["ok"]
    assert not rb.nccl_proof(60) and "sha256" in rb.summary["steps"]["nccl-proof"]["problems"][0]
    plain = runbook.Runbook("suite", _args(tmp_path, work=str(tmp_path / "w3")))
    assert "DTLAB_NCCL_LIBRARY" not in plain.env and plain.nccl is None


def test_proof_counts_the_nccl_folder_as_carried_and_labs_carries_nothing(tmp_path, monkeypatch):
    """On the GPU machine proof's NCCL folder holds the carried .xz and the library decompressed from it: only the
    .xz travelled, so only it counts against the 64 MiB (counting both failed the wheel step there). proof keeps the
    checked library in SITE/.dtlab-nccl; labs names it there, carries neither folder, and uses the installed site."""
    monkeypatch.delenv("DTLAB_NCCL_LIBRARY", raising=False)
    checkout = tmp_path / "checkout"  # what travels: the tree and the folders carried in it
    monkeypatch.setattr(runbook, "ROOT", str(checkout))
    monkeypatch.setattr(runbook, "tree_bytes", lambda root: 5 * 2**20)
    payload = bytes(range(256)) * 4096  # 1 MiB that xz shrinks to almost nothing
    nccl = checkout / ".nccl"
    nccl_prepare.prepare(str(_nccl_source(tmp_path, payload)), str(nccl), xz_only=True)
    site = tmp_path / "site"
    proof = runbook.Runbook("proof", _args(tmp_path, nccl=str(nccl), site=str(site)))
    assert proof.nccl["ok"] and proof.nccl["decompressed"]
    carried = proof.carried(0)
    xz = (nccl / "libnccl.so.2.xz").stat().st_size + (nccl / "libnccl.so.2.sha256").stat().st_size
    assert carried["nccl_bytes"] == xz < len(payload) and carried["ok"]
    monkeypatch.setattr(runbook, "tree_bytes", lambda root: runbook.TREE_MAX_BYTES - xz + 1)
    over = proof.carried(0)
    assert not over["ok"] and "--xz-only" in over["problem"]
    kept = site / ".dtlab-nccl"
    assert proof.nccl["kept"] == str(kept) and (kept / "libnccl.so.2").read_bytes() == payload
    (site / ".dtlab-wheels.json").write_text(json.dumps(["a-1.0-py3-none-any.whl"]))  # what proof installed
    args = _args(tmp_path, nccl=str(kept), site=str(site), work=str(tmp_path / "w2"), dry_run=False)
    args.wheels = str(tmp_path / "no-wheels-carried")
    labs = runbook.Runbook("labs", args)
    assert labs.nccl["ok"] and labs.env["DTLAB_NCCL_LIBRARY"] == str(kept / "libnccl.so.2")
    monkeypatch.setattr(runbook, "tree_bytes", lambda root: 5 * 2**20)
    assert labs.install(60) and "no wheel folder carried: 1 wheels" in labs.summary["steps"]["install"]["note"]
    assert labs.summary["steps"]["install"]["carried"] == {
        "tree_mib": 5.0, "wheels_mib": 0.0, "nccl_mib": 0.0, "travels_mib": 5.0, "tree_bytes": 5 * 2**20,
        "wheels_bytes": 0, "nccl_bytes": 0, "ok": True,
    }  # fmt: skip
    (site / ".dtlab-wheels.json").unlink()  # a fresh machine: nothing from proof
    cold = runbook.Runbook("labs", _args(tmp_path, site=str(site), work=str(tmp_path / "w3"), dry_run=False))
    cold.args.wheels = str(tmp_path / "no-wheels-carried")
    assert not cold.install(60) and "carry the wheel folder" in cold.summary["steps"]["install"]["error"]


def test_the_log_archive_stays_under_what_comes_back(tmp_path, monkeypatch):
    """logs.tar.gz takes the step logs first, then the runs' files, and stops before ARCHIVE_MAX_BYTES: what it left
    out is named in the summary (a file over 16 MiB would not come back at all)."""
    monkeypatch.setattr(runbook, "ARCHIVE_MAX_BYTES", 200_000)
    rb = runbook.Runbook("proof", _args(tmp_path))
    (tmp_path / "work" / "main-job.log").write_text("the step's log\n")
    runs = tmp_path / "work" / "first" / "events"
    runs.mkdir(parents=True)
    for k in range(4):
        (runs / f"rank{k}.jsonl").write_bytes(os.urandom(100_000))  # incompressible
    rb.write()
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "main-job.log" in names and 0 < len(names) - 1 < 4
    # under the cap but for tar's end blocks and gzip's trailer: a file is taken only if it fits uncompressed
    assert (tmp_path / "out" / "logs.tar.gz").stat().st_size <= 200_000 + 16_384
    left = rb.summary["archive_left_out"]
    assert left["files"] == 5 - len(names) and all(f.startswith("first/events/rank") for f in left["first"])


def test_a_step_the_plan_left_over_is_not_started_without_its_planned_time(tmp_path):
    """A step planned at more than what is left (its record says it will not finish) is written down as left
    over, not started to run out of time; the step before it runs."""
    rb = runbook.Runbook("proof", _args(tmp_path, budget=300))
    first, second = [s for s in runbook.PARTS["proof"] if s != "nccl-proof"][:2]
    started = []
    for name in (first, second):
        setattr(rb, name.replace("-", "_"), lambda timeout, name=name: started.append(name) or rb.record(name, True))
    rb.steps = lambda only=None: [first, second]
    rb.plan = lambda steps: {
        "steps": [{"step": first, "planned_s": 1.0, "from": "a record"}],
        "left_over": [{"step": second, "planned_s": 10_000.0, "from": "the slowest GPU record (x)"}],
    }
    assert rb.run() == 0 and started == [first]
    assert "planned 10000.0 s" in rb.summary["steps"][second]["left_over"] and rb.summary["steps"][second]["ok"]
