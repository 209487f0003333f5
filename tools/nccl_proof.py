#!/usr/bin/env python3
"""Prove which NCCL two ranks load: both on cuda:0 (NCCL's multi-rank mode), the library preloaded as dtlab's
launcher preloads it, a tiny all_reduce checked.

    python3 tools/nccl_proof.py LIB --json OUT.json [--no-cuda] [--timeout 60]

Each rank is started the way dtlab starts NCCL ranks given DTLAB_NCCL_LIBRARY=LIB: LD_PRELOAD with LIB first
(dtlab.config.ncclib.preload_env), NCCL_MULTI_RANK_GPU_ENABLE=1, plus NCCL_DEBUG=INFO. It reports torch's NCCL header
(torch.cuda.nccl.version()), the library it has loaded (ncclGetVersion through ctypes, and the file it lives in) and
whether that is LIB (dtlab.config.ncclib.check_preloaded); then, with CUDA, it joins a 2-rank NCCL group on cuda:0
and all-reduces 1024 floats. NCCL prints "NCCL version X" from the library it really runs when the communicator
is made: both ranks' lines are kept. Without CUDA (or with --no-cuda) the ranks stop after the versions and say
that CUDA was skipped. OUT.json: {ok, library, ranks: [{rank, header, loaded, check, cuda, ...}], nccl_version_lines}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT] if ROOT not in sys.path else []
from dtlab.config.ncclib import ENV, check_preloaded, preload_env  # noqa: E402 - after the path is set

WORLD = 2
VERSION_LINE = re.compile(r"NCCL version \S+")
#: NCCL's other lines worth keeping: its warnings and what it says of ranks sharing a device.
KEPT = re.compile(r"NCCL WARN|MULTI_RANK|Multiple Ranks|Duplicate GPU")


def rank_main(rank: int, port: int, cuda: bool) -> dict:
    """One rank: its NCCL header and loaded library, then (with CUDA) a checked all_reduce on cuda:0."""
    import torch

    out: dict = {"rank": rank, "torch": torch.__version__}
    try:
        out["header"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001 - a torch without NCCL
        out["header"] = f"none ({type(e).__name__})"
    try:
        lib = check_preloaded()
        out.update(loaded=lib.to_dict() if lib else None, check="the loaded library is the one preloaded")
    except RuntimeError as e:
        out.update(loaded=None, check=f"FAILED: {e}")
        return out
    if not cuda or not torch.cuda.is_available():
        out["cuda"] = "skipped: " + ("--no-cuda (dry run)" if not cuda else "no CUDA device here")
        return out
    try:
        out["cuda"] = _all_reduce(rank, port)
    except Exception as e:  # noqa: BLE001 - the failure is the finding: say it, do not lose the versions
        out["cuda"] = f"FAILED: {type(e).__name__}: {e}"
    return out


def _all_reduce(rank: int, port: int) -> str:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, device_id=dev)
    x = torch.full((1024,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    want = float(sum(range(1, WORLD + 1)))
    dist.destroy_process_group()
    return "all_reduce on cuda:0 " + ("ok" if bool(torch.all(x == want)) else f"WRONG: {x[0].item()} != {want}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prove(library: str, cuda: bool, timeout: float) -> dict:
    """Start both ranks, wait for them, and gather what they printed (see the module docstring)."""
    env = dict(os.environ, **{ENV: library}, NCCL_MULTI_RANK_GPU_ENABLE="1", NCCL_DEBUG="INFO")
    env.update(preload_env(env))  # LD_PRELOAD and DTLAB_NCCL_PRELOADED, as dtlab's launcher sets them
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    port = _free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--rank", "RANK", "--port", str(port)]
    cmd += [] if cuda else ["--no-cuda"]
    logs = [tempfile.TemporaryFile() for _ in range(WORLD)]  # files, not pipes: a full pipe would stall a rank
    procs = [
        subprocess.Popen([str(r) if a == "RANK" else a for a in cmd], env=env, stdout=logs[r], stderr=subprocess.STDOUT)
        for r in range(WORLD)
    ]
    ranks, lines, rcs, kept = [], [], [], []
    deadline = time.monotonic() + timeout  # for both ranks together
    for p, log in zip(procs, logs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            note = ""
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            note = f"\n(timed out after {timeout:g} s)"
        log.seek(0)
        text = log.read().decode(errors="replace") + note
        rcs.append(p.returncode)
        lines += VERSION_LINE.findall(text)
        kept += [ln.strip()[:300] for ln in text.splitlines() if KEPT.search(ln)][:20]
        found = [json.loads(ln[len("PROOF ") :]) for ln in text.splitlines() if ln.startswith("PROOF ")]
        ranks.append(found[0] if found else {"rc": p.returncode, "log_tail": text[-1500:]})
    ok = rcs == [0] * WORLD and all(r.get("check", "").startswith("the loaded") for r in ranks)
    ok = ok and all(str(r.get("cuda", "")).endswith(" ok") or str(r.get("cuda")).startswith("skipped") for r in ranks)
    return {
        "ok": ok,
        "library": library,
        "exit_codes": rcs,
        "ranks": ranks,
        "nccl_version_lines": lines,
        "nccl_lines": kept,
    }


def main(argv=None) -> int:
    """Parent (LIB --json OUT) or one rank (--rank K --port P)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("library", nargs="?")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--no-cuda", action="store_true", help="stop after the versions (a dry run)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds both ranks may take")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:
        print("PROOF " + json.dumps(rank_main(args.rank, args.port, not args.no_cuda)), flush=True)
        return 0
    res = prove(os.path.abspath(args.library), not args.no_cuda, args.timeout)
    text = json.dumps(res, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
