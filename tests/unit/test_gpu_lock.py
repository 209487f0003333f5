"""One run per GPU when DTLAB_GPU_LOCK_DIR is set: a second run that wants a held GPU waits, saying for whom and
since when, and runs once the first lets go (or dies); the folder is checked; CPU runs take no lock."""

import getpass
import json
import logging
import signal
import subprocess
import sys
import threading

import pytest

from dtlab.config import nvml
from dtlab.launching.gpulock import ENV, acquire, gpu_names, lock_dir, run_locks

from .test_gpu_sharing import FakeNVML, _gpu

_HOLDER = """
import sys
from dtlab.launching.gpulock import acquire
locks = acquire(["gpu-B", "gpu-A"], sys.argv[1], "/runs/first")
print("held", flush=True)
sys.stdin.read()
locks.release()
"""


def _holder(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "held"
    return p


def _second(tmp_path, out):
    def take():
        out["locks"] = acquire(["gpu-B"], str(tmp_path), "/runs/second", poll_s=0.02)

    t = threading.Thread(target=take, daemon=True)
    t.start()
    return t


def _wait_for_message(caplog, t):
    for _ in range(3000):
        if any("is in use by" in r.getMessage() for r in caplog.records):
            return
        t.join(0.01)
    raise AssertionError("the waiting run never said whom it waits for")


def test_a_second_run_waits_saying_for_whom_and_since_when_then_runs(tmp_path, caplog):
    holder = _holder(tmp_path)
    out = {}
    with caplog.at_level(logging.INFO, logger="dtlab"):
        t = _second(tmp_path, out)
        _wait_for_message(caplog, t)
        assert t.is_alive() and "locks" not in out  # still waiting: the GPU is held
        said = next(r.getMessage() for r in caplog.records if "is in use by" in r.getMessage())
        assert said.startswith(f"dtlab: gpu-B is in use by {getpass.getuser()}'s run /runs/first (pid {holder.pid}")
        assert " since " in said and " s ago; waiting for it to end" in said and ENV in said
        holder.stdin.close()  # the first run ends
        holder.wait(timeout=60)
        t.join(60)
    assert not t.is_alive() and out["locks"].names == ["gpu-B"]
    assert json.loads((tmp_path / "gpu-B.lock").read_text())["run_dir"] == "/runs/second"
    assert any(r.getMessage() == "dtlab: gpu-B is free now; this run takes it" for r in caplog.records)
    out["locks"].release()
    assert (tmp_path / "gpu-B.lock").read_text() == ""


def test_a_holder_that_dies_leaves_no_lock_behind(tmp_path, caplog):
    holder = _holder(tmp_path)
    out = {}
    with caplog.at_level(logging.INFO, logger="dtlab"):
        t = _second(tmp_path, out)
        _wait_for_message(caplog, t)
        holder.send_signal(signal.SIGKILL)  # a kernel killed mid-run: the OS drops its flock
        holder.wait(timeout=60)
        t.join(60)
    assert not t.is_alive() and out["locks"].names == ["gpu-B"]
    out["locks"].release()


def test_the_lock_folder_is_checked_and_cpu_runs_take_no_lock(tmp_path):
    with pytest.raises(ValueError, match=f"{ENV}=.*must be an existing folder every user of the node can write"):
        lock_dir({ENV: str(tmp_path / "missing")})
    assert lock_dir({}) is None and lock_dir({ENV: str(tmp_path)}) == str(tmp_path)
    assert run_locks("gloo", 2, 0, str(tmp_path / "run"), {ENV: str(tmp_path)}) is None
    assert run_locks("nccl", 2, 2, str(tmp_path / "run"), {}) is None
    assert list(tmp_path.iterdir()) == []


def test_gpus_are_named_by_their_nvml_uuid_else_by_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(nvml, "nvml", FakeNVML({0: _gpu(0, {}), 1: _gpu(1, {})}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert gpu_names(1) == ["gpu-GPU-1aaa"] and gpu_names(4) == ["gpu-GPU-1aaa", "gpu-GPU-0aaa"]
    monkeypatch.setattr(nvml, "nvml", FakeNVML({}, driver=False))
    assert gpu_names(2) == ["gpu-1", "gpu-0"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_names(2) == ["gpu-0", "gpu-1"]
