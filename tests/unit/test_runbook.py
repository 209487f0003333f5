"""The GPU runbook (tools/gpu_runbook.py, tools/gpu_wheels.py): its wheel-folder check, its limits (each
command under 600 s, small flat output folders, a summary rewritten after every step), and a whole dry run of
its parts on this CPU machine."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


TOOLS = ROOT / "tools"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sys.path = [p for p in sys.path if p not in (str(ROOT), str(TOOLS))]
runbook = _load("gpu_runbook")  # puts the checkout and tools/ on sys.path itself, before any step
wheels = _load("gpu_wheels")


def _wheel(folder, name, version, requires=(), tag="py3-none-any"):
    fn = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
    with zipfile.ZipFile(fn, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return fn


def _fake_folder(tmp_path):
    """Every listed wheel, with requirements only on each other and on what the GPU machine has."""
    folder = tmp_path / "whl"
    folder.mkdir()
    for line in wheels.listed(str(TOOLS / "gpu-wheels.txt")):
        name, _, version = line.partition("==")
        reqs = ["torch", "numpy>=1.24", "hjson"] if name == "deepspeed" else []
        reqs += ["typing-extensions>=4.14.1"] if name == "pydantic" else []
        reqs += ['pywin32; sys_platform == "win32"']  # a marker that does not apply on Linux
        _wheel(folder, name, version, reqs)
    return folder


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


def test_wheel_folder_over_its_size_limit_is_refused(tmp_path, monkeypatch):
    folder = _fake_folder(tmp_path)
    monkeypatch.setattr(wheels, "WHEELS_MAX_BYTES", 1000)
    assert any("more than 0 MiB" in p or "MiB of wheels" in p for p in wheels.check_wheels(str(folder))["problems"])
    assert wheels.WHEELS_MAX_BYTES < wheels.TREE_MAX_BYTES - wheels.tree_bytes(str(ROOT))


def test_abi3_wheels_for_older_pythons_are_accepted(tmp_path):
    folder = _fake_folder(tmp_path)
    next(folder.glob("tornado-*.whl")).unlink()
    _wheel(folder, "tornado", "6.6.1", tag="cp311-abi3-manylinux_2_28_x86_64")
    assert wheels.check_wheels(str(folder))["ok"]


def test_every_part_plans_within_one_command():
    """Four parts at most (the suite and three of labs); each step's cap fits the budget, the budget leaves margin
    under the 600 s command limit, and a step is never started with less than MIN_STEP_S."""
    assert len(runbook.PARTS) <= 4 and runbook.BUDGET_S <= runbook.COMMAND_LIMIT_S - 60
    assert all(runbook.STEP_CAP[s] <= runbook.BUDGET_S - runbook.RESERVE_S for p in runbook.PARTS.values() for s in p)
    assert runbook.step_timeout(240, 540) == 240 and runbook.step_timeout(240, 100) == 90
    assert runbook.step_timeout(240, runbook.MIN_STEP_S + runbook.RESERVE_S - 1) is None


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
    out, proc = _part("suite", tmp_path, _fake_folder(tmp_path), "--budget", "25")
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, log
    s = json.loads((out / "summary.json").read_text())
    assert not s["ok"] and all("budget: not started" in v["skipped"] for v in s["steps"].values())


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


def test_steps_put_the_nccl_proof_then_ddp_zero3_and_calibration_first():
    suite = list(runbook.PARTS["suite"])
    assert suite[0] == "nccl-proof" and runbook.OPTIONAL["nccl-proof"] == "nccl"
    runs = [suite.index(s) for s in ("main-job", "zero3", "calibrate")]
    assert runs == sorted(runs) and max(runs) < min(suite.index(s) for s in ("doctor", "gpu-suite", "overhead"))
    assert all("calibrate" not in p for name, p in runbook.PARTS.items() if name != "suite")  # measured once


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
