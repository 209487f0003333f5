"""A multi-node job emulated on one machine: one torchrun agent per emulated node.

Two modes, one API (`Emulation` is a context manager; `dtlab emulate ...` is its command line):

- loopback (`rate=None`, works anywhere): the agents join one c10d rendezvous on 127.0.0.1, exactly as torch's
  own tests run two agents on one host. The ranks carry different node ids and the run directory is shared,
  so everything multi-node (merging, per-node failure detection, the rendezvous timeout) is exercised; the
  "link" is loopback TCP.
- shaped link (`rate="1gbit"`, needs root and Linux network namespaces): each node's agent runs in its own
  network namespace (`ip netns exec`), the two joined by a veth pair whose both ends are shaped by tc's token
  bucket filter (tbf; this kernel has no netem) to `rate`. gloo is pinned to the veth (GLOO_SOCKET_IFNAME), so
  every byte between nodes crosses the shaped link and `dtlab calibrate` across the nodes recovers its
  bandwidth. Where that is not permitted, `shaping_unavailable()` says why and `Emulation` raises
  EmulationUnavailable with that reason before anything is created.

The namespaces and veths are always torn down (on exit of the `with` block, on error, and at interpreter exit).
The CPU is still shared: emulated nodes compete for the same cores, which a real cluster's nodes do not.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading

from dtlab.launching.nodes import NodeSpec
from dtlab.launching.torchrun import hold_port, unique_dir

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}  # tc's units are decimal, in bits per second
_LIVE: set[Emulation] = set()
_SERIAL = itertools.count()
STORE_PORT = 29500  # inside the head node's own, fresh network namespace nothing else can hold a port


class EmulationUnavailable(RuntimeError):
    """This machine cannot emulate a shaped link (not root, no `ip`/`tc`, namespaces refused): `reason` says which."""

    def __init__(self, reason: str):
        super().__init__(f"cannot emulate a shaped inter-node link here: {reason}")
        self.reason = reason


def parse_rate(text: str) -> float:
    """A tc rate ('1gbit', '250mbit', '800kbit') in bytes per second (B/s): 1gbit = 125,000,000 B/s."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)\s*", str(text).lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"rate must be a positive tc rate such as 1gbit, 250mbit or 800kbit (bits per second), got {text!r}"
        )
    return float(m.group(1)) * _UNITS[m.group(2)] / 8


def shaping_unavailable() -> str | None:
    """Why a shaped link cannot be emulated here (None when it can): Linux, root, `ip` and `tc` on PATH, and
    permission to create a network namespace (tried with a throwaway one, removed again)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces and shaping links needs root (run as root, or use loopback: rate=None)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH (install iproute2)"
    probe = f"dtlab-probe-{os.getpid()}"
    cp = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if cp.returncode != 0:
        return f"`ip netns add` refused: {cp.stderr.strip() or cp.returncode} (a container without CAP_SYS_ADMIN?)"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Emulation:
    """`nnodes` emulated nodes on this machine; loopback when `rate` is None, else a tc-shaped veth link of
    `rate` (e.g. '1gbit') each way between network namespaces (2 nodes). Use as a context manager:

        with Emulation(2, rate="1gbit") as em:
            run = em.run(dtlab.tiny(nproc=1))            # one run, its ranks on 2 nodes
            profile = em.calibrate(CalibConfig(nproc=1))  # alpha, beta of the shaped link
    """

    def __init__(self, nnodes: int = 2, rate: str | None = None):
        if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 2:
            raise ValueError(f"nnodes must be an integer >= 2 to emulate a multi-node job, got {nnodes!r}")
        self.nnodes, self.rate = nnodes, rate
        self.rate_Bps = parse_rate(rate) if rate is not None else None
        if rate is not None and nnodes != 2:
            raise ValueError(f"nnodes must be 2 with a shaped link (one veth pair), got {nnodes}")
        tag = f"{os.getpid() % 100_000}{next(_SERIAL) % 10}"  # unique per process and per Emulation in it
        self.namespaces = [f"dtlab{tag}n{k}" for k in range(nnodes)] if rate is not None else []
        self.ifnames = [f"dtl{tag}v{k}" for k in range(nnodes)] if rate is not None else []
        self.addresses = [f"10.213.0.{k + 1}" for k in range(nnodes)] if rate is not None else []
        self._created: list[str] = []
        self._ports: list = []  # loopback rendezvous ports held until close(): no other launch can take one

    # ---- the link -------------------------------------------------------------------------------------------
    def __enter__(self) -> Emulation:
        if self.rate is not None:
            reason = shaping_unavailable()
            if reason:
                raise EmulationUnavailable(reason)
            try:
                self._build()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _LIVE.add(self)
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        a, b = self.ifnames
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        self._created.append(f"veth:{a}")  # in the root namespace until moved: deleted by name if still there
        burst = max(int(self.rate_Bps / 1000), 16_000)  # 1 ms at the rate: small enough to keep the rate honest
        for ns, ifname, addr in zip(self.namespaces, self.ifnames, self.addresses):
            _ip("link", "set", ifname, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _run(
                [
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    ifname,
                    "root",
                    "tbf",
                    "rate",
                    self.rate.strip().lower(),
                    "burst",
                    str(burst),
                    "latency",
                    "50ms",
                ]
            )

    def close(self) -> None:
        """Delete the namespaces (their veth ends go with them) and release the held ports. Safe to call twice."""
        for sock in self._ports:
            sock.close()
        self._ports = []
        for name in reversed(self._created):
            cmd = ["link", "del", name[5:]] if name.startswith("veth:") else ["netns", "del", name]
            subprocess.run(["ip", *cmd], capture_output=True)  # a veth already moved is gone with its namespace
        self._created = []
        _LIVE.discard(self)

    def describe(self) -> dict:
        """What the nodes are joined by, for the run directory (emulation.json) and profiles."""
        if self.rate is None:
            return {"nnodes": self.nnodes, "mode": "loopback", "link": "loopback TCP (no shaping)"}
        return {
            "nnodes": self.nnodes,
            "mode": "netns",
            "rate": self.rate,
            "rate_bytes_per_s": self.rate_Bps,
            "link": f"veth pair shaped by tc tbf to {self.rate} ({self.rate_Bps:,.0f} B/s) each way",
            "namespaces": list(self.namespaces),
            "addresses": list(self.addresses),
        }

    # ---- jobs ----------------------------------------------------------------------------------------------
    def specs(self) -> list[NodeSpec]:
        """How each node's agent is started: in its namespace, gloo on its veth, node 0 hosting the store."""
        if self.rate is None:
            return [NodeSpec() for _ in range(self.nnodes)]
        return [
            NodeSpec(
                prefix=("ip", "netns", "exec", ns),
                env={"GLOO_SOCKET_IFNAME": ifn, "TP_SOCKET_IFNAME": ifn},
                local_addr=addr,
                is_host=k == 0,
            )
            for k, (ns, ifn, addr) in enumerate(zip(self.namespaces, self.ifnames, self.addresses))
        ]

    def prepare(self, cfg, default_dir: str):
        """`cfg` (a RunConfig or CalibConfig) with nnodes, the rendezvous endpoint and a run directory filled in."""
        if self.rate is not None and not self._created:
            raise RuntimeError("the emulated link is not set up: use `with Emulation(...) as em:`")
        if self.rate is None:
            self._ports.append(hold_port())
            endpoint = f"127.0.0.1:{self._ports[-1].getsockname()[1]}"
        else:
            endpoint = f"{self.addresses[0]}:{STORE_PORT}"
        out = cfg.out or unique_dir(os.path.dirname(default_dir) or ".", os.path.basename(default_dir))
        # gloo unless asked otherwise: the emulated link carries gloo's sockets only (NCCL between ranks of one
        # host takes shared memory or P2P, bypassing it), and the nodes' ranks share this machine's GPUs, which
        # NCCL before 2.30 refuses (each node would put its local rank 0 on cuda:0)
        backend = "gloo" if cfg.backend == "auto" else cfg.backend
        return dataclasses.replace(
            cfg, nnodes=self.nnodes, rdzv_endpoint=endpoint, rdzv_id=None, out=out, backend=backend
        )

    def launch(self, cfg) -> list:
        """Start every node of a training run; returns their Handles (node 0's first)."""
        # the launcher (pandas, scipy) only here: `dtlab emulate check` and the namespaces need none of it
        from dtlab.launching.handle import launch

        cfg = self.prepare(cfg, f"runs/{cfg.strategy}-{cfg.model}-{self.nnodes}x{cfg.nproc or 2}")
        handles = [launch(cfg, node=spec) for spec in self.specs()]
        self._record(handles[0].run_dir)
        return handles

    def run(self, cfg, progress: bool = True):
        """Run a training config on the emulated nodes; the merged `Run` (RunFailed if any node failed)."""
        return wait_all(self.launch(cfg), progress)

    def calibrate(self, cfg, progress: bool = True):
        """Calibrate across the emulated nodes (cfg: a CalibConfig; nproc ranks per node); the `Profile`."""
        from dtlab.launching.calibration import launch_calibration  # not at the top: see launch()

        cfg = self.prepare(cfg, f"profiles/calib-{self.nnodes}x{cfg.nproc}")
        handles = [launch_calibration(cfg, spec) for spec in self.specs()]
        self._record(handles[0].run_dir)
        return wait_all(handles, progress)

    def _record(self, run_dir: str) -> None:
        with open(os.path.join(run_dir, "emulation.json"), "w") as f:
            json.dump(self.describe(), f, indent=2)


def wait_all(handles: list, progress: bool = True):
    """Wait for every node's Handle (each in a thread, each with its own watchdog); node 0's result. If any
    node failed, raise the RunFailed that names a culprit rank (else the first one). Ctrl-C stops them all."""
    results, errors = [None] * len(handles), [None] * len(handles)

    def one(i):
        try:
            results[i] = handles[i].wait(progress=progress and i == 0)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(handles))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        for h in handles:
            h.stop(grace_s=3.0)
        raise
    failed = [e for e in errors if e is not None]
    if failed:
        raise next((e for e in failed if getattr(e, "rank", None) is not None), failed[0])
    return results[0]


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str]) -> None:
    cp = subprocess.run(cmd, capture_output=True, text=True)
    if cp.returncode != 0:
        raise EmulationUnavailable(f"`{' '.join(cmd)}` failed: {cp.stderr.strip() or cp.returncode}")


@atexit.register
def _teardown_all() -> None:
    """No namespace outlives the Python process that made it."""
    for em in list(_LIVE):
        em.close()
