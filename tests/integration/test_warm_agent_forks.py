"""The warm agent server's forks, as real processes (dtlab.launching.warm): a forked agent rewrites its command line in
place, a child forked from a launcher starts its own servers, and a rank forked from the warm server imports nothing
to build and step its model. The server's rules: tests/unit/test_warm_agent.py; its drills:
tests/integration/test_warm_agent.py."""

import os
import subprocess
import sys

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


class _FakeServer:
    """What WarmProc reads of its server: the exit statuses by request, the lock, whether it still answers."""

    def __init__(self, exits):
        import threading

        self.cond, self.exits, self.dead = threading.Condition(), exits, False


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
