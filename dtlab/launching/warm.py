"""A warm agent server: torchrun's agent for CPU jobs forked from a process that imported torch and transformers once.

Importing torch and transformers takes about 4.5 CPU-seconds on this project's reference machine (2 cores), far
more than a small CPU run's own work. A cold launch pays it in torchrun's agent every time (and, with spawned ranks,
in every rank too). The first CPU launch of a Python process (a notebook kernel, a script) starts one server per
environment: `python -c "...serve()"`, a child of the launching process in its own session, which does those imports
and then waits. Each later launch with the same environment asks it for an agent: the server forks, and the child
becomes exactly what `dtlab.launching.torchrun`'s shim would have been (the same lifeline to the launcher, the same
`run_agent`, the same command line, log, working directory and environment), so everything that finds, watches or
stops an agent or its ranks works unchanged. The agent then forks the ranks, as a cold agent does.

- Only single-node CPU jobs whose ranks are forked use it (gloo, `DTLAB_START_METHOD` fork, no command prefix): NCCL
  ranks are spawned, and an emulated or real second node has its own environment and namespace.
- A server is keyed by everything that could change what it imported: the Python executable, the dtlab source files'
  modification times (an edited dtlab gets a fresh server) and the whole environment except `DTLAB_*` (read by the
  ranks when they run, never at import) and pytest's per-test variable. Another environment gets another server.
- The server reaps the agents it forked and reports each exit status to the launcher (`WarmProc` stands in for a
  `subprocess.Popen`). It ends when the launcher closes its end of the socket or dies (end of file), never while
  the launcher might still ask; agents it forked have their own lifelines and do not need it to run.
- `DTLAB_WARM_AGENT=0` starts every agent afresh (`python -c` shim), as before; a server that cannot start (its
  imports fail) also falls back to that, so the failure shows in the run's own log.

A forked agent's command line is written in place over the server's argument memory (whose size the server
reserves at start), the way `setproctitle` does: /proc/PID/cmdline then names the run directory and rank module,
as a cold agent's does.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

#: DTLAB_WARM_AGENT: '1' (default) forks CPU jobs' agents from a warm server; '0' starts each one afresh.
WARM_VALUES = ("0", "1")
#: Bytes of argument memory the server reserves for the command lines of the agents it forks.
CMDLINE_BYTES = 16384
MARKER = "dtlab warm agent"   # a forked agent's `-c` argument (a cold agent's is the shim's source)
_SERVE = "from dtlab.launching.warm import serve; serve()"
MAX_SERVERS = 3               # idle servers kept per launching process (one per environment)
READY_TIMEOUT_S = 300.0       # a server not ready by then (its imports hang) is stopped; launches start agents cold
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def enabled(environ=os.environ) -> bool:
    """Whether CPU jobs' agents come from a warm server. ValueError naming DTLAB_WARM_AGENT when it holds
    anything but 0 or 1."""
    v = environ.get("DTLAB_WARM_AGENT", "").strip() or "1"
    if v not in WARM_VALUES:
        raise ValueError(f"DTLAB_WARM_AGENT must be 0 or 1, got {v!r} in the environment; 0 starts torchrun's "
                         "agent afresh for every CPU run, 1 (the default) forks it from a warm server")
    return v == "1"


# ---- inside the server ---------------------------------------------------------------------------------------
def _arg_area() -> tuple[int, int]:
    """(address, length) of this process's argument memory (/proc/self/stat fields 48 and 49), (0, 0) if unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])
        return (start, end - start) if 0 < start < end else (0, 0)
    except (OSError, ValueError, IndexError):
        return 0, 0


def set_cmdline(args: list[str]) -> bool:
    """Write `args` over this process's argument memory, NUL-padded, so /proc/PID/cmdline shows them. False
    (nothing written) when they do not fit."""
    start, size = _arg_area()
    data = b"\0".join(a.encode() for a in args) + b"\0"
    if not start or len(data) > size:
        return False
    ctypes.memmove(start, data.ljust(size, b"\0"), size)
    return True


def _imports() -> None:
    """What every CPU agent and its forked ranks import: torch, torch's elastic agent, transformers' DistilBERT
    and tokenizer classes, dtlab's rank modules."""
    import torch.distributed.run  # noqa: F401
    from torch.distributed.launcher.api import elastic_launch  # noqa: F401

    import dtlab.launching.agent  # noqa: F401
    import dtlab.rank.calibration  # noqa: F401
    import dtlab.rank.harness  # noqa: F401
    import dtlab.rank.worker  # noqa: F401
    from dtlab.rank.data import warm_model
    warm_model()


def _send(sock: socket.socket, doc: dict) -> None:
    try:
        sock.send(json.dumps(doc).encode())
    except OSError:
        os._exit(0)  # the launcher is gone: nobody to serve


def serve() -> None:
    """The server's main loop (its process runs `python -c _SERVE FD PLACEHOLDER`): import, say ready, then fork an
    agent per request and report every agent's exit status, until the launcher's end of the socket closes."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        _imports()
        set_cmdline([sys.executable, "-c", "dtlab warm agent server (forks torchrun agents)"])
        _send(sock, {"ready": True, "capacity": _arg_area()[1]})
    except BaseException:  # noqa: BLE001 - reported to the launcher, which then starts the agent cold
        _send(sock, {"ready": False, "error": traceback.format_exc()[-2000:]})
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        try:
            ready, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            _reap(sock)
        if sock in ready:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
            except InterruptedError:
                continue
            except OSError:
                msg, fds = b"", []
            if not msg:
                os._exit(0)
            req = json.loads(msg)
            try:
                pid = os.fork()
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"req": req["req"], "error": f"fork failed: {e}"})
                continue
            if pid == 0:
                _become_agent(req, fds, sock, (wake_r, wake_w))
            for fd in fds:
                os.close(fd)
            _send(sock, {"req": req["req"], "pid": pid})
            _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _become_agent(req: dict, fds: list[int], sock: socket.socket, wake: tuple[int, int]) -> None:
    """In the forked child: become torchrun's agent for the request (never returns)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wake:
            os.close(fd)
        sock.close()
        life_fd, log_fd = fds
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(devnull)
        os.close(log_fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        args = [str(life_fd)] + req["args"]
        sys.argv = ["-c"] + args
        set_cmdline([sys.executable, "-c", MARKER] + args)
        from dtlab.launching import agent
        agent.WARM = True
        code = _as_interpreter(lambda: agent.agent_main(args))
    finally:
        os._exit(code)


def _as_interpreter(fn) -> int:
    """Run `fn` and end as `python -c` would: the exit code of a SystemExit, 1 and a traceback for any other
    exception; then wait for non-daemon threads, run atexit handlers and flush."""
    try:
        fn()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter: print it, exit 1
        traceback.print_exc()
        code = 1
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


# ---- in the launching process --------------------------------------------------------------------------------
def _source_stamp() -> tuple[int, int]:
    """(count, newest modification time in ns) of dtlab's .py files: an edited dtlab gets a fresh server."""
    n, newest = 0, 0
    for root, _, files in os.walk(_PKG_DIR):
        for name in files:
            if name.endswith(".py"):
                n += 1
                try:
                    newest = max(newest, os.stat(os.path.join(root, name)).st_mtime_ns)
                except OSError:
                    pass
    return n, newest


def server_key(env: dict) -> tuple:
    """What must be equal for two agents to come from one server (see the module's docstring)."""
    return (sys.executable, _source_stamp(),
            tuple(sorted((k, v) for k, v in env.items() if not k.startswith("DTLAB_") and k != "PYTEST_CURRENT_TEST")))


class _Server:
    """The launcher's side of one server: its process, the socket, a thread reading replies and exit statuses."""

    def __init__(self, env: dict):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(theirs.fileno()), " " * CMDLINE_BYTES],
                                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                         start_new_session=True)
        finally:
            theirs.close()
        self.cond = threading.Condition()
        self.ready: dict | None = None
        self.replies: dict[int, dict] = {}
        self.exits: dict[int, int] = {}
        self.agents: set[int] = set()
        self.dead = False
        self._next = 0
        threading.Thread(target=self._read, daemon=True, name="dtlab-warm-agent-reader").start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(1 << 20)
            except OSError:
                msg = b""
            with self.cond:
                if not msg:
                    self.dead = True
                    self.cond.notify_all()
                    return
                doc = json.loads(msg)
                if "ready" in doc:
                    self.ready = doc
                elif "exit" in doc:
                    self.exits[doc["exit"]] = doc["returncode"]
                    self.agents.discard(doc["exit"])
                else:
                    self.replies[doc["req"]] = doc
                self.cond.notify_all()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict:
        """The server's ready message: {'ready': True, 'capacity': bytes} once its imports are done, else why not
        (it failed, exited, or was not ready within `timeout_s` seconds: then it is stopped and stays unusable)."""
        with self.cond:
            self.cond.wait_for(lambda: self.ready is not None or self.dead, timeout_s)
            if self.ready is None and not self.dead:
                self.ready = {"ready": False, "error": f"not ready within {timeout_s:.0f} s"}
                self.proc.kill()
            return self.ready if self.ready is not None else {"ready": False, "error": "the server exited"}

    def fork_agent(self, args: list[str], env: dict, life_r: int, log_fd: int) -> int | None:
        """Ask for an agent; its pid, or None when the server could not fork one."""
        with self.cond:
            self._next += 1
            req = self._next
        msg = json.dumps({"req": req, "args": args, "env": env, "cwd": os.getcwd()}).encode()
        try:
            socket.send_fds(self.sock, [msg], [life_r, log_fd])
        except OSError:
            return None
        with self.cond:
            self.cond.wait_for(lambda: req in self.replies or self.dead)
            reply = self.replies.pop(req, None)
            if reply is None or "pid" not in reply:
                return None
            self.agents.add(reply["pid"])
            return reply["pid"]

    def close(self) -> None:
        """Close the socket: the server exits at end of file (agents it forked run on). Reaped by a thread."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        threading.Thread(target=self.proc.wait, daemon=True).start()


class WarmProc:
    """A forked agent, with the parts of `subprocess.Popen` the launcher uses: pid, returncode, poll(), wait()."""

    def __init__(self, server: _Server, pid: int, args: list[str]):
        from dtlab.results.liveness import identity
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None
        self._ident = identity(pid)

    def poll(self) -> int | None:
        """The agent's exit status (negative: the signal that ended it), None while it runs."""
        if self.returncode is None:
            with self._server.cond:
                self._settle()
        return self.returncode

    def _settle(self) -> None:
        from dtlab.results.liveness import alive
        if self.pid in self._server.exits:
            self.returncode = self._server.exits[self.pid]
        elif self._server.dead and not alive(self._ident):
            # the server died first (killed): nobody reaped the agent for us, so its status is unknown
            self.returncode = 1
            print(f"dtlab: the warm agent server exited before torchrun's agent (pid {self.pid}); the agent is gone "
                  "and its exit status is unknown", file=sys.stderr)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the agent to end and return its exit status; subprocess.TimeoutExpired after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server.cond:
            while True:
                self._settle()
                if self.returncode is not None:
                    return self.returncode
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                # a dead server sends nothing more: look at the process itself now and then
                self._server.cond.wait(0.05 if self._server.dead else left)

    def send_signal(self, sig: int) -> None:
        """Signal the agent, unless it has ended (its pid may be someone else's by then)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM to the agent, as Popen.terminate."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the agent, as Popen.kill."""
        self.send_signal(signal.SIGKILL)


_SERVERS: dict[tuple, _Server] = {}
_LOCK = threading.Lock()


def fork_agent(args: list[str], env: dict, life_r: int, log_fd: int) -> WarmProc | None:
    """torchrun's agent for `args` (the shim's arguments after its lifeline fd), forked from the warm server for
    `env` (started and waited for when there is none yet), or None when it cannot be: the caller starts it cold."""
    key = server_key(env)
    need = len(b"\0".join(a.encode() for a in [sys.executable, "-c", MARKER, str(life_r)] + args)) + 64
    with _LOCK:
        server = _SERVERS.get(key)
        if server is not None and server.dead and (server.ready or {}).get("ready"):
            _SERVERS.pop(key).close()  # died after serving (killed): start another; one that could not start stays
            server = None
        if server is None:
            for old in [k for k, s in _SERVERS.items() if not s.agents][:max(0, len(_SERVERS) + 1 - MAX_SERVERS)]:
                _SERVERS.pop(old).close()
            try:
                server = _SERVERS[key] = _Server(env)
            except OSError:  # no process could be started for it: this launch starts its agent cold instead
                return None
    ready = server.wait_ready()
    if not ready.get("ready") or ready.get("capacity", 0) < need:
        return None
    pid = server.fork_agent(args, env, life_r, log_fd)
    return None if pid is None else WarmProc(server, pid, [sys.executable, "-c", MARKER, *args])
