"""The process layer without /proc: every function that finds, identifies, signals or measures processes and the
machine works when dtlab's own code may not read /proc, as on macOS, where there is none.

What is hidden, honestly: an audit hook (PEP 578) refuses every `open`, `os.listdir`, `os.scandir` and
`os.readlink` of a /proc path whose Python caller is a dtlab module, and records the attempt. psutil's own reads
are let through: on Linux psutil reads /proc itself (on macOS it asks the kernel through sysctl and libproc), so
these tests show that dtlab reaches the system only through psutil, not that psutil runs without /proc."""

import ast
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from dtlab.config.busy import cpu_counters, sample
from dtlab.config.ncclib import mapped_nccl
from dtlab.launching.agent import RANK_COMM
from dtlab.launching.torchrun import is_rank_of, proc_state, rank_processes
from dtlab.results.liveness import alive, identity, running_state
from dtlab.runfiles import mount_of

from .source_tree import ROOT, modules

#: these checks walk the parsed package (tests/unit/source_tree.py): one worker parses it for all of them
pytestmark = pytest.mark.xdist_group("source-tree")

_EVENTS = {"open", "os.listdir", "os.scandir", "os.readlink"}
_HIDDEN: dict = {"on": False, "tried": []}


def _hook(event, args):
    if not _HIDDEN["on"] or event not in _EVENTS or not args:
        return
    path = args[0]
    if isinstance(path, bytes):
        path = path.decode(errors="replace")
    if not isinstance(path, str) or not (path == "/proc" or path.startswith("/proc/")):
        return
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller.startswith("dtlab"):
        _HIDDEN["tried"].append((caller, event, path))
        raise FileNotFoundError(2, "hidden by the test: no /proc here", path)


sys.addaudithook(_hook)  # an audit hook cannot be removed: it acts only while the fixture is on


@pytest.fixture
def no_proc():
    """/proc hidden from dtlab's own code while the test runs; the test fails if dtlab tried to read it."""
    _HIDDEN.update(on=True, tried=[])
    try:
        yield _HIDDEN
    finally:
        _HIDDEN["on"] = False
    assert _HIDDEN["tried"] == [], f"dtlab read /proc directly: {_HIDDEN['tried']}"


def test_the_hook_really_hides_proc_from_dtlab_code(no_proc):
    code = compile("open('/proc/self/stat').read()", "<dtlab>", "exec")
    with pytest.raises(FileNotFoundError, match="hidden by the test"):
        exec(code, {"__name__": "dtlab.fake"})
    assert no_proc["tried"] == [("dtlab.fake", "open", "/proc/self/stat")]
    no_proc["tried"].clear()
    assert psutil.Process().cmdline()  # psutil's own reads pass


def _sleeper(tmp_path, *args, env=None, code="import time; time.sleep(60)"):
    script = tmp_path / "sleeper.py"
    script.write_text(code)
    p = subprocess.Popen([sys.executable, str(script), *args], env=env)
    deadline = time.monotonic() + 30
    while True:  # until it has exec'd python with its arguments
        try:
            if psutil.Process(p.pid).cmdline()[-len(args) :] == list(args):
                return p
        except psutil.Error:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_process_is_identified_by_pid_and_start_time_without_proc(no_proc, tmp_path):
    me = identity(os.getpid())
    assert isinstance(me["start_ticks"], int) and isinstance(me["boot_time"], float)
    assert alive(me) is True
    assert alive({**me, "start_ticks": me["start_ticks"] + 1}) is False  # the pid reused by another process
    assert alive({**me, "boot_time": me["boot_time"] - 3600}) is False  # another boot
    zombie = subprocess.Popen(["true"])
    ident = identity(zombie.pid)
    deadline = time.monotonic() + 30
    while proc_state(zombie.pid) != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert alive(ident) is False  # a zombie counts as gone
    zombie.wait()
    assert alive(ident) is False and proc_state(zombie.pid) is None
    agent = _sleeper(tmp_path, str(tmp_path / "run"))
    try:  # an older status, pid only: alive when its command line names the run, as torchrun's agent's does
        assert running_state({"state": "running", "pid": agent.pid}, str(tmp_path / "run")) is None
        assert running_state({"state": "running", "pid": agent.pid}, str(tmp_path / "other"))["state"] == "abandoned"
    finally:
        agent.kill()
        agent.wait()


def test_a_stopped_process_reads_as_stopped(no_proc, tmp_path):
    p = _sleeper(tmp_path, "x")
    try:
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while proc_state(p.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert proc_state(os.getpid()) == "R"
    finally:
        p.kill()
        p.wait()


def test_the_ranks_of_a_run_are_found_by_command_line_name_and_node_without_proc(no_proc, tmp_path):
    run = str(tmp_path / "run")
    rank = _sleeper(tmp_path, run, "-m", "dtlab.rank.worker", run, env={**os.environ, "DTLAB_NODE_SLOT": "1"})
    # a rank forked from torchrun's agent carries the agent's `-c` command line and is told apart by its name
    named = f"import ctypes, time; ctypes.CDLL(None).prctl(15, {RANK_COMM.encode()!r}, 0, 0, 0); time.sleep(60)"
    forked = subprocess.Popen([sys.executable, "-c", named, run, "-m", "dtlab.rank.worker", run])
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", run, "-m", "dtlab.rank.worker", run])
    try:
        deadline = time.monotonic() + 30
        while sorted(p.pid for p in rank_processes(run)) != sorted([rank.pid, forked.pid]):
            assert time.monotonic() < deadline, [p.pid for p in rank_processes(run)]
            time.sleep(0.02)
        assert is_rank_of(rank.pid, run) and is_rank_of(forked.pid, run) and not is_rank_of(agent.pid, run)
        assert not is_rank_of(rank.pid, str(tmp_path / "ru"))  # a prefix of the run directory is another run
        assert is_rank_of(rank.pid, run, slot=1) and not is_rank_of(rank.pid, run, slot=0)
        assert [p.pid for p in rank_processes(run, slot=1)] == [rank.pid]
    finally:
        for p in (rank, forked, agent):
            p.kill()
            p.wait()
    assert rank_processes(run) == [] and not is_rank_of(rank.pid, run)


def test_the_machine_counters_and_the_disk_are_read_without_proc(no_proc, tmp_path):
    c = cpu_counters()
    assert set(c) == {"user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"}
    assert all(isinstance(v, int) and v >= 0 for v in c.values()) and c["idle"] + c["user"] > 0
    s = sample(0.05)
    assert s["other_cores"] is not None and s["busy"] in (True, False) and s["cores"] == os.cpu_count()
    mount, fstype = mount_of(str(tmp_path / "not-yet" / "a.json"))
    assert os.path.ismount(mount) and fstype != "?"
    assert mapped_nccl() == [] or all(os.path.basename(p).startswith("libnccl") for p in mapped_nccl())


_ALLOWED = {
    # the grading sandbox's pid namespace (Linux only, like bubblewrap): psutil does not expose namespaces
    "dtlab/course/pidns.py",
    # the sandbox's own mount script, run by a shell inside it (paths inside the sandbox, not reads)
    "dtlab/course/sandbox.py",
}


def _proc_paths(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("/proc"):
            yield node.lineno, node.value
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant) and str(first.value).startswith("/proc"):
                yield node.lineno, first.value


def test_no_dtlab_module_reads_proc_directly():
    found = []
    for path, tree in modules():  # the package parsed once per test process, shared with the style checks
        rel = path.relative_to(ROOT).as_posix()
        if rel not in _ALLOWED:
            found += [f"{rel}:{line}: {text}" for line, text in _proc_paths(tree)]
    assert found == [], "read processes and the machine through psutil instead:\n" + "\n".join(found)
