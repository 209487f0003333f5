"""The GPU runbook (tools/gpu_runbook.py): its wheel-folder check, and a whole dry run on this CPU machine."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_runbook", ROOT / "tools" / "gpu_runbook.py")
runbook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runbook)


def _wheel(folder, name, version, requires=(), tag="py3-none-any"):
    fn = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(fn, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return fn


def _fake_folder(tmp_path):
    """Every listed wheel, with requirements only on each other and on what the GPU machine has."""
    folder = tmp_path / "whl"
    folder.mkdir()
    for line in runbook._listed(str(ROOT / "tools" / "gpu-wheels.txt")):
        name, _, version = line.partition("==")
        reqs = ["torch", "numpy>=1.24", "hjson"] if name == "deepspeed" else []
        reqs += ['pywin32; sys_platform == "win32"']  # a marker that does not apply on Linux
        _wheel(folder, name, version, reqs)
    return folder


def test_wheel_check_accepts_a_complete_folder(tmp_path):
    res = runbook.check_wheels(str(_fake_folder(tmp_path)))
    assert res["ok"], res["problems"]


def test_wheel_check_names_each_problem(tmp_path):
    folder = _fake_folder(tmp_path)
    next(folder.glob("hjson-*.whl")).unlink()                                 # missing
    _wheel(folder, "plotly", "6.0.0")                                          # a second version
    _wheel(folder, "mystery", "1.0", requires=["not-on-the-gpu-machine>=1"])  # unmet requirement
    _wheel(folder, "fastpkg", "1.0", tag="cp311-cp311-manylinux_2_17_x86_64")  # wrong Python
    _wheel(folder, "armpkg", "1.0", tag="py3-none-manylinux_2_17_aarch64")     # wrong machine
    problems = "\n".join(runbook.check_wheels(str(folder))["problems"])
    assert "hjson==3.1.0: missing" in problems
    assert "plotly: two wheels" in problems
    assert "not-on-the-gpu-machine (needed by mystery)" in problems
    assert "fastpkg-1.0-cp311" in problems and "aarch64" in problems
    assert "pywin32" not in problems  # markers are evaluated for Linux x86-64, CPython 3.12


def test_abi3_wheels_for_older_pythons_are_accepted(tmp_path):
    folder = _fake_folder(tmp_path)
    next(folder.glob("tornado-*.whl")).unlink()
    _wheel(folder, "tornado", "6.6.1", tag="cp311-abi3-manylinux_2_28_x86_64")
    assert runbook.check_wheels(str(folder))["ok"]


def test_dry_run_walks_every_step_on_cpu(tmp_path):
    out = tmp_path / "proof"
    cp = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_runbook.py"), "--dry-run", "--wheels",
                         str(_fake_folder(tmp_path)), "--out", str(out)], capture_output=True, text=True,
                        timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["ok"] and s["dry_run"]
    assert list(s["steps"]) == ["wheels", "install", "doctor", "gpu-suite", "main-job", "zero3", "calibrate"]
    assert all(v["ok"] for v in s["steps"].values())
    suite = s["steps"]["gpu-suite"]
    assert suite["tests"] >= 8 and suite["skipped"] == suite["tests"]  # no GPU here: every GPU test skips...
    assert all("CUDA" in r for r in suite["skip_reasons"])                # ...with a reason naming CUDA
    m = s["main_job"]
    assert m["bytes_per_rank_step"] == [m["grad_bytes"]] and m["T_step_ms"] > 0
    assert "gloo on CPU" in m["placement"]
    assert set(s["calibration"]) >= {"all_reduce", "reduce_scatter", "all_gather"}


@pytest.mark.parametrize("flag", ["--check-wheels"])
def test_missing_wheel_folder_fails_with_a_reason(tmp_path, flag):
    cp = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_runbook.py"), flag, "--wheels",
                         str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 1 and "make_gpu_wheels.sh" in cp.stdout
