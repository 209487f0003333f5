"""The GPU runbook (tools/gpu_runbook.py, tools/gpu_wheels.py): its wheel-folder check, its limits (two
commands under 600 s, small flat output folders, a summary rewritten after every step), and a whole dry run of
its two parts on this CPU machine."""

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
    """Two parts; each step's cap fits the budget, the budget leaves margin under the 600 s command limit, and
    a step is never started with less than MIN_STEP_S."""
    assert len(runbook.PARTS) <= 3 and runbook.BUDGET_S <= runbook.COMMAND_LIMIT_S - 60
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
