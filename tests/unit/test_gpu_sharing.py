"""A GPU shared with another process is named: NVML (a fake module object here, with the functions dtlab calls)
says who is on each GPU, a run whose GPU another process used during its steps is labelled shared and its figures
widened as a busy CPU's are, and the doctor says who else is on each GPU."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from dtlab.config import busy, nvml
from dtlab.config.nvml import gpu_lines

from .test_breakdown import _machine, a_run, rows


class FakeNVML:
    """The pynvml functions dtlab uses, over a table of GPUs: {index: dict(uuid, name, util, used, total,
    procs: {pid: bytes}, sm: {pid: [(time_s, sm_pct), ...]})}."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus, driver=True):
        self.gpus, self.driver, self.inits = gpus, driver, 0

    def nvmlInit(self):
        if not self.driver:
            raise self.NVMLError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if i not in self.gpus:
            raise self.NVMLError("Invalid Argument")
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return next(i for i, g in self.gpus.items() if g["uuid"] == uuid)

    def nvmlDeviceGetIndex(self, h):
        return h

    def nvmlDeviceGetUUID(self, h):
        return self.gpus[h]["uuid"]

    def nvmlDeviceGetName(self, h):
        return self.gpus[h]["name"].encode()  # older bindings return bytes

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self.gpus[h]["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        g = self.gpus[h]
        return SimpleNamespace(used=g["used"], total=g["total"], free=g["total"] - g["used"])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.gpus[h]["procs"].items()]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return []

    def nvmlDeviceGetProcessUtilization(self, h, since_us):
        out = [
            SimpleNamespace(pid=p, timeStamp=int(t * 1e6), smUtil=u, memUtil=0)
            for p, xs in self.gpus[h].get("sm", {}).items()
            for t, u in xs
            if t * 1e6 > since_us
        ]
        if not out:
            raise self.NVMLError("Not Found")
        return out


def _gpu(i, procs, util=50, sm=None):
    return {
        "uuid": f"GPU-{i}aaa",
        "name": "NVIDIA H200",
        "util": util,
        "used": sum(procs.values()),
        "total": 140 * 2**30,
        "procs": procs,
        "sm": sm or {},
    }


@pytest.fixture
def other():
    """Another user's process standing in for a second student's run (a sleeping python)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "train.py"])
    # Popen returns before the child's exec is done: until then /proc shows no command line (or the parent's), and
    # the label under test would read "python". Wait (at most 30 s) until the kernel shows the new program's.
    deadline = time.monotonic() + 30
    while True:
        try:
            if "train.py" in psutil.Process(p.pid).cmdline():
                break
        except psutil.Error:
            pass
        if time.monotonic() > deadline:
            p.kill()
            pytest.fail(f"the stand-in process {p.pid} showed no 'train.py' in its command line within 30 s")
        time.sleep(0.01)
    yield p.pid
    p.kill()
    p.wait()


def test_the_gpus_visible_here_and_who_is_on_them(monkeypatch, other):
    fake = FakeNVML({0: _gpu(0, {111: 2**30}), 1: _gpu(1, {other: 3 * 2**30, 222: 2**30})})
    monkeypatch.setattr(nvml, "nvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    state = nvml.gpu_state()
    assert [g["index"] for g in state] == [1] and state[0]["name"] == "NVIDIA H200" and fake.inits == 0
    assert [p["pid"] for p in state[0]["processes"]] == sorted([other, 222])
    assert nvml.others(state, [222]) == {1: [{"pid": other, "memory_bytes": 3 * 2**30}]}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0aaa,7")  # a UUID, then an invalid entry: CUDA stops there
    assert [g["index"] for g in nvml.gpu_state()] == [0]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    lines = gpu_lines(nvml.gpu_state(), own_pids=[111])
    assert lines[0].startswith("GPU 0 (NVIDIA H200): 50% busy, 1 GiB of 140 GiB used; nobody else on it")
    assert "shared with" in lines[1] and f"(pid {other}), 3 GiB" in lines[1] and "train.py" in lines[1]
    assert "pid 222" in lines[1]
    monkeypatch.setattr(nvml, "nvml", FakeNVML({}, driver=False))
    assert nvml.gpu_state() is None and "NVML not readable here" in gpu_lines(None)[0]


def _gpu_run(tmp_path, monkeypatch, table_at_start, table_at_end, rank_pids=(1000, 1001)):
    """A 2-rank run whose rank 0 took its machine snapshots through dtlab.config.busy.snapshot with the fake NVML
    showing `table_at_start`, then `table_at_end`; the CPU quiet (other processes 0.05 cores)."""
    snaps = []
    for table in (table_at_start, table_at_end):
        monkeypatch.setattr(nvml, "nvml", FakeNVML(table))
        snaps.append(busy.snapshot(machine=True)["gpus"])
    machine = _machine(0.05)
    for phase, gpus in zip(("start", "end"), snaps):
        next(e for e in machine[0] if e["phase"] == phase)["gpus"] = gpus
    for r, pid in enumerate(rank_pids):
        machine[r] = [{"kind": "start", "rank": r, "pid": pid, "host": "h"}] + machine[r]
    train, base = [1.0, 1.0, 1.2, 0.9, 1.3, 0.8, 1.1, 1.0, 1.2, 0.9, 1.0, 1.1], [0.8, 0.7, 0.9]
    return rows(a_run(tmp_path, train, base, machine=machine))


def test_a_run_beside_another_process_on_its_gpu_is_labelled_shared_and_widened(tmp_path, monkeypatch, other):
    monkeypatch.setattr(busy, "_LAST_MACHINE", [])
    now = time.time()
    alone = {0: _gpu(0, {1000: 2**30, 1001: 2**30}, util=20)}
    (tmp_path / "a").mkdir()
    q = _gpu_run(tmp_path / "a", monkeypatch, alone, {0: _gpu(0, {1000: 2**30, 1001: 2**30}, util=90)})
    assert q.loc["machine", "how"].startswith("machine: quiet") and "widened" not in q.loc["machine", "how"]
    assert "GPU 0 alone (20% -> 90% busy)" in q.loc["machine", "how"]
    # another student's process ran kernels on GPU 0 while the steps ran (its samples after the start snapshot)
    shared = {0: _gpu(0, {1000: 2**30, 1001: 2**30, other: 5 * 2**30}, util=99, sm={other: [(now + 60, 45.0)]})}
    (tmp_path / "s").mkdir()
    s = _gpu_run(tmp_path / "s", monkeypatch, alone, shared)
    how = s.loc["machine", "how"]
    assert how.startswith("machine: GPU shared during the steps") and "figures widened" in how
    assert "GPU 0 shared with " in how and f"train.py (pid {other}), 5 GiB, kernels 45% of the time" in how
    # present but idle through the steps (a notebook holding a CUDA context): not shared, its samples say so
    idle = {0: _gpu(0, {1000: 2**30, 1001: 2**30, other: 5 * 2**30}, util=90, sm={1000: [(now + 60, 80.0)]})}
    (tmp_path / "i").mkdir()
    i = _gpu_run(tmp_path / "i", monkeypatch, alone, idle)
    assert i.loc["machine", "how"].startswith("machine: quiet") and "GPU 0 alone" in i.loc["machine", "how"]


def test_ranks_never_seen_on_a_gpu_leave_the_gpus_out_of_the_verdict(tmp_path, monkeypatch, other):
    monkeypatch.setattr(busy, "_LAST_MACHINE", [])
    table = {0: _gpu(0, {other: 5 * 2**30})}  # a CPU run on a machine whose GPU someone else uses
    r = _gpu_run(tmp_path, monkeypatch, table, table)
    assert r.loc["machine", "how"].startswith("machine: quiet") and "GPU" not in r.loc["machine", "how"]


def test_the_doctor_line_for_this_process_leaves_itself_out(monkeypatch):
    fake = FakeNVML({0: _gpu(0, {os.getpid(): 2**30})})
    monkeypatch.setattr(nvml, "nvml", fake)
    assert gpu_lines(nvml.gpu_state(), own_pids=[os.getpid()])[0].endswith("nobody else on it")


def test_the_live_monitors_gpu_panel_shows_each_gpus_utilisation_and_memory_from_nvml(tmp_path, monkeypatch):
    from dtlab.viz.monitor import Monitor, monitor_figure

    from .test_monitor import _steady_run

    table = {0: _gpu(0, {1: 2 * 2**30}, util=30), 1: _gpu(1, {2: 2**30}, util=80)}
    monkeypatch.setattr(nvml, "nvml", FakeNVML(table))
    mon = Monitor(str(_steady_run(tmp_path)), mode="widget", every_s=0.001)
    mon.poll()
    table[0].update(util=60, used=3 * 2**30)
    mon.finish("finished")
    gpus = mon.view["gpus"]
    assert gpus["index"].tolist() == [0, 1, 0, 1] and gpus["util_pct"].tolist() == [30.0, 80.0, 60.0, 80.0]
    fig = monitor_figure(mon.view)
    titles = [a.text for a in fig.layout.annotations]
    assert "GPU utilisation (%, NVML)" in titles and "GPU memory used (GiB, NVML)" in titles
    util = {t.name: list(t.y) for t in fig.data if t.name.endswith("utilisation")}
    mem = {t.name: list(t.y) for t in fig.data if t.name.endswith("memory")}
    assert util == {"GPU 0 utilisation": [30.0, 60.0], "GPU 1 utilisation": [80.0, 80.0]}
    assert mem["GPU 0 memory"] == pytest.approx([2.0, 3.0])
    monkeypatch.setattr(nvml, "nvml", FakeNVML({}, driver=False))  # no driver: no GPU panel, no number
    bare = Monitor(str(_steady_run(tmp_path / "b")), mode="widget", every_s=0.001)
    bare.poll()
    assert not any("GPU" in a.text for a in monitor_figure(bare.view).layout.annotations)
