"""Fork while other threads do what torchrun's agent's threads do, and see whether a child finds a lock held.

A fork copies only the forking thread; a lock that another thread held at that instant stays held in the child for
good. torch's elastic agent forked CPU ranks from its main thread while its TCPStore server (a libuv thread) served
the ranks already started, and dtlab's exit watch started a thread per rank. One launch in 495 hung with a rank
inside torch's TCPStore client constructor. This reproducer does the same things, many times a second:

- the parent runs a TCPStore server (as the agent's rendezvous does) and threads that, in a loop: connect TCPStore
  clients to it and add to a key (ranks already forked connecting, the agent's keep-alive), resolve host names
  (`getaddrinfo` of "localhost" and of the host's name, `getfqdn`: glibc's resolver and its interface check), log
  through Python's logging, and start short threads (the exit watch's one per rank);
- the main thread starts children, up to `--inflight` at once, with multiprocessing as torch's elastic agent starts
  ranks: `--via fork` forks them from this process, threads and all (torch's agent before the zygote); `--via
  zygote` has dtlab's zygote fork them (`dtlab.launching.agent.fork_zygote`, forked before any thread and before
  the store). Each child connects a TCPStore client to the parent's server (host `--host`, 127.0.0.1 as a rank of
  a single-node dtlab run), adds to a key and exits 0.

`--threads store` leaves the parent only the store server's own thread (it formats every new connection's peer
address, the ranks' connections in a real launch); `--threads all` adds the Python threads above.

A child that has not ended `--stuck-s` seconds after its fork (its store timeout is shorter: a connect that merely
times out ends with an error, which is counted apart) is stuck: every thread's native stack (gdb `thread apply all
bt`) is saved to OUT/stuck-N.txt with the parent's, its Python stack to OUT/python-stacks.txt (faulthandler,
registered for SIGUSR1 before the forks), then the child is killed. Run it at low priority and bounded:

    nice -n 10 python benchmarks/fork_lock.py --via fork --minutes 5 --max-stuck 3 --out /tmp/forklock

Prints counts (children started, ended well, with an error, stuck) as JSON, also kept in OUT/counts.json as they
change; not a test.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from datetime import timedelta

import psutil
import torch.distributed as dist
from launch_stress import native_stacks  # benchmarks/ is this script's folder: on sys.path

from dtlab.launching.agent import fork_zygote

_STOP = threading.Event()


def _clients(port: int, host: str) -> None:
    n = 0
    while not _STOP.is_set():
        try:
            s = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
            s.add("parent", 1)
            del s
        except Exception:  # noqa: BLE001 - a busy machine's timeout: keep going
            pass
        n += 1


def _resolver(port: int) -> None:
    name = socket.gethostname()
    while not _STOP.is_set():
        for host in ("localhost", name, "127.0.0.1"):
            try:
                socket.getaddrinfo(host, port)
            except OSError:
                pass
        socket.getfqdn()


def _logger(path: str) -> None:
    log = logging.getLogger("forklock")
    log.addHandler(logging.FileHandler(path))
    log.setLevel(logging.INFO)
    while not _STOP.is_set():
        log.info("a line from the agent's stand-in, %s", time.time())
        time.sleep(0.001)


def _churn() -> None:
    while not _STOP.is_set():
        t = threading.Thread(target=time.sleep, args=(0.001,), daemon=True)
        t.start()
        t.join()


def _child(host: str, port: int, timeout_s: float) -> None:
    code = 1
    try:
        s = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        s.add("children", 1)
        code = 0
    finally:
        os._exit(code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--via", choices=("fork", "zygote"), default="fork", help="who forks the children")
    ap.add_argument("--threads", choices=("all", "store"), default="all", help="threads in the parent")
    ap.add_argument("--minutes", type=float, default=5.0, help="how long to keep starting children")
    ap.add_argument("--max-stuck", type=int, default=0, help="stop after this many stuck children (0: no limit)")
    ap.add_argument("--inflight", type=int, default=4, help="children alive at once")
    ap.add_argument("--host", default="127.0.0.1", help="the host a child's store client connects to")
    ap.add_argument("--child-timeout-s", type=float, default=10.0, help="a child's store timeout (s)")
    ap.add_argument("--stuck-s", type=float, default=30.0, help="a child alive this long after its start is stuck")
    ap.add_argument("--out", required=True, help="folder for the stacks of stuck children and the counts")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    pystacks = open(os.path.join(a.out, "python-stacks.txt"), "w")  # noqa: SIM115 - open while children live
    faulthandler.register(signal.SIGUSR1, file=pystacks, all_threads=True)  # inherited: a stuck child's stack
    if a.via == "zygote":
        fork_zygote()  # before the store and every thread, as the agent does
    ctx = multiprocessing.get_context("forkserver" if a.via == "zygote" else "fork")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's store
    port = server.port
    if a.threads == "all":
        for target, args in ((_clients, (port, a.host)), (_resolver, (port,)), (_logger, (f"{a.out}/log.txt",))):
            threading.Thread(target=target, args=args, daemon=True).start()
        threading.Thread(target=_churn, daemon=True).start()
    counts = {"via": a.via, "threads": a.threads, "parent_threads": psutil.Process().num_threads()}
    counts.update(started=0, ok=0, error=0, stuck=0, seconds=0.0)
    t0 = time.monotonic()
    live: dict = {}  # process -> start time

    def going() -> bool:
        return time.monotonic() < t0 + 60 * a.minutes and not (a.max_stuck and counts["stuck"] >= a.max_stuck)

    while going() or live:
        while len(live) < a.inflight and going():
            p = ctx.Process(target=_child, args=(a.host, port, a.child_timeout_s))
            p.start()
            live[p] = time.monotonic()
            counts["started"] += 1
        for p in list(live):
            if p.exitcode is not None:
                counts["ok" if p.exitcode == 0 else "error"] += 1
            elif time.monotonic() - live[p] > a.stuck_s:
                counts["stuck"] += 1
                os.kill(p.pid, signal.SIGUSR1)
                time.sleep(1)
                child = native_stacks(p.pid)
                if "get_locked_global" in child:  # glibc's resolver configuration lock (resolv/resolv_conf.c)
                    counts["on_resolver_lock"] = counts.get("on_resolver_lock", 0) + 1
                with open(os.path.join(a.out, f"stuck-{counts['stuck']}.txt"), "w") as f:
                    f.write(child + native_stacks(os.getpid()))
                p.kill()
                p.join()
            else:
                continue
            del live[p]
            counts["seconds"] = round(time.monotonic() - t0, 1)
            with open(os.path.join(a.out, "counts.json"), "w") as f:
                json.dump(counts, f)
        time.sleep(0.001)
    _STOP.set()
    counts["children_added"] = int(server.add("children", 0))
    with open(os.path.join(a.out, "counts.json"), "w") as f:
        json.dump(counts, f)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
