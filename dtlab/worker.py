"""The rank's entry point, started by torchrun: `python -m dtlab.worker RUN_DIR`.

Thin on purpose (build, run, always tear down): everything the rank learns goes into the run directory,
which is the only interface back to the notebook.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time
import traceback

from .config import RunConfig, dump_json


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = argv[0]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _die_with_parent()
    _redirect_output(os.path.join(run_dir, "logs", f"rank{rank}.log"))

    from .recorder import EventWriter
    writer = EventWriter(os.path.join(run_dir, "events", f"rank{rank}.jsonl"))
    writer.write("start", rank=rank, world_size=world, pid=os.getpid(), host=socket.gethostname(),
                 time=time.time())
    ok = False
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            cfg = RunConfig.from_dict(json.load(f)["config"])
        if cfg.strategy == "ddp":
            from .ddp import train
        else:
            from .zero3 import train
        train(cfg, run_dir, rank, world, writer)
        writer.write("done", rank=rank, time=time.time())
        ok = True
        return 0
    except BaseException as e:  # noqa: BLE001 - record even KeyboardInterrupt/SystemExit, then exit non-zero
        tb = traceback.format_exc()
        writer.write("error", rank=rank, time=time.time(), error=f"{type(e).__name__}: {e}", traceback=tb)
        print(tb, file=sys.stderr, flush=True)
        return 1
    finally:
        if ok:  # after a failure, peers may never join a clean shutdown: exiting is what frees them
            _teardown()
        writer.close()


def setup_distributed(cfg: RunConfig, rank: int, world: int):
    """Initialise the process group for the resolved backend; returns (device, backend)."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = cfg.resolved_backend()
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, backend


def record_resolved(run_dir: str, cfg: RunConfig, backend: str, device, sources: dict, world: int) -> None:
    """Rank 0 adds what was resolved at run time to config.json (versions, devices, sources)."""
    import platform

    import torch
    import transformers

    path = os.path.join(run_dir, "config.json")
    with open(path) as f:
        doc = json.load(f)
    cores = os.cpu_count() or 1
    devices = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
               if device.type == "cuda" else [platform.processor() or platform.machine()])
    doc["resolved"] = {
        "backend": backend, "world_size": world, "device_type": device.type, "devices": devices,
        "host": socket.gethostname(), "cpu_cores": cores, "torch_threads_per_rank": torch.get_num_threads(),
        "oversubscribed": device.type == "cpu" and world > cores,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, **_optional_versions()},
        "cuda": torch.version.cuda, "nccl": _nccl_version() if backend == "nccl" else None,
        **sources,
    }
    dump_json(doc, path)


def maybe_inject_fault(rank: int, step: int) -> None:
    """Testing aid: DTLAB_FAULT="RANK:STEP" makes that rank raise at the start of that step."""
    spec = os.environ.get("DTLAB_FAULT")
    if spec:
        r, s = (int(x) for x in spec.split(":"))
        if r == rank and s == step:
            raise RuntimeError(f"injected fault (DTLAB_FAULT={spec}) on rank {rank} at step {step}")


def _optional_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("datasets", "deepspeed"):  # read from metadata: importing deepspeed costs seconds
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _nccl_version():
    import torch
    try:
        return ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        return None


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if torchrun dies: torchrun starts ranks in sessions of their own, so
    stopping torchrun's process group would not reach them, and no rank may outlive a stopped run."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # parent already gone between fork and prctl
            os._exit(1)
    except OSError:
        pass


def _redirect_output(path: str) -> None:
    """Send this rank's stdout/stderr (Python and C++ alike) to its own log so outputs never interleave."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _teardown() -> None:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group must not hide the original error
        pass


if __name__ == "__main__":
    sys.exit(main())
