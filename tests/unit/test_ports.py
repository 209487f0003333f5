"""Rendezvous ports of launches side by side: a held port is never handed to another launch (in this process or
another), a bind that names it fails, and torchrun's store can still listen on it."""

import datetime
import errno
import socket
import subprocess
import sys

import pytest
from torch.distributed import TCPStore

import dtlab
from dtlab.launching.emulate import Emulation
from dtlab.launching.torchrun import hold_port

_HOLD = """
import sys, time
from dtlab.launching.torchrun import hold_port
held = [hold_port() for _ in range(40)]
print(" ".join(str(s.getsockname()[1]) for s in held), flush=True)
sys.stdin.read()  # hold them until the test closes our stdin
"""


def test_ports_held_side_by_side_are_never_the_same():
    others = [
        subprocess.Popen([sys.executable, "-c", _HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    mine = [hold_port() for _ in range(40)]
    try:
        ports = [s.getsockname()[1] for s in mine]
        for p in others:
            ports += [int(x) for x in p.stdout.readline().split()]
        assert len(ports) == 120 and len(set(ports)) == 120
    finally:
        for p in others:
            p.stdin.close()
            p.wait(timeout=60)
        for s in mine:
            s.close()


def test_a_held_port_is_never_handed_out_again_and_torchruns_store_listens_on_it():
    held = hold_port()
    port = held.getsockname()[1]
    try:
        with socket.socket() as other, pytest.raises(OSError) as e:
            other.bind(("127.0.0.1", port))
        assert e.value.errno == errno.EADDRINUSE
        picked = set()
        for _ in range(2000):  # what another launch's store (port 0, SO_REUSEADDR) would be given
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                other.bind(("127.0.0.1", 0))
                picked.add(other.getsockname()[1])
        assert port not in picked
        store = TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
        store.set("k", "v")
        assert store.get("k") == b"v"
        with socket.socket() as other, pytest.raises(OSError) as e:  # listening now: refused even with reuse
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))
        assert e.value.errno == errno.EADDRINUSE
        del store
    finally:
        held.close()
    with socket.socket() as after:  # released: anyone may bind it again
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", port))


def test_emulated_nodes_on_loopback_hold_their_rendezvous_port_until_closed(tmp_path):
    em = Emulation(2)
    a = em.prepare(dtlab.tiny(out=str(tmp_path / "a")), str(tmp_path / "a"))
    b = em.prepare(dtlab.tiny(out=str(tmp_path / "b")), str(tmp_path / "b"))
    ports = [int(c.rdzv_endpoint.rsplit(":", 1)[1]) for c in (a, b)]
    assert ports[0] != ports[1]
    for port in ports:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    em.close()
    for port in ports:
        with socket.socket() as after:
            after.bind(("127.0.0.1", port))
