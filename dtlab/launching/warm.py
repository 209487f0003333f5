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

The server's own side (its imports, forking, the agent's setup) is dtlab.launching.warmserver.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from dtlab.launching.warmserver import MARKER
from dtlab.results.liveness import alive, identity

_LOG = logging.getLogger(__name__)

#: DTLAB_WARM_AGENT: '1' (default) forks CPU jobs' agents from a warm server; '0' starts each one afresh.
WARM_VALUES = ("0", "1")
#: Bytes of argument memory the server reserves for the command lines of the agents it forks.
CMDLINE_BYTES = 16384
_SERVE = "from dtlab.launching.warmserver import serve; serve()"
MAX_SERVERS = 3  # idle servers kept per launching process (one per environment)
READY_TIMEOUT_S = 300.0  # a server not ready by then (its imports hang) is stopped; launches start agents cold
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def enabled(environ=os.environ) -> bool:
    """Whether CPU jobs' agents come from a warm server. ValueError naming DTLAB_WARM_AGENT when it holds
    anything but 0 or 1."""
    v = environ.get("DTLAB_WARM_AGENT", "").strip() or "1"
    if v not in WARM_VALUES:
        raise ValueError(
            f"DTLAB_WARM_AGENT must be 0 or 1, got {v!r} in the environment; 0 starts torchrun's "
            "agent afresh for every CPU run, 1 (the default) forks it from a warm server"
        )
    return v == "1"


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
    return (
        sys.executable,
        _source_stamp(),
        tuple(sorted((k, v) for k, v in env.items() if not k.startswith("DTLAB_") and k != "PYTEST_CURRENT_TEST")),
    )


class _Server:
    """The launcher's side of one server: its process, the socket, a thread reading replies and exit statuses."""

    def __init__(self, env: dict):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVE, str(theirs.fileno()), " " * CMDLINE_BYTES],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        except BaseException:
            self.sock.close()
            raise
        finally:
            theirs.close()
        self.cond = threading.Condition()
        self.ready: dict | None = None
        self.replies: dict[int, dict] = {}  # request -> the server's answer (its agent's pid, or why none)
        self.exits: dict[int, int] = {}  # request -> its agent's exit status, until its WarmProc takes it
        self.busy: set[int] = set()  # requests sent whose agent has not been reported ended
        self.dead = False
        self._next = 0
        threading.Thread(target=self._read, daemon=True, name="dtlab-warm-agent-reader").start()

    def _read(self) -> None:
        try:
            while True:
                try:
                    msg = self.sock.recv(1 << 20)
                except OSError:
                    msg = b""
                if not msg:
                    return
                doc = json.loads(msg)
                with self.cond:
                    if "ready" in doc:
                        self.ready = doc
                    elif "exit" in doc:
                        self.exits[doc["exit"]] = doc["returncode"]
                        self.busy.discard(doc["exit"])
                    else:
                        self.replies[doc["req"]] = doc
                        if "pid" not in doc:
                            self.busy.discard(doc["req"])
                    self.cond.notify_all()
        finally:  # whatever ended the reading (end of file, a bad message), nothing more will come
            with self.cond:
                self.dead = True
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

    def reserve(self) -> int:
        """A new request number, counted busy from now on (so the server is not closed under it)."""
        with self.cond:
            self._next += 1
            self.busy.add(self._next)
            return self._next

    def fork_agent(self, req: int, args: list[str], env: dict, life_r: int, log_fd: int) -> int | None:
        """Ask for request `req`'s agent; its pid, or None when the server could not fork one."""
        try:
            try:
                cpus = sorted(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                cpus = None
            umask = os.umask(0o022)
            os.umask(umask)
            msg = json.dumps(
                {"req": req, "args": args, "env": env, "cwd": os.getcwd(), "umask": umask, "cpus": cpus}
            ).encode()
            socket.send_fds(self.sock, [msg], [life_r, log_fd])
        except (OSError, ValueError):  # a deleted working directory, an environment too large for one message
            with self.cond:
                self.busy.discard(req)
            return None
        with self.cond:
            self.cond.wait_for(lambda: req in self.replies or self.dead)
            reply = self.replies.pop(req, None)
            return None if reply is None or "pid" not in reply else reply["pid"]

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

    def __init__(self, server: _Server, req: int, pid: int, args: list[str]):
        self._server, self._req, self.pid, self.args = server, req, pid, args
        self.returncode: int | None = None
        self._ident = identity(pid)

    def poll(self) -> int | None:
        """The agent's exit status (negative: the signal that ended it), None while it runs."""
        if self.returncode is None:
            with self._server.cond:
                self._settle()
        return self.returncode

    def _settle(self) -> None:
        if self._req in self._server.exits:
            self.returncode = self._server.exits.pop(self._req)
        elif self._server.dead and not alive(self._ident):
            # the server died first (killed): nobody reaped the agent for us, so its status is unknown
            self.returncode = 1
            _LOG.warning(
                f"dtlab: the warm agent server exited before torchrun's agent (pid {self.pid}); the agent is gone "
                "and its exit status is unknown"
            )

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
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM to the agent, as Popen.terminate."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the agent, as Popen.kill."""
        self.send_signal(signal.SIGKILL)


_SERVERS: dict[tuple, _Server] = {}
_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    """In a child forked from a launching process: the parent's servers answer the parent only (their reader
    threads did not come along), so the child starts its own; its copies of their sockets are closed."""
    global _LOCK
    _LOCK = threading.Lock()
    for server in _SERVERS.values():
        try:
            server.sock.close()
        except OSError:
            pass
    _SERVERS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def fork_agent(args: list[str], env: dict, life_r: int, log_fd: int) -> WarmProc | None:
    """torchrun's agent for `args` (the shim's arguments after its lifeline fd), forked from the warm server for
    `env` (started and waited for when there is none yet), or None when it cannot be: the caller then starts it
    cold, with a new lifeline (closing this one stops an agent the server may have forked before it failed)."""
    key = server_key(env)
    need = len(b"\0".join(os.fsencode(a) for a in [sys.executable, "-c", MARKER, str(life_r)] + args)) + 64
    with _LOCK:
        server = _SERVERS.get(key)
        if server is not None and server.dead and (server.ready or {}).get("ready"):
            _SERVERS.pop(key).close()  # died after serving (killed): start another; one that could not start stays
            server = None
        if server is None:
            idle = [k for k, s in _SERVERS.items() if not s.busy]
            for old in idle[: max(0, len(_SERVERS) + 1 - MAX_SERVERS)]:
                _SERVERS.pop(old).close()
            try:
                server = _SERVERS[key] = _Server(env)
            except OSError:  # no process could be started for it: this launch starts its agent cold instead
                return None
        req = server.reserve()  # under _LOCK: no other launch can close this server from now on
    ready = server.wait_ready()
    if not ready.get("ready") or ready.get("capacity", 0) < need:
        with server.cond:
            server.busy.discard(req)
        return None
    pid = server.fork_agent(req, args, env, life_r, log_fd)
    return None if pid is None else WarmProc(server, req, pid, [sys.executable, "-c", MARKER, *args])
