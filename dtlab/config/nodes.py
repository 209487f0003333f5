"""Multi-node jobs: the fields every node must agree on, checked before launch, and the status of a
run whose nodes each report on their own. Pure: no torch, no processes (the launching side is
dtlab.launching.nodes; emulation on one host is dtlab.launching.emulate; Slurm is dtlab.launching.slurm).

A job of `nnodes` nodes runs `nproc` ranks on each: world size = nnodes x nproc. Every node starts the same
`dtlab run --nnodes N --rdzv-endpoint HOST:PORT --out DIR ...` (or `dtlab.launch(cfg)`), with DIR on a filesystem
all nodes share. torchrun's c10d rendezvous at HOST:PORT (hosted by the node whose address HOST is) joins them
into one job; ranks are numbered node by node in the order c10d sorts the nodes (`--node-rank` plays no part).
Every rank records its node (torchrun's GROUP_RANK), local rank and host in its start event, so `load_run`
merges all nodes' ranks into one `Run` (`run.ranks`).

In the run directory each node's launcher claims a slot: `nodes/node{k}.json` (host, pid, when), and keeps its
own files beside it: `nodes/node{k}.status.json`, `.exits.json`, `.rendezvous.json` and `logs/torchrun.node{k}.log`.
A slot is the order in which launchers claimed the directory; the node id the ranks record is torchrun's.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re

from dtlab.config.validate import finite, int_at_least

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse_endpoint(text, *, allow_port_0: bool = False) -> tuple[str, int]:
    """'HOST:PORT' (a hostname, an IPv4 address, or [IPv6]:PORT) -> (host, port); ValueError naming the field."""
    m = re.match(r"^\[([0-9A-Fa-f:.]+)\]:(\d+)$", text) if isinstance(text, str) else None
    m = m or (re.match(r"^([A-Za-z0-9][A-Za-z0-9.-]*):(\d+)$", text) if isinstance(text, str) else None)
    low = 0 if allow_port_0 else 1
    if not m or not low <= int(m.group(2)) <= 65535:
        why = "" if allow_port_0 else " (not 0: the other nodes cannot learn a port the OS picks)"
        raise ValueError(
            f"rdzv_endpoint must be HOST:PORT with PORT in {low}..65535{why}, e.g. node001:29500, got {text!r}"
        )
    return m.group(1), int(m.group(2))


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback addresses (127.x, ::1): an endpoint only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_rdzv_id(out: str) -> str:
    """The rendezvous id nodes use when none is given: derived from the run directory's absolute path, so
    nodes started with the same --out join the same job (give --rdzv-id where nodes mount it differently)."""
    return "dtlab-" + hashlib.sha1(os.path.abspath(out).encode()).hexdigest()[:16]


def validate_nodes(cfg) -> None:
    """Refuse bad multi-node fields of a RunConfig or CalibConfig by name; fill in rdzv_id when it is None."""
    int_at_least("nnodes", cfg.nnodes, 1)
    finite("rdzv_timeout_s", cfg.rdzv_timeout_s, "(seconds)", low=0.0)
    if cfg.rdzv_id is not None and not (isinstance(cfg.rdzv_id, str) and _ID.match(cfg.rdzv_id)):
        raise ValueError(
            f"rdzv_id must be 1 to 64 letters, digits, '_', '.' or '-' (starting with a letter or "
            f"digit), got {cfg.rdzv_id!r}"
        )
    if cfg.nnodes == 1:
        if cfg.rdzv_endpoint is not None:
            parse_endpoint(cfg.rdzv_endpoint, allow_port_0=True)
        return
    if cfg.rdzv_endpoint is None:
        raise ValueError(
            f"rdzv_endpoint is needed when nnodes > 1 (got nnodes={cfg.nnodes}): HOST:PORT of the "
            "c10d rendezvous, the same on every node, e.g. --rdzv-endpoint node001:29500"
        )
    parse_endpoint(cfg.rdzv_endpoint)
    if not cfg.out or not isinstance(cfg.out, str):
        raise ValueError(
            f"out is needed when nnodes > 1 (got nnodes={cfg.nnodes}): the run directory, on a "
            "filesystem every node shares, given the same on every node"
        )
    if cfg.rdzv_id is None:
        cfg.rdzv_id = default_rdzv_id(cfg.out)
