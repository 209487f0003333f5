"""Where ranks run: which backend, which device, how many ranks per GPU. Pure (no CUDA initialisation).

One function, `plan(nproc, backend, device, ngpu, nccl_version)`, decides for every caller (config validation,
the launcher's banner, the rank's process-group setup, `dtlab doctor`), so the notebook, the CLI and the ranks
never disagree. The rules, for `backend="auto"` and `device="auto"`:

- GPUs >= nproc: NCCL, one GPU per rank; the real thing.
- 1 .. nproc-1 GPUs, NCCL >= 2.30, nproc <= 2 x GPUs: NCCL, 2 ranks share a GPU (`NCCL_MULTI_RANK_GPU_ENABLE=1`,
  experimental); real NCCL kernels, but the ranks share one GPU's SMs and memory bandwidth: compute and
  communication slow each other, and no link is crossed.
- 1 .. nproc-1 GPUs otherwise: gloo on CUDA tensors, ranks share GPUs; compute is real GPU compute; gloo stages
  every collective through host memory and TCP loopback, so T_comm is a host figure, not NVLink/PCIe.
- no GPU: gloo on CPU; everything is a CPU figure.

A GPU machine never runs silently on the CPU: with `device="auto"` and at least one GPU, ranks use CUDA.
`device="cpu"` asks for CPU ranks explicitly (gloo only). ZeRO-3 is placed by the same rules: on gloo with
CUDA tensors DeepSpeed runs its CUDA accelerator over gloo (every collective staged through host memory), and
ranks sharing a GPU are given that GPU's index as LOCAL_RANK, which DeepSpeed takes its device from.

How times are taken on each path (`timing_path`, `TIMING`; the rank side is dtlab.rank.marks) is part of the
placement, so the banner, the doctor and docs/gpus.md say it in the same words.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace

from dtlab.config.ncclib import NcclLibrary, ranks_library
from dtlab.config.strategies import strategy_spec

#: First NCCL release that lets two ranks of one communicator share a GPU (with NCCL_MULTI_RANK_GPU_ENABLE=1).
NCCL_SHARED_GPU_MIN = (2, 30, 0)
#: At most this many ranks per GPU under NCCL's multi-rank mode.
NCCL_MAX_RANKS_PER_GPU = 2
#: Strategies known to fail under NCCL's multi-rank mode (ranks sharing a GPU), by strategy name; each value is the
#: reason, citing the run that showed it (machine, torch, NCCL, what failed). For such a strategy, backend 'auto'
#: puts ranks that would share a GPU on gloo with CUDA tensors instead, and the placement's label and note say why;
#: an explicit backend 'nccl' still runs NCCL (to measure it again), with the reason in its note. Empty: no
#: strategy has run in that mode yet.
NCCL_SHARED_GPU_FAILS: dict[str, str] = {}

BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cuda", "cpu")

#: How a rank's communication times are taken on each path (see dtlab.rank.marks): the words every screen uses.
TIMING = {
    "wall": (
        "wall clocks (time.perf_counter): steps, collectives and waits are marked on the training thread, and "
        "a collective that completes in gloo's thread is marked there the moment it completes"
    ),
    "nccl": (
        "CUDA events, read once per step: steps, issues and waits on the compute stream, each collective's end "
        "on a stream made to wait for NCCL's kernel (DDP: the CUDA future's callback stream; ZeRO-3: a stream "
        "dtlab owns; tp, pp, fsdp2, local SGD: the stream that waited for the collective)"
    ),
    "gloo_cuda": (
        "CUDA events, read once per step: steps, issues and waits on the compute stream; a collective that "
        "completes in gloo's worker thread is marked by an event on a stream dtlab owns on the rank's GPU "
        "when gloo finished in host memory (the copy back to the GPU is not included)"
    ),
}

#: The clock a run's figures were taken with (recorded as `resolved.timing_method.method`), in the words the
#: summary and every screen use for it. The asynchronous parameter server's messages block the host, so it keeps
#: the host's clock and synchronises the device at each mark.
TIMING_METHODS = {
    "wall_clock": "wall clock (time.perf_counter) on the training thread",
    "cuda_events": "CUDA events on the compute stream, read once per step",
    "wall_clock_synced": "wall clock (time.perf_counter) after torch.cuda.synchronize() at each mark",
}


def timing_method(path: str) -> str:
    """The method of a timing path: 'cuda_events' on CUDA, 'wall_clock' on CPU."""
    return "wall_clock" if path == "wall" else "cuda_events"


def timing_path(device_type: str, backend: str) -> str:
    """'wall' for CPU ranks, 'nccl' for NCCL on CUDA, 'gloo_cuda' for gloo on CUDA tensors."""
    if device_type != "cuda":
        return "wall"
    if backend in ("nccl", "gloo"):
        return "nccl" if backend == "nccl" else "gloo_cuda"
    raise ValueError(f"backend must be 'nccl' or 'gloo' on CUDA, got {backend!r}")


@dataclass(frozen=True)
class Placement:
    """The resolved placement of a run's ranks.

    backend: 'nccl' or 'gloo' (the torch.distributed backend); device: 'cuda' or 'cpu';
    gpus: GPUs used (0 on CPU); ranks_per_gpu: ranks sharing each GPU (1 = one GPU per rank);
    env: environment variables the ranks need (set before the process group starts);
    label: one line for banners ("NCCL, 2 ranks sharing 1 GPU (experimental)"); note: what it means for the
    numbers (empty for the plain one-GPU-per-rank case)."""

    backend: str
    device: str
    gpus: int
    ranks_per_gpu: int
    label: str
    note: str = ""
    env: dict = field(default_factory=dict)
    clock: str = ""
    """A strategy's own timing method (a key of TIMING_METHODS) where it does not take the path's marks ('' when
    it does): the asynchronous server's workers on CUDA synchronise the device at each mark."""

    def device_index(self, local_rank: int) -> int | None:
        """The CUDA device a local rank uses (ranks fill GPUs round-robin), or None on CPU."""
        return local_rank % self.gpus if self.device == "cuda" else None

    @property
    def timing(self) -> str:
        """How communication times are taken here (TIMING of this placement's path, or the strategy's own clock)."""
        return TIMING_METHODS[self.clock] if self.clock else TIMING[timing_path(self.device, self.backend)]

    def to_dict(self) -> dict:
        """JSON-safe fields, plus `timing` (how times are taken here)."""
        return {
            "backend": self.backend,
            "device": self.device,
            "gpus": self.gpus,
            "ranks_per_gpu": self.ranks_per_gpu,
            "label": self.label,
            "note": self.note,
            "env": dict(self.env),
            "timing": self.timing,
        }


def parse_version(v) -> tuple[int, int, int] | None:
    """'2.27.5' or (2, 27, 5) -> (2, 27, 5); None stays None."""
    if v is None:
        return None
    if isinstance(v, str):
        v = tuple(int(x) for x in v.split(".")[:3])
    v = tuple(v) + (0, 0, 0)
    return (int(v[0]), int(v[1]), int(v[2]))


def nccl_allows_shared_gpu(nccl_version) -> bool:
    """True when this NCCL lets two ranks share one GPU (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1)."""
    v = parse_version(nccl_version)
    return v is not None and v >= NCCL_SHARED_GPU_MIN


def plan(
    nproc: int,
    backend: str = "auto",
    device: str = "auto",
    ngpu: int = 0,
    nccl_version=None,
    strategy: str | None = None,
) -> Placement:
    """Decide backend and device for `nproc` ranks on a machine with `ngpu` GPUs (see the module docstring).

    `strategy` only adds what the placement means for it to the note (ZeRO-3 over gloo, ZeRO-3 on one rank).
    Raises ValueError naming the field when the request cannot run here."""
    spec = strategy_spec(strategy) if strategy is not None else None  # read once: every rule below uses it
    p = _known_failure(_plan(nproc, backend, device, ngpu, nccl_version), strategy, nproc, backend)
    refused = spec.gloo_cuda_refused if spec is not None else ""
    if refused and p.backend == "gloo" and p.device == "cuda":
        if device == "cuda":
            raise ValueError(
                f"device 'cuda' cannot host strategy {strategy!r} with {nproc} ranks on {ngpu} GPU(s) "
                f"here: the ranks would use gloo on CUDA tensors, and {refused}. Use device 'cpu' "
                f"or 'auto' (CPU), or NCCL: one GPU per rank, or NCCL >= "
                f"{'.'.join(map(str, NCCL_SHARED_GPU_MIN))} for ranks sharing a GPU"
            )
        cpu = _cpu(nproc, explicit=False)
        p = replace(
            cpu,
            label=f"gloo on CPU, {_ranks(nproc)} ({strategy!r} cannot use gloo on CUDA tensors)",
            note=f"{cpu.note}; the GPU is not used: NCCL cannot place these ranks here, and {refused}",
        )
    if spec is not None and spec.asynchronous and p.device == "cuda":
        p = replace(p, clock="wall_clock_synced")  # dtlab.rank.strategies.async_ps: messages block the host
    extra = strategy_note(spec, p, nproc)
    if extra:
        p = replace(p, note=f"{p.note}; {extra}" if p.note else extra)
    return p


def _known_failure(p: Placement, strategy: str | None, nproc: int, backend: str) -> Placement:
    """`p`, or gloo on CUDA tensors where NCCL's multi-rank mode is known to fail for `strategy`
    (NCCL_SHARED_GPU_FAILS) and the backend was left to dtlab; an explicit 'nccl' keeps NCCL with the reason noted."""
    reason = NCCL_SHARED_GPU_FAILS.get(strategy) if strategy is not None else None
    if not reason or p.backend != "nccl" or p.ranks_per_gpu < 2:
        return p
    why = f"NCCL's multi-rank mode is known to fail for {strategy!r}: {reason}"
    if backend == "nccl":
        return replace(p, note=f"{p.note}; {why} (backend 'nccl' asked for: run anyway)")
    g = _gloo_cuda(nproc, p.gpus, f"; {why}")
    return replace(g, note=f"{g.note}; {why}")


def strategy_note(spec, p: Placement, nproc: int) -> str:
    """What a placement means for the numbers of the strategy `spec` (a StrategySpec, or None) beyond what it means
    for DDP ('' when nothing)."""
    if spec is None:
        return ""
    if spec.shards and nproc == 1:
        return (
            f"{spec.title} on one rank partitions nothing (p = 1): each rank holds everything and no byte "
            "travels between ranks; use 2 or more ranks to see sharding"
        )
    if p.backend == "gloo" and p.device == "cuda":
        return spec.gloo_cuda_note
    return ""


def _plan(nproc: int, backend: str, device: str, ngpu: int, nccl_version) -> Placement:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(map(repr, DEVICES))}, got {device!r}")
    shared_ok = nccl_allows_shared_gpu(nccl_version)
    nccl_v = ".".join(map(str, parse_version(nccl_version))) if nccl_version is not None else "unknown"

    if device == "cpu":
        if backend == "nccl":
            raise ValueError("backend 'nccl' needs CUDA devices; device 'cpu' allows only 'gloo' or 'auto'")
        return _cpu(nproc, explicit=True)
    if ngpu == 0:
        if backend == "nccl" or device == "cuda":
            field_name = "backend 'nccl'" if backend == "nccl" else "device 'cuda'"
            raise ValueError(
                f"{field_name} needs CUDA GPUs and this machine has none; use backend 'gloo' "
                "or 'auto' with device 'auto' or 'cpu'"
            )
        return _cpu(nproc, explicit=False)

    # From here on there is at least one GPU and the ranks use CUDA.
    if backend in ("auto", "nccl") and nproc <= ngpu:
        return Placement("nccl", "cuda", nproc, 1, f"NCCL, {_ranks(nproc)}, one GPU each")
    if backend in ("auto", "nccl") and shared_ok and nproc <= NCCL_MAX_RANKS_PER_GPU * ngpu:
        per = -(-nproc // ngpu)
        return Placement(
            "nccl",
            "cuda",
            ngpu,
            per,
            f"NCCL, {nproc} ranks sharing {ngpu} GPU(s), {per} per GPU (NCCL {nccl_v}, experimental multi-rank mode)",
            note=(
                "ranks share a GPU's SMs and memory bandwidth, so compute and communication slow each other, "
                "and no NVLink/PCIe link is crossed between ranks on the same GPU: T_comm is not a network figure"
            ),
            env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"},
        )
    if backend == "nccl":
        need = f"NCCL >= {'.'.join(map(str, NCCL_SHARED_GPU_MIN))}"
        raise ValueError(
            f"nproc must be <= {ngpu} (GPUs on this machine) under backend 'nccl' with NCCL {nccl_v}; "
            f"{need} lets up to {NCCL_MAX_RANKS_PER_GPU} ranks share a GPU. Use nproc={ngpu}, "
            f"or backend 'gloo' (CUDA tensors, collectives through host memory), got nproc={nproc}"
        )
    # gloo on CUDA tensors: asked for, or the fallback when NCCL cannot place the ranks.
    why = "" if backend == "gloo" else (f"; NCCL {nccl_v} cannot put {nproc} ranks on {ngpu} GPU(s)")
    return _gloo_cuda(nproc, ngpu, why)


def _gloo_cuda(nproc: int, ngpu: int, why: str) -> Placement:
    """gloo on CUDA tensors, `nproc` ranks on `ngpu` GPUs; `why` ends the label."""
    per = -(-nproc // ngpu)
    return Placement(
        "gloo",
        "cuda",
        min(ngpu, nproc),
        per,
        f"gloo on CUDA tensors, {_ranks(nproc)} on {min(ngpu, nproc)} GPU(s), {per} per GPU{why}",
        note=(
            "compute is real GPU compute, but gloo stages every collective through host memory and TCP "
            "loopback: T_comm is a host-memory figure, far slower than NCCL over NVLink or PCIe"
            + ("; ranks sharing a GPU also slow each other's compute" if per > 1 else "")
        ),
    )


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _cpu(nproc: int, explicit: bool) -> Placement:
    why = "device 'cpu' asked for" if explicit else "no CUDA GPU on this machine"
    return Placement(
        "gloo",
        "cpu",
        0,
        0,
        f"gloo on CPU, {_ranks(nproc)} ({why})",
        note="every time is a CPU figure: ranks share the cores with gloo's threads, and loopback TCP "
        "has its own alpha and beta",
    )


def device_count() -> int:
    """CUDA GPUs visible to this process.

    Asked through NVML where possible so the notebook kernel creates no CUDA context (ranks are started with
    exec, never fork, so even a context here could not leak into them).
    """
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - torch missing or broken driver: no GPUs usable
        return 0


def torch_nccl_header() -> str | None:
    """The NCCL header version torch was compiled with ('2.28.9'; None for a torch without NCCL). Not the library the
    ranks load: torch 2.11 reports 2.28.9 whichever libnccl is loaded (dtlab.config.ncclib reads that one)."""
    try:
        import torch

        return ".".join(str(x) for x in parse_version(torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a torch built without NCCL
        return None


def machine_nccl() -> tuple[int, NcclLibrary | None, str | None]:
    """(CUDA GPUs visible, the NCCL library the ranks will load or None, torch's NCCL header version or None), asked
    without creating a CUDA context; the NCCL parts only where there is a GPU. The library is
    dtlab.config.ncclib.ranks_library's (DTLAB_NCCL_LIBRARY, LD_PRELOAD, else the libnccl torch mapped on import):
    a DTLAB_NCCL_LIBRARY that names no NCCL library raises ValueError naming it."""
    n = device_count()  # imports torch: from here on its libnccl is mapped in this process
    if not n:
        return 0, None, None
    return n, ranks_library(), torch_nccl_header()


def machine_gpus() -> tuple[int, str | None]:
    """(CUDA GPUs visible, NCCL version string or None), asked without creating a CUDA context. The version is the
    library's own (ncclGetVersion of `machine_nccl`'s library); only where no library can be found is it torch's
    header, with a warning saying so."""
    n, lib, header = machine_nccl()
    if lib is not None:
        return n, lib.text
    if n and header is not None:
        warnings.warn(
            f"dtlab: no NCCL library found in this process (DTLAB_NCCL_LIBRARY unset, none in LD_PRELOAD, none "
            f"mapped by torch): placing ranks by torch's NCCL header version {header}, which may not be the "
            "library the ranks load",
            stacklevel=2,
        )
    return n, header
