"""The one lifecycle of a rank process, and what every rank body shares.

`rank_main(run_dir, body)` is what torchrun runs in each rank, for training (dtlab.rank.worker) and for calibration
(dtlab.rank.calibration) alike: die with torchrun, send output to the rank's own log, dump stacks on SIGUSR1, write
`start`, run the body, write `done` or `error` (and torchrun's error file), and tear the process group down
only after success (after a failure, peers may never join a clean shutdown: exiting is what frees them).
Also here: the process-group setup every strategy uses, the run-time facts rank 0 adds to config.json, and the
fault injection the drills use.

The entry modules (dtlab.rank.worker, dtlab.rank.calibration) import this one before `rank_main` has set the rank up,
so it imports no torch (nor transformers) at its top: the functions that need them import them, once the rank is
tied to torchrun and writes to its own log.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import platform
import signal
import socket
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError, version

from dtlab.config.environment import env_record, set_default
from dtlab.config.ncclib import ENV as NCCL_LIBRARY_ENV
from dtlab.config.ncclib import PRELOADED, loaded_library
from dtlab.config.run import RunConfig
from dtlab.runfiles import RANK_EXIT_DISK_FULL, dump_json, is_disk_error

#: How this rank process was started: 'spawn' (a fresh interpreter, `python -m MODULE`) or 'fork' (forked from
#: torchrun's warm agent; dtlab.launching.agent sets it). Recorded in the rank's start event.
START_METHOD = "spawn"
#: True when that agent was itself forked from a warm server (dtlab.launching.warm) instead of started afresh.
WARM_AGENT = False


def rank_main(run_dir: str, body) -> int:
    """Run `body(run_dir, rank, world, writer)` inside the rank lifecycle; returns the process exit code."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _die_with_parent()
    _redirect_output(os.path.join(run_dir, "logs", f"rank{rank}.log"))
    dump_stacks_on_sigusr1()  # the launcher's watchdog asks for stacks on a stall

    from dtlab.rank.recorder import EventWriter

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)  # > 0: torchrun restarted the group
    writer = EventWriter(os.path.join(run_dir, "events", f"rank{rank}.jsonl"), attempt=attempt)
    slot = os.environ.get("DTLAB_NODE_SLOT")  # which launcher started this rank (multi-node jobs only)
    writer.write(
        "start",
        rank=rank,
        world_size=world,
        pid=os.getpid(),
        host=socket.gethostname(),
        node=int(os.environ.get("GROUP_RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        slot=int(slot) if slot else None,
        master_port=int(os.environ.get("MASTER_PORT", 0)),
        start_method=START_METHOD,
        warm_agent=WARM_AGENT,
        time=time.time(),
    )
    ok = False
    try:
        body(run_dir, rank, world, writer)
        writer.write("done", rank=rank, time=time.time())
        ok = True
        return 0
    except BaseException as e:  # noqa: BLE001 - record even KeyboardInterrupt/SystemExit, then exit non-zero
        tb = traceback.format_exc()
        try:  # on a full disk neither the record nor the log may take it: the exit code then says why
            writer.write("error", rank=rank, time=time.time(), error=f"{type(e).__name__}: {e}", traceback=tb)
            print(tb, file=sys.stderr, flush=True)
        except OSError:
            pass
        record_error_file(e)
        return RANK_EXIT_DISK_FULL if writer.failed is not None or _disk_error_in(e) else 1
    finally:
        if ok:  # after a failure, peers may never join a clean shutdown: exiting is what frees them
            _teardown()
        writer.close()


def exit_rank(code: int) -> None:
    """End the rank process now, with `code`. Every event was written with os.write and the process group torn down
    (after success) or left for the peers' exits to free (after a failure), so the interpreter's own teardown has
    nothing left to do but unload torch and transformers (about half a second per rank on this project's 2-core
    machine), and after a failure it can block on a process group whose peer is gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _disk_error_in(e: BaseException | None) -> bool:
    """True when `e`, or an exception it was raised from, is a full disk (ENOSPC, EDQUOT)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if is_disk_error(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def read_config(run_dir: str) -> dict:
    """The run directory's config.json."""
    with open(os.path.join(run_dir, "config.json")) as f:
        return json.load(f)


def setup_distributed(placed, rank: int, world: int, deterministic: bool = False, nccl_timing: bool = False):
    """Initialise the process group where the run's placement `placed` (dtlab.config.placement.Placement, resolved
    once at the rank's entry) says: backend, device, GPU sharing; returns (device, backend). `deterministic`: the
    run's `deterministic` (make_deterministic). With `nccl_timing`, for runs that read it, NCCL's own per-collective
    timing is switched on (TORCH_NCCL_ENABLE_TIMING, unless the user set it) so dtlab's events can be checked against
    it. Variables are only set where unset (dtlab.config.environment), and the run records which were set."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    store = _attempt_store(world)  # torchrun's store, which no variable set below changes
    for k, v in placed.env.items():  # read by NCCL when the communicator is created, i.e. below
        set_default(os.environ, k, v)
    if deterministic:
        make_deterministic()
    if placed.device == "cuda":
        device = torch.device("cuda", placed.device_index(local_rank))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if placed.backend == "nccl":
        if nccl_timing:  # work._get_duration(): NCCL's start-to-end, read by dtlab.rank.recorder
            set_default(os.environ, "TORCH_NCCL_ENABLE_TIMING", "1")
        dist.init_process_group("nccl", device_id=device, **store)
    else:
        dist.init_process_group("gloo", **store)
    return device, placed.backend


#: What `RunConfig.deterministic` sets in each rank before CUDA or NCCL start (an explicit environment wins).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


def make_deterministic() -> None:
    """Bit-identical reruns on CUDA: deterministic kernels and one NCCL algorithm and protocol, so the order in
    which NCCL sums the ranks' numbers is fixed for a given world size and topology. cuBLAS reads its workspace
    setting when its first handle is made and NCCL its algorithm when the communicator is, both later than this."""
    import torch

    for k, v in DETERMINISTIC_ENV.items():
        set_default(os.environ, k, v)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def _attempt_store(world: int) -> dict:
    """init_process_group's store arguments for a group torchrun restarted ({} on the first attempt).

    torchrun's ranks share the agent's TCP store (TORCHELASTIC_USE_AGENT_STORE), which outlives a restart with
    every key the dead attempt wrote: a restarted rank can read its peer's old address before the peer writes the
    new one and fail ("connectFullMesh failed ... Connection refused"; pytorch#135712). Each attempt's keys go under
    a prefix of their own (one node: every rank has the same TORCHELASTIC_RESTART_COUNT)."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if not attempt or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=default_pg_timeout
    )
    return {
        "store": dist.PrefixStore(f"dtlab/attempt_{attempt}", client),
        "rank": int(os.environ["RANK"]),
        "world_size": world,
    }


def record_resolved(run_dir: str, cfg: RunConfig, placed, device, facts: dict, world: int) -> None:
    """Rank 0 adds what was resolved at run time to config.json (the placement `placed`, versions, devices) and the
    rank's `facts` (where the model and data came from, the strategy's layout and expected traffic, how times were
    taken)."""
    import torch
    import transformers

    path = os.path.join(run_dir, "config.json")
    with open(path) as f:
        doc = json.load(f)
    cores = os.cpu_count() or 1
    devices = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if device.type == "cuda"
        else [platform.processor() or platform.machine()]
    )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on this node (nodes share no cores)
    backend = placed.backend
    doc["resolved"] = {
        "backend": backend,
        "placement": placed.to_dict(),
        "world_size": world,
        "device_type": device.type,
        "devices": devices,
        "host": socket.gethostname(),
        "nnodes": world // local,
        "ranks_per_node": local,
        "cpu_cores": cores,
        "torch_threads_per_rank": torch.get_num_threads(),
        "oversubscribed": device.type == "cpu" and local > cores,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **_optional_versions(),
        },
        "cuda": torch.version.cuda,
        "nccl": _nccl_version() if backend == "nccl" else None,
        "nccl_library": _nccl_library() if backend == "nccl" else None,
        "determinism": determinism_note(cfg, device.type),
        "environment": env_record(os.environ),  # the NCCL settings: the user's, and what dtlab set where unset
        "optimizer": optimizer_note(cfg, device.type),
        **facts,
    }
    dump_json(doc, path)


def optimizer_note(cfg, device_type: str) -> dict:
    """Which AdamW implementation the ranks run: `cfg.optimizer_impl`, and for 'auto' torch's default for the
    device (multi-tensor on CUDA, the per-parameter loop on CPU; dtlab.rank.compat.default_adamw_impl)."""
    impl = getattr(cfg, "optimizer_impl", "auto")
    runs = impl if impl != "auto" else ("foreach" if device_type == "cuda" else "for-loop")
    return {
        "impl": impl,
        "runs": runs,
        "why": "set explicitly (optimizer_impl)" if impl != "auto" else f"torch's default for {device_type} tensors",
    }


def determinism_note(cfg, device_type: str) -> str:
    """What a rerun of this config with the same seed reproduces, in words (recorded in config.json)."""
    if device_type == "cpu":
        return "bit-identical losses on every rank for the same config and seed (CPU, gloo)"
    if getattr(cfg, "deterministic", False):
        return (
            "deterministic kernels and NCCL "
            + "/".join(f"{k}={os.environ.get(k)}" for k in DETERMINISTIC_ENV)
            + ": bit-identical reruns expected on the same GPUs and topology"
        )
    return "not bit-identical on CUDA (nondeterministic kernels and NCCL's algorithm choice); set deterministic=True"


FAULT_MODES = ("raise", "exit", "kill", "segv", "stop")


def maybe_inject_fault(rank: int, step: int) -> None:
    """Testing aid: DTLAB_FAULT="RANK:STEP[:MODE[:ATTEMPT]]" makes that rank fail at the start of that step.

    MODE: raise (default; a RuntimeError the rank records), exit (os._exit(3): gone without a word),
    kill (SIGKILL to itself, as the OOM killer does), segv (SIGSEGV, a crash in native code), stop (SIGSTOP:
    alive but frozen, what the watchdog is for). Deterministic, unlike racing a `kill` from outside.
    ATTEMPT: on which attempt of a restarted group (torchrun's TORCHELASTIC_RESTART_COUNT) it fires: 0 (default,
    the first attempt only, so a group restarted by --max-restarts runs on) or '*' (every attempt: the restarts
    run out).

    Every rank of the group first meets the others at a barrier at that step, so that every step before it is
    recorded on every rank when the fault fires: without it, a peer still finishing the previous step (its
    optimizer, its event line) on a loaded machine is stopped by torchrun before it writes that step, and what a
    run recorded would depend on the scheduler."""
    spec = os.environ.get("DTLAB_FAULT")
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):  # on every rank, at every step
        raise ValueError(f"DTLAB_FAULT={spec!r}: RANK and STEP must be numbers (RANK:STEP[:MODE[:ATTEMPT]])")
    r, s, *rest = parts
    mode = rest[0] if rest else "raise"
    when = rest[1] if len(rest) > 1 else "0"
    if mode not in FAULT_MODES:
        raise ValueError(f"DTLAB_FAULT={spec!r}: mode must be one of {', '.join(FAULT_MODES)}")
    if when != "*" and not when.isdigit():
        raise ValueError(f"DTLAB_FAULT={spec!r}: attempt must be a number (0 = first) or '*' (every attempt)")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if int(s) != step or (when != "*" and int(when) != attempt):
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank has finished and recorded the steps before this one
    if int(r) != rank:
        return
    print(
        f"dtlab: injecting fault {mode!r} (DTLAB_FAULT={spec}) on rank {rank} at step {step} "
        f"(attempt {attempt}), time {time.time():.6f}",
        file=sys.stderr,
        flush=True,
    )  # the fault drills time detection from here
    if mode == "raise":
        raise RuntimeError(f"injected fault (DTLAB_FAULT={spec}) on rank {rank} at step {step}")
    if mode == "exit":
        os._exit(3)
    os.kill(os.getpid(), {"kill": signal.SIGKILL, "segv": signal.SIGSEGV, "stop": signal.SIGSTOP}[mode])


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 makes this rank write every thread's Python stack into its log (fd 2), even while its main
    thread is blocked in C++ (a collective, backward): the launcher's watchdog asks for it on a stall.
    faulthandler's handler runs at signal level, which a Python-level handler could not do there. A crash
    (SIGSEGV, SIGBUS, SIGABRT, ...) also leaves the stack in the log before the rank dies of it."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)


def record_error_file(e: BaseException) -> None:
    """Write the error to torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE), so torchrun's own
    failure report (in logs/torchrun.log) shows this rank's exception, not just its exit code."""
    if "torch" not in sys.modules or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return  # failed before torch was even imported: the rank's log has the traceback
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)
    except Exception:  # noqa: BLE001 - reporting must never hide the original error
        pass
    path = os.environ["TORCHELASTIC_ERROR_FILE"]
    try:  # half written (a full disk): torchrun would choke on it and take seconds longer to stop the others
        with open(path) as f:
            json.load(f)
    except ValueError:
        os.unlink(path)
    except OSError:
        pass


def _optional_versions() -> dict:
    out = {}
    for name in ("datasets", "deepspeed"):  # read from metadata: importing deepspeed costs seconds
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _nccl_version():
    """The NCCL this rank runs: the loaded library's own version (ncclGetVersion, dtlab.config.ncclib), or torch's
    header version where no library is found."""
    lib = loaded_library()
    return lib.text if lib is not None else _nccl_header()


def _nccl_header():
    import torch

    try:
        return ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        return None


def _nccl_library() -> dict:
    """Both NCCL versions of this rank: torch's header and the loaded library (path, ncclGetVersion), with the
    library DTLAB_NCCL_LIBRARY asked for and whether the launcher preloaded it (each rank checked it before its
    first step: dtlab.config.ncclib.check_preloaded)."""
    lib = loaded_library()
    return {
        "header": _nccl_header(),
        "loaded": lib.to_dict() if lib is not None else None,
        "asked_for": os.environ.get(NCCL_LIBRARY_ENV) or None,
        "preloaded": os.environ.get(PRELOADED) or None,
    }


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
