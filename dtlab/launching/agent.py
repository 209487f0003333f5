"""What runs inside torchrun's agent process (started by dtlab.launching.torchrun's shim), and how its ranks start.

Two ways to start the ranks, both torch's elastic agent (the code behind `torchrun`), chosen by torchrun's own
`--start-method` flag, which dtlab.launching.torchrun sets:

- `spawn` (NCCL, and wherever DTLAB_START_METHOD=spawn): the agent runs `python -m dtlab.rank.worker RUN_DIR` in a
  fresh interpreter per rank, as the `torchrun` command does. Each rank then imports torch and transformers itself:
  about 3.5 CPU-seconds per rank on this project's reference machine (2 cores), most of a tiny run's cost.
- `fork` (CPU ranks on gloo, the default there): the agent imports torch, transformers and the rank's modules once
  (`warm`), then torch's elastic agent forks each rank from it (`torchrun --start-method fork` with a function
  entry point). A rank starts with everything imported; the agent never initialises CUDA, runs no tensor op and
  holds no process group, so the fork copies no live device, thread pool or connection. What a rank does after it
  starts is the same code in both ways; a test checks that both give bit-identical losses.

A forked rank is made to look like a spawned one: a session of its own (torchrun starts spawned ranks that way, so
a signal to the agent's group does not reach them), default signal handlers (not the agent's), and the same exit
codes. torch reports only the first failed rank of a forked group; the agent here watches every rank's exit
(`waitid` without reaping) so exits.json names each rank that died, as it does for spawned ranks.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing import connection, forkserver, popen_fork, popen_forkserver

import psutil

from dtlab.runfiles import dump_json

#: DTLAB_START_METHOD: how CPU ranks start ('fork' by default; 'spawn' = a fresh interpreter per rank). NCCL ranks
#: are always spawned: a CUDA process must not be forked, and an agent that imported torch could be one.
START_METHODS = ("fork", "spawn")
#: A forked rank's process name (/proc/PID/comm): its command line is the agent's, so this is how it is told apart.
RANK_COMM = "dtlab-rank"


def start_method(backend_gloo: bool, environ=os.environ) -> str:
    """'fork' or 'spawn' for a job whose ranks use gloo (`backend_gloo`) or not. ValueError naming
    DTLAB_START_METHOD when it holds anything else."""
    want = environ.get("DTLAB_START_METHOD", "").strip() or "fork"
    if want not in START_METHODS:
        raise ValueError(
            f"DTLAB_START_METHOD must be one of {', '.join(START_METHODS)}, got {want!r} in the "
            "environment; unset it for the default (fork for CPU ranks on gloo, spawn for NCCL)"
        )
    return want if backend_gloo else "spawn"


class _ExitWatch:
    """Every forked rank's end, seen by the agent without reaping it (torch's process context reaps): each rank
    writes 'RANK PID' to a pipe as it starts, and a thread per rank waits for that PID with WNOWAIT."""

    def __init__(self, start: bool = True):
        self.r, self.w = os.pipe()
        self.ends: dict[int, dict] = {}  # pid -> {rank, pid, exitcode, signal, timestamp}
        self.pids: dict[int, int] = {}  # rank -> its latest pid (torchrun may restart the group)
        self.lock = threading.Lock()
        if start:
            self.start()

    def start(self) -> None:
        """Start reading the ranks' reports (a thread: after the zygote has been forked, which must have none)."""
        threading.Thread(target=self._read, daemon=True, name="dtlab-exit-watch").start()

    def started(self, rank: int) -> None:
        """Called in the forked rank."""
        os.write(self.w, f"{rank} {os.getpid()}\n".encode())

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self.r, 4096)
            except InterruptedError:
                continue
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                rank, pid = map(int, line.split())
                with self.lock:
                    self.pids[rank] = pid
                threading.Thread(target=self._wait, args=(rank, pid), daemon=True).start()

    def _wait(self, rank: int, pid: int) -> None:
        while True:
            try:
                st = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
                break
            except InterruptedError:
                continue
            except ChildProcessError:  # reaped before this thread looked: torch's record stands for it
                return
        killed = st.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        code = -st.si_status if killed else st.si_status
        with self.lock:
            self.ends[pid] = {
                "rank": rank,
                "pid": pid,
                "exitcode": code,
                "timestamp": time.time(),
                "signal": signal.Signals(st.si_status).name if killed else None,
            }

    def reaped(self, pid: int, code: int) -> None:
        """Record the end of `pid` from its exit status (`code`: negative for a signal, as multiprocessing gives it)
        when torch's process context reaped it before this watch's thread could look."""
        with self.lock:
            rank = next((r for r, p in self.pids.items() if p == pid), None)
            if rank is None or pid in self.ends:
                return
            self.ends[pid] = {
                "rank": rank,
                "pid": pid,
                "exitcode": code,
                "timestamp": time.time(),
                "signal": signal.Signals(-code).name if code < 0 else None,
            }

    def watch_reaping(self) -> None:
        """Also learn each forked rank's end where torch reaps it: torch's process context reaps its ranks through
        multiprocessing's fork Popen.poll (is_alive, join), and on a busy machine it can do so before the thread
        waiting on that PID (without reaping) has run, which then finds nothing. A rank that torch's agent stopped
        while it was computing (SIGTERM after its peer died) was then missing from exits.json."""

        watch, agent = self, os.getpid()
        for cls in (popen_fork.Popen, popen_forkserver.Popen):  # forkserver: ranks forked by the zygote
            original = cls.__dict__.get("poll", popen_fork.Popen.poll)

            def poll(popen, flag=os.WNOHANG, _original=original):
                known = popen.returncode is not None
                code = _original(popen, flag)
                if code is not None and not known and os.getpid() == agent:  # a rank inherits this, and a lock
                    watch.reaped(popen.pid, code)  # held at the fork stays held in the rank: only the agent records
                return code

            cls.poll = poll

    def failures(self) -> dict[int, dict]:
        """rank -> end of the ranks of the latest attempt that exited non-zero or by a signal."""
        with self.lock:
            latest = {self.pids[r]: r for r in self.pids}
            return {e["rank"]: e for pid, e in self.ends.items() if pid in latest and e["exitcode"] != 0}


_WATCH: _ExitWatch | None = None
#: Seconds an agent whose launcher died waits for torch's agent to stop the ranks before it SIGKILLs itself.
AGENT_GRACE_S = 60.0
#: True in an agent forked from a warm server (dtlab.launching.warm); its ranks record it in their start event.
WARM = False


def forked_rank(module: str, *argv: str) -> int:
    """The function torch's elastic agent runs in each forked rank: `module`'s entry(argv), as `python -m module
    ARGV` would. Success returns 0 (torch's agent collects it); a failure ends the process at once with the
    rank's exit code (dtlab.rank.lifecycle.exit_rank), as a spawned rank does."""
    _set_name(RANK_COMM)
    os.setsid()  # as torchrun's spawned ranks: a signal to the agent's group does not reach the ranks
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)  # torch's agent turns SIGTERM into an exception; a rank just dies
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if _WATCH is not None:
        _WATCH.started(int(os.environ["RANK"]))
    # here, not at the top: the agent imports this module before its lifeline starts, and only a rank needs it
    from dtlab.rank import lifecycle

    lifecycle.START_METHOD = "fork"
    lifecycle.WARM_AGENT = WARM
    code = importlib.import_module(module).entry(list(argv))
    if code:
        lifecycle.exit_rank(code)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def _set_name(name: str) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def warm(module: str, argv: list[str]) -> None:
    """Import, in the agent, what `module`'s ranks will import (torch, transformers, the strategy's module), so
    forked ranks start with it."""
    mod = importlib.import_module(module)
    warmer = getattr(mod, "warm", None)
    if warmer is not None:
        warmer(list(argv))


def _record(doc: dict, path: str) -> None:
    try:
        dump_json(doc, path)
    except OSError as err:
        try:
            print(f"dtlab: could not write {path}: {err}", file=sys.stderr, flush=True)
        except OSError:
            pass


def start_lifeline(fd: int, grace_s: float) -> None:
    """Tie this agent to the launching process: `fd` is the read end of a pipe only the launcher writes to. At end
    of file (the launcher exited or died) the agent SIGTERMs itself, so torch's agent stops its ranks, and SIGKILLs
    itself if that takes longer than `grace_s` seconds."""

    def lifeline():
        while True:
            try:
                if not os.read(fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=lifeline, daemon=True, name="dtlab-lifeline").start()


def agent_main(argv: list[str]) -> None:
    """The agent process's main: argv = [LIFELINE_FD, EXITS_PATH, RDZV_PATH, *torchrun's arguments] (the shim's
    arguments in dtlab.launching.torchrun; a warm server's forked agent gets the same). With forked ranks the agent
    imports what they need and forks the zygote first, while it has no thread (the lifeline is one)."""
    zygote = None
    if "--start-method=fork" in argv[3:]:
        zygote = start_zygote(argv[3:])
    start_lifeline(int(argv[0]), AGENT_GRACE_S)
    run_agent(argv[1], argv[2], argv[3:], zygote)


def start_zygote(torchrun_argv: list[str]) -> dict:
    """Import what the ranks import (`warm`), then fork the zygote: a child of this agent, forked while the agent
    has one thread, that serves multiprocessing's forkserver protocol (`multiprocessing.forkserver.main`, run here
    in a forked copy instead of a fresh interpreter, so it starts with everything imported). torch's elastic agent
    then starts its ranks with the 'forkserver' method: each rank is forked by the zygote, which never starts a
    thread, so no lock held by another thread (torch's store server, the exit watch, the lifeline) is copied into a
    rank held. The zygote dies with the agent (PR_SET_PDEATHSIG, and its forkserver loop ends when the agent's end
    of its pipe closes); its ranks die with it. Returns {pid, threads}: the zygote and the threads it had."""
    global _WATCH
    from torch.distributed.run import parse_args  # here: the launcher imports this module and never pays for torch

    args = parse_args(torchrun_argv)
    warm(args.training_script, args.training_script_args)
    _WATCH = _ExitWatch(start=False)  # its pipe is inherited by the zygote's ranks; its thread starts afterwards
    threads = psutil.Process().num_threads()  # the operating system's count: C++ threads too (torch's, BLAS's)
    pid = fork_zygote()
    _WATCH.start()
    print(
        f"dtlab: ranks are forked by the zygote (pid {pid}), forked from this agent with {threads} thread(s)",
        file=sys.stderr,
        flush=True,
    )
    return {"pid": pid, "threads": threads}


def fork_zygote() -> int:
    """Fork the zygote from this process (which must have no thread but the calling one) and make it the server of
    multiprocessing's 'forkserver' start method here: a later `Process.start()` of that method asks it to fork.
    Returns its pid. It runs `multiprocessing.forkserver.main`, ignores SIGTERM and SIGHUP, and ends with this
    process (PR_SET_PDEATHSIG, and its loop ends when this process's end of its pipe closes)."""
    fs = forkserver._forkserver
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    listener.listen()
    alive_r, alive_w = os.pipe()
    agent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the zygote
        code = 1
        try:
            os.close(alive_w)
            _die_with(agent)
            _set_name("dtlab-zygote")
            for sig in (signal.SIGTERM, signal.SIGHUP):  # a signal to the agent's group is the agent's to act on:
                signal.signal(sig, signal.SIG_IGN)  # it stops the ranks, then its exit ends the zygote
            forkserver.main(listener.fileno(), alive_r, [], None, None)
            code = 0
        except SystemExit as e:  # the forkserver loop ends so when the agent's end of the pipe closes
            code = e.code if isinstance(e.code, int) else 0
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    fs._forkserver_address, fs._forkserver_alive_fd, fs._forkserver_pid = address, alive_w, pid
    return pid


def _die_with(parent: int) -> None:
    """SIGKILL this process when `parent` ends (Linux's PR_SET_PDEATHSIG; elsewhere the forkserver loop's pipe)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it ended before the signal was armed
        os._exit(1)


def run_agent(exits_path: str, rdzv_path: str, argv: list[str], zygote: dict | None = None) -> None:
    """torchrun's `main(argv)`, with a function entry point when argv says --start-method=fork (its ranks forked by
    `zygote`, from start_zygote); writes what it knows of each failed rank to `exits_path` and a failed rendezvous
    to `rdzv_path`."""
    # torch only here, in the agent process: the notebook and the CLI import this module and never pay for torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args
    from torch.distributed.run import run as torchrun

    args = parse_args(argv)
    fork = args.start_method == "fork"
    try:
        if fork:
            if zygote is None:
                zygote = start_zygote(argv)
            _WATCH.watch_reaping()
            config, _, _ = config_from_args(args)
            config.start_method = "forkserver"  # the zygote forks them (start_zygote)
            elastic_launch(config=config, entrypoint=forked_rank)(args.training_script, *args.training_script_args)
        else:
            torchrun(args)
    except RendezvousError as e:
        _record({"error": type(e).__name__, "message": str(e)}, rdzv_path)
        raise
    except ChildFailedError as e:
        doc = {
            str(rank): {
                "rank": rank,
                "pid": f.pid,
                "exitcode": f.exitcode,
                "signal": f.signal_name() if f.exitcode < 0 else None,
                "timestamp": f.timestamp,
                "message": f.message,
            }
            for rank, f in e.failures.items()
        }
        if fork:  # torch names only the first failed rank of a forked group: add every rank seen to fail
            for rank, end in _WATCH.failures().items():
                doc[str(rank)] = {**doc.get(str(rank), {}), **end, "message": doc.get(str(rank), {}).get("message")}
        _record(doc, exits_path)
        raise
