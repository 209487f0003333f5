"""The warm agent server's pure parts: which environments share a server, the opt-out's check, and the command line
a forked agent writes over the server's argument memory (so its command line names its run directory as a cold
agent's does)."""

import os
import subprocess
import sys

import pytest

import dtlab
from dtlab.launching import warm

_CMDLINE = """
import sys
from dtlab.launching.warmserver import set_cmdline
ok = set_cmdline([sys.executable, "-c", "dtlab warm agent", "7", "/runs/r1", "-m", "dtlab.rank.worker", "/runs/r1"])
too_long = set_cmdline(["x" * 100000])
import psutil
print(ok, too_long, [a.encode() for a in psutil.Process().cmdline() if a])
"""


def test_a_forked_agent_rewrites_its_command_line_in_place_and_refuses_one_that_does_not_fit():
    out = subprocess.run(
        [sys.executable, "-c", _CMDLINE, " " * 2000], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    ok, too_long, rest = out.split(" ", 2)
    assert (ok, too_long) == ("True", "False")
    assert rest == repr(
        [
            sys.executable.encode(),
            b"-c",
            b"dtlab warm agent",
            b"7",
            b"/runs/r1",
            b"-m",
            b"dtlab.rank.worker",
            b"/runs/r1",
        ]
    )


def test_the_ranks_own_variables_and_pytests_do_not_split_servers_but_anything_else_does():
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    key = warm.server_key(base)
    assert warm.server_key({**base, "DTLAB_FAULT": "1:3:kill", "PYTEST_CURRENT_TEST": "t (call)"}) == key
    for name, value in (("OMP_NUM_THREADS", "2"), ("PYTHONHASHSEED", "1"), ("HF_HUB_OFFLINE", "1")):
        assert warm.server_key({**base, name: value}) != key, name


def test_an_edited_dtlab_gets_a_fresh_server(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(warm, "_PKG_DIR", str(tmp_path))
    before = warm.server_key({})
    os.utime(tmp_path / "a.py", ns=(0, os.stat(tmp_path / "a.py").st_mtime_ns + 10**9))
    assert warm.server_key({}) != before
    (tmp_path / "b.py").write_text("")
    assert warm.server_key({}) != before


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_a_warm_agent_setting_other_than_0_or_1_is_refused_before_anything_starts(tmp_path, monkeypatch, value):
    monkeypatch.setenv("DTLAB_WARM_AGENT", value)
    with pytest.raises(ValueError, match=rf"DTLAB_WARM_AGENT must be 0 or 1, got {value!r}"):
        dtlab.launch(dtlab.tiny(out=str(tmp_path / "never")))
    assert not (tmp_path / "never").exists()
    assert warm.enabled({}) and warm.enabled({"DTLAB_WARM_AGENT": "1"}) and not warm.enabled({"DTLAB_WARM_AGENT": "0"})


class _FakeServer:
    """What WarmProc reads of its server: the exit statuses by request, the lock, whether it still answers."""

    def __init__(self, exits):
        import threading

        self.cond, self.exits, self.dead = threading.Condition(), exits, False


def test_an_agent_ends_by_its_own_request_not_by_an_earlier_agent_with_the_same_pid():
    """pids wrap around in a long notebook session: an ended agent's status must not end a later one."""
    server = _FakeServer({1: 0})
    earlier, later = warm.WarmProc(server, 1, 4242, []), warm.WarmProc(server, 2, 4242, [])
    assert earlier.poll() == 0 and later.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        later.wait(timeout=0.05)
    server.exits[2] = -9
    assert later.wait(timeout=1) == -9 and later.returncode == -9 and not server.exits


def test_a_child_forked_from_a_launcher_starts_its_own_servers(monkeypatch):
    """The parent's servers answer the parent's reader thread only: a forked child must not wait on them."""
    import socket

    a, b = socket.socketpair()
    fake = _FakeServer({})
    fake.sock = a
    monkeypatch.setitem(warm._SERVERS, ("key",), fake)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not warm._SERVERS and a.fileno() == -1 else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert warm._SERVERS[("key",)] is fake and a.fileno() != -1  # the parent keeps its own (and any real ones)
    a.close()
    b.close()


_BUILD_AFTER_WARMING = """
import importlib
import sys
import dtlab
from dtlab.config.strategies import strategy_spec
from dtlab.launching.warmserver import _imports
_imports()   # what the warm server imports before it forks an agent, whose ranks fork in turn
importlib.import_module(strategy_spec("ddp").module)   # and what the agent imports for a run (dtlab.rank.worker.warm)
before = set(sys.modules)
from dtlab.rank.build import make_batches
from dtlab.rank.data import build_model, load_sentences
cfg = dtlab.tiny(out="unused", steps=2, batch_size=4, seq_len=16)
built = build_model(cfg.model, cfg.model_source, cfg.model_path, cfg.seed)
sentences, labels, _ = load_sentences(cfg.data, 16, cfg.seed)
batches = make_batches(cfg, built.tokenizer, sentences, labels, 0, 2, "cpu")
built.model(**batches[0]).loss.backward()
print(sorted(set(sys.modules) - before))
"""


def test_a_rank_forked_from_the_warm_server_imports_nothing_to_build_and_step_its_model():
    """Everything a forked rank needs to build the tiny model, its tokenizer and batches and take a step is
    imported by the server before it forks: a class left out of the warming (transformers' DistilBERT modeling
    module alone costs a fresh process about 4 CPU-seconds) would be imported again by every rank of every run."""
    out = subprocess.run(
        [sys.executable, "-c", _BUILD_AFTER_WARMING], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    assert out == "[]", f"imported by the rank, not by the warm server: {out}"
