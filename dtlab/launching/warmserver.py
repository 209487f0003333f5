"""The warm agent server's own process (dtlab.launching.warm starts it and talks to it): import torch, torch's elastic
agent, transformers' DistilBERT classes and dtlab's rank modules once; then, per request from the launching process,
fork a child that becomes torchrun's agent (its lifeline and log received with the request, its working directory,
umask, CPU set, environment and command line set as a cold agent's would be), and report each agent's exit status
by its request. Ends at end of file on its socket: the launching process closed it or died.

A forked agent's command line is written in place over the server's argument memory (whose size the server
reserves at start), the way `setproctitle` does: the process's command line (psutil's `cmdline()`, `ps`) then names
the run directory and rank module.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
from multiprocessing import resource_tracker

from dtlab.launching import agent

MARKER = "dtlab warm agent"  # a forked agent's `-c` argument (a cold agent's is the shim's source)


_AREA: list[tuple[int, int]] = []  # found once: set_cmdline overwrites what finding it compares


def _arg_area() -> tuple[int, int]:
    """(address, length) of this process's argument memory, (0, 0) if unknown. exec lays the argument strings out
    and the environment's right after them (Linux and macOS alike), so the area ends where C's `environ` has its
    first string; it is taken only when the bytes before that are this process's arguments (sys.orig_argv), each
    NUL-terminated. Found at the first call and remembered."""
    if not _AREA:
        _AREA.append(_find_arg_area())
    return _AREA[0]


def _find_arg_area() -> tuple[int, int]:
    want = b"".join(os.fsencode(a) + b"\0" for a in sys.orig_argv)
    try:
        env = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
        end = env[0] if env else None
    except (OSError, ValueError, AttributeError):
        return 0, 0
    if not end or end <= len(want) or ctypes.string_at(end - len(want), len(want)) != want:
        return 0, 0
    return end - len(want), len(want)


def set_cmdline(args: list[str]) -> bool:
    """Write `args` over this process's argument memory, NUL-padded, so its command line shows them. False
    (nothing written) when they do not fit."""
    start, size = _arg_area()
    data = b"\0".join(os.fsencode(a) for a in args) + b"\0"
    if not start or len(data) > size:
        return False
    ctypes.memmove(start, data.ljust(size, b"\0"), size)
    return True


def _imports() -> None:
    """What every CPU agent and its forked ranks import: torch, torch's elastic agent, transformers' DistilBERT
    and tokenizer classes, dtlab's rank modules."""
    # here, not at the top: the launching process imports this module, and the server reports a failed import to it
    import torch.distributed.run  # noqa: F401
    from torch.distributed.launcher.api import elastic_launch  # noqa: F401

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
    _arg_area()  # before any import may set an environment variable (the area is found from C's environ)
    try:
        _imports()
        resource_tracker.ensure_running()  # one for every agent it forks (see agent.fork_zygote), not one each
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
            _REQ_OF[pid] = req["req"]
            _send(sock, {"req": req["req"], "pid": pid})
            _reap(sock)


_REQ_OF: dict[int, int] = {}  # in the server: the request each live agent was forked for


def _reap(sock: socket.socket) -> None:
    """Report every ended agent by its request (a pid is reused in time; a request number never is)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in _REQ_OF:  # an agent; not the resource tracker, which no launch asked for
            _send(sock, {"exit": _REQ_OF.pop(pid), "pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _become_agent(req: dict, fds: list[int], sock: socket.socket, wake: tuple[int, int]) -> None:
    """In the forked child: become torchrun's agent for the request (never returns)."""
    code = 1
    try:
        _REQ_OF.clear()
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
        os.umask(req["umask"])
        if req.get("cpus") and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, req["cpus"])
        os.environ.clear()
        os.environ.update(req["env"])
        args = [str(life_fd)] + req["args"]
        sys.argv = ["-c"] + args
        set_cmdline([sys.executable, "-c", MARKER] + args)
        agent.WARM = True
        code = _as_interpreter(lambda: agent.agent_main(args))
    except BaseException:  # noqa: BLE001 - setting up failed: say why in the run's torchrun log (fd 2 by now)
        traceback.print_exc()
    finally:
        if code < 0:  # end by that signal, as the interpreter does after an uncaught KeyboardInterrupt
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(1 if code < 0 else code)


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
    except KeyboardInterrupt:  # the interpreter ends by SIGINT then (exit status -2)
        traceback.print_exc()
        code = -signal.SIGINT
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
