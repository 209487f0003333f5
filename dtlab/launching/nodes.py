"""One node's part of a job: claiming the (shared) run directory, starting this node's torchrun agent, and
saying which node is missing when the rendezvous fails. The fields and the file layout are dtlab.config.nodes's.

- `NodeSpec`: how this node's agent is started where dtlab.launching.emulate needs more than the defaults (a command
  prefix such as `ip netns exec NS`, extra environment, the address other nodes reach it at, whether it hosts
  the rendezvous store).
- `NodeLaunch`: what the agent and the Handle need (run directory, slot, rendezvous), and where this node's
  files go (`path`, `log_path`). A single-node job is a NodeLaunch with slot None and the old file names.
- `start_job(cfg, ...)`: claim the directory (slot 0 writes config.json, later slots check theirs against it),
  start the agent, record the node; used by training runs and calibration alike.
- `rendezvous_sentence`: the one-paragraph reason a node's rendezvous failed, naming the missing nodes.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field

from dtlab.config.nodes import is_loopback, parse_endpoint
from dtlab.launching.agent import start_method
from dtlab.launching.torchrun import (
    check_omp_threads,
    prepare_dir,
    release_lifeline,
    signal_group,
    start_torchrun,
    write_status,
)
from dtlab.launching.warm import enabled as warm_enabled
from dtlab.results.liveness import identity
from dtlab.results.status import RunFailed, node_statuses
from dtlab.runfiles import DiskFull, dump_json

CONFIG_WAIT_S = 60.0  # how long a joining node waits for slot 0 to write config.json


@dataclass(frozen=True)
class NodeSpec:
    """How this node's agent is started. prefix: command words before python (e.g. ('ip', 'netns', 'exec',
    'NS')); env: extra environment for the agent and its ranks; local_addr: the address other nodes reach this
    node at (torchrun's --local-addr; None: its hostname); is_host: whether this node hosts the rendezvous
    store (None: decided from the endpoint, see `_hosts_store`)."""

    prefix: tuple = ()
    env: dict = field(default_factory=dict)
    local_addr: str | None = None
    is_host: bool | None = None


@dataclass(frozen=True)
class NodeLaunch:
    """One node's part of a job: nproc ranks, slot k of nnodes (None: a single-node job), the rendezvous."""

    run_dir: str
    nproc: int
    nnodes: int = 1
    slot: int | None = None
    endpoint: str = "127.0.0.1:0"
    rdzv_id: str = ""
    timeout_s: float = 600.0
    spec: NodeSpec = field(default_factory=NodeSpec)

    @property
    def multi(self) -> bool:
        """True for one node of several (its ranks are found by slot, its files are per node)."""
        return self.slot is not None

    def path(self, what: str) -> str:
        """This node's `what` file: RUN/{what}.json alone, RUN/nodes/node{k}.{what}.json in a multi-node job."""
        if not self.multi:
            return os.path.join(self.run_dir, f"{what}.json")
        return os.path.join(self.run_dir, "nodes", f"node{self.slot}.{what}.json")

    def log_path(self) -> str:
        """torchrun's own log for this node."""
        return os.path.join(self.run_dir, "logs", "torchrun.log" if not self.multi else f"torchrun.node{self.slot}.log")

    def agent_args(self, is_host: bool | None) -> list[str]:
        """torchrun's rendezvous flags for this node."""
        conf = f"join_timeout={math.ceil(self.timeout_s)},read_timeout={max(10, math.ceil(self.timeout_s))}"
        if is_host is not None:
            conf += f",is_host={int(is_host)}"
        local = self.spec.local_addr or (
            "127.0.0.1" if is_loopback(parse_endpoint(self.endpoint, allow_port_0=True)[0]) else None
        )
        return [
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={conf}",
        ] + ([f"--local-addr={local}"] if local else [])


def start_job(cfg, key: str, body: dict, facts: dict, module: str, gloo_threads: bool, spec: NodeSpec | None = None):
    """Claim cfg.out for this node (creating config.json = {key: body, "launch": facts} if first), start the
    agent running `module`; returns (NodeLaunch, Popen). ValueError (nothing started) if the directory holds
    another run, all node slots are taken, or this node's config differs from the one the run was started with."""
    spec = spec or NodeSpec()
    check_omp_threads({**os.environ, **spec.env})
    start_method(gloo_threads, {**os.environ, **spec.env})  # a bad DTLAB_START_METHOD is refused here, by name
    warm_enabled({**os.environ, **spec.env})  # and a bad DTLAB_WARM_AGENT
    doc = {key: body, "launch": facts}
    if cfg.nnodes == 1:
        existed = os.path.isdir(cfg.out)
        out = prepare_dir(cfg.out)
        try:
            dump_json(doc, os.path.join(out, "config.json"))
        except DiskFull as e:
            _unclaim(out, existed)
            raise _disk_full_at_launch(e, out) from None
        node = NodeLaunch(
            out,
            cfg.nproc,
            endpoint=cfg.rdzv_endpoint or "127.0.0.1:0",
            rdzv_id=cfg.rdzv_id or uuid.uuid4().hex,
            timeout_s=cfg.rdzv_timeout_s,
            spec=spec,
        )
    else:
        try:
            out, slot = _claim(os.path.abspath(cfg.out), key, doc, cfg.nnodes)
        except DiskFull as e:
            raise _disk_full_at_launch(e, os.path.abspath(cfg.out)) from None
        node = NodeLaunch(out, cfg.nproc, cfg.nnodes, slot, cfg.rdzv_endpoint, cfg.rdzv_id, cfg.rdzv_timeout_s, spec)
    is_host = spec.is_host if spec.is_host is not None else _hosts_store(node.endpoint)
    proc = start_torchrun(
        out,
        cfg.nproc,
        module,
        gloo_threads,
        node=node,
        is_host=is_host,
        max_restarts=cfg.restarts.max_restarts if hasattr(cfg, "restarts") else 0,
    )
    try:
        if node.multi:
            dump_json(
                {
                    "slot": node.slot,
                    "host": socket.gethostname(),
                    "launcher_pid": os.getpid(),
                    "agent_pid": proc.pid,
                    "endpoint": node.endpoint,
                    "rdzv_id": node.rdzv_id,
                    "is_host": is_host,
                    "time": time.time(),
                },
                os.path.join(out, "nodes", f"node{node.slot}.json"),
            )
            dump_json(
                {
                    "state": "running",
                    "pid": proc.pid,
                    "started": time.time(),
                    "agent": identity(proc.pid),
                    "launcher": identity(os.getpid()),
                },
                node.path("status"),
            )
        else:
            write_status(out, "running", pid=proc.pid, started=time.time())
    except DiskFull as e:  # nothing could say the run is running: stop it before it writes anything more
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        release_lifeline(proc)
        raise _disk_full_at_launch(e, out, started=True) from None
    return node, proc


def _unclaim(out: str, existed: bool) -> None:
    """Undo prepare_dir after config.json could not be written: remove the empty events/ (and `out` itself when
    this launch created it and it is empty), so the same `out` can be used once there is space."""
    for d in [os.path.join(out, "events")] + ([out] if not existed else []):
        try:
            os.rmdir(d)
        except OSError:
            pass


def _disk_full_at_launch(e: DiskFull, out: str, started: bool = False) -> RunFailed:
    """The RunFailed of a launch whose run directory could not be written (nothing runs when it is raised)."""
    what = "its agent was stopped before any rank ran" if started else "nothing was started"
    return RunFailed(
        f"disk full: {e}. Run directory {out}: {what}; free space there, or choose another `out`.",
        error=f"disk full: {e}",
        run_dir=out,
        state="failed",
    )


def _claim(out: str, key: str, doc: dict, nnodes: int) -> tuple[str, int]:
    """Take the first free node slot of `out` (an exclusive create of nodes/node{k}.json). Slot 0 claims the
    directory itself and writes config.json; a later slot waits for it and checks that its config is the same."""
    os.makedirs(os.path.join(out, "nodes"), exist_ok=True)
    for k in range(nnodes):
        claim = os.path.join(out, "nodes", f"node{k}.json")
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue
        try:
            if k == 0:
                prepare_dir(out)  # refuses a directory that holds another run
                dump_json(doc, os.path.join(out, "config.json"))
            else:
                _check_same(out, key, doc[key])
        except BaseException:
            os.unlink(claim)
            raise
        return out, k
    raise ValueError(
        f"out: {out!r} already holds a run of {nnodes} nodes (all {nnodes} node slots are claimed); "
        "choose a new directory (runs are never overwritten)"
    )


def _check_same(out: str, key: str, mine: dict) -> None:
    path = os.path.join(out, "config.json")
    deadline = time.monotonic() + CONFIG_WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise ValueError(
                f"out: node slot 0 of {out!r} was claimed but wrote no config.json within "
                f"{CONFIG_WAIT_S:g} s; its launcher failed: see its output"
            )
        time.sleep(0.1)
    with open(path) as f:
        theirs = json.load(f).get(key)
    mine = json.loads(json.dumps(mine, default=str))  # compared as written: tuples are lists there
    if theirs is None:
        raise ValueError(f"out: {out!r} holds a different kind of run (no {key!r} in its config.json)")
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if diff:
        raise ValueError(
            f"this node's config differs from the run started in {out!r} in: "
            + "; ".join(f"{k} = {mine.get(k)!r} here, {theirs.get(k)!r} there" for k in diff)
            + ". Every node must be started with the same settings"
        )


def _hosts_store(endpoint: str) -> bool | None:
    """True when the endpoint's host is an address of this machine that torch would not recognise as its own
    (a secondary interface), so this node must host the store; None lets torch decide (loopback, our hostname,
    another machine, or the port already taken here: then another agent on this machine hosts it)."""
    host, port = parse_endpoint(endpoint, allow_port_0=True)
    if is_loopback(host) or host == socket.gethostname():
        return None
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    for *_, addr in infos:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(addr)
                return True
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    return None
    return None


def rendezvous_sentence(node: NodeLaunch) -> str | None:
    """Why this node's rendezvous failed, naming the endpoint and the missing nodes; None if it did not fail
    there (the agent's shim writes `node.path('rendezvous')` when torchrun raises a RendezvousError)."""
    try:
        with open(node.path("rendezvous")) as f:
            err = json.load(f)
    except (OSError, ValueError):
        return None
    where = f"rendezvous {node.endpoint} (id {node.rdzv_id})"
    if not node.multi:
        return f"{err['error']} at {where}: {err.get('message') or 'see logs/torchrun.log'}"
    claims = _claims(node.run_dir)
    here = sorted(claims)
    missing = [k for k in range(node.nnodes) if k not in claims]
    joined = "; ".join(
        f"node slot {k} (host {c.get('host', '?')}, agent pid {c.get('agent_pid', '?')})"
        for k, c in sorted(claims.items())
    )
    how = (
        f"timed out after rdzv_timeout_s={node.timeout_s:g} s"
        if err["error"] == "RendezvousTimeoutError"
        else "could not reach the rendezvous store: no agent hosts it there (is the node whose address the endpoint "
        "names started, and reachable from here?)"
        if err["error"] == "RendezvousConnectionError"
        else f"failed ({err['error']}: {err.get('message')})"
    )
    s = f"{where} {how}: {len(here)} of {node.nnodes} nodes started a launcher for {node.run_dir} ({joined})."
    if missing:
        s += (
            f" Missing: node slot(s) {', '.join(map(str, missing))} - no launcher claimed them; start "
            f"`dtlab run --nnodes {node.nnodes} --rdzv-endpoint {node.endpoint} --out {node.run_dir} ...` there."
        )
    others = {c.get("endpoint") for c in claims.values()} - {node.endpoint}
    if others:
        s += f" Not every node was given this endpoint: also {', '.join(sorted(map(str, others)))}."
    return s


def _claims(run_dir: str) -> dict[int, dict]:
    out = {}
    for p in sorted(glob.glob(os.path.join(run_dir, "nodes", "node*.json"))):
        name = os.path.basename(p)[4:-5]
        if name.isdigit():
            try:
                with open(p) as f:
                    out[int(name)] = json.load(f)
            except (OSError, ValueError):
                out[int(name)] = {}
        # node{k}.status.json and friends are not claims
    return out


def wait_for_nodes(run_dir: str, timeout_s: float) -> bool:
    """Wait until every node that claimed a slot of the run has reported an end state (or `timeout_s` seconds
    passed); True if all did. Lets one node name a culprit on another node, and load a run whose other nodes
    are still closing."""
    deadline = time.monotonic() + timeout_s
    while True:
        claimed, per = _claims(run_dir), node_statuses(run_dir)
        if all(per.get(k, {}).get("state", "running") != "running" for k in claimed):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
