"""RunConfig: the one typed, validated description of a training run.

Validation is pure (no torch.distributed, no CUDA initialisation in the caller's process) so that every bad
field is refused before any process starts. `validate()` checks the fields against each other and against the
machine (GPU count) and raises `ValueError` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("ddp", "zero3")
BACKENDS = ("auto", "nccl", "gloo")
MODELS = ("distilbert", "tiny")
MODEL_SOURCES = ("auto", "hub", "random")
DATA_SOURCES = ("auto", "glue", "offline")


@dataclass(kw_only=True)
class ZeroConfig:
    """DeepSpeed ZeRO-3 knobs that shape communication (DeepSpeed's own defaults)."""

    reduce_bucket_size: int = 500_000_000
    """Elements per reduce-scatter bucket of gradients."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Elements of parameters prefetched (all-gathered) ahead of use; 0 turns prefetching off."""
    stage3_param_persistence_threshold: int = 100_000
    """Parameters with at most this many elements stay whole on every rank: never gathered in forward or
    backward, re-gathered once per step after the optimizer update."""
    stage3_max_reuse_distance: int = 1_000_000_000
    """Elements. A parameter gathered in forward is kept for backward if it is used again within this
    distance; the default keeps every parameter of a model under 5e8 parameters, so backward gathers
    nothing. 0 (with prefetch 0) gives the textbook pattern: gather in forward and again in backward."""
    overlap_comm: bool = True
    """Overlap gradient reduce-scatter with backward compute."""

    def validate(self) -> None:
        for name, low in (("reduce_bucket_size", 1), ("stage3_prefetch_bucket_size", 0),
                          ("stage3_param_persistence_threshold", 0), ("stage3_max_reuse_distance", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"zero.{name} must be an integer >= {low} (elements), got {v!r}")
        if not isinstance(self.overlap_comm, bool):
            raise ValueError(f"zero.overlap_comm must be true or false, got {self.overlap_comm!r}")


@dataclass(kw_only=True)
class RunConfig:
    """Everything that defines one run. Times are seconds, sizes are as named (MiB, tokens, samples)."""

    strategy: str = "ddp"
    """'ddp' (PyTorch DistributedDataParallel) or 'zero3' (DeepSpeed ZeRO stage 3)."""
    nproc: int = 2
    """Number of ranks (processes) on this machine; one GPU each under NCCL."""
    backend: str = "auto"
    """'auto' (nccl when CUDA has at least nproc GPUs, else gloo), 'nccl' or 'gloo'."""
    bucket_mb: float = 25.0
    """DDP gradient bucket cap in MiB (DDP's bucket_cap_mb; 1 MiB = 1,048,576 bytes)."""
    steps: int = 8
    """Timed optimizer steps (the first `warmup` of them are excluded from summaries)."""
    warmup: int = 2
    """Leading steps excluded from medians: step 0 allocates and runs DDP's single first-iteration bucket,
    step 1 rebuilds the buckets in gradient-ready order."""
    baseline_steps: int = 0
    """Extra steps run after the timed ones with DDP's no-op comm hook: they measure T_comp."""
    batch_size: int = 8
    """Samples per rank per step (the global batch is batch_size x nproc)."""
    seq_len: int = 128
    """Tokens per sample; every input is padded/truncated to exactly this length."""
    model: str = "distilbert"
    """'distilbert' (distilbert-base-uncased architecture) or 'tiny' (2 layers, dim 32, for tests)."""
    model_source: str = "auto"
    """'auto' (local path, then HF cache, then hub if reachable, else random init), 'hub', or 'random'."""
    model_path: str | None = None
    """Local folder in Hugging Face format to load weights from (must exist)."""
    data: str = "auto"
    """'auto' (GLUE SST-2 via datasets if reachable, else the offline set), 'glue', 'offline',
    or a path to a local .csv/.tsv/.json/.jsonl/.parquet file with columns `sentence` and `label`."""
    record: bool = True
    """Record every bucket with the comm hook; False runs plain DDP (its built-in all-reduce, no hook), which
    the overhead benchmark compares against."""
    lr: float = 2e-5
    """AdamW learning rate."""
    seed: int = 0
    """Seed for weights (random init), data order and dropout."""
    out: str | None = None
    """Run directory; default runs/<strategy>-<model>-p<nproc>-b<bucket_mb>-<timestamp>."""
    timeout_s: float = 1800.0
    """Wall-clock limit for the whole run in seconds; past it every rank is stopped."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO-3 knobs (used when strategy == 'zero3')."""

    def __post_init__(self) -> None:
        if isinstance(self.zero, dict):
            self.zero = ZeroConfig(**self.zero)

    # ---- validation -------------------------------------------------------------------------------------
    def validate(self, cuda_device_count: int | None = None) -> "RunConfig":
        """Check every field; raise ValueError naming the field and what is allowed. Returns self.

        `cuda_device_count` defaults to what this machine reports (asked without initialising CUDA).
        """
        _choice("strategy", self.strategy, STRATEGIES)
        _int_at_least("nproc", self.nproc, 1)
        _choice("backend", self.backend, BACKENDS)
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a number > 0 (MiB), got {self.bucket_mb!r}")
        _int_at_least("steps", self.steps, 1)
        _int_at_least("warmup", self.warmup, 0)
        if self.warmup >= self.steps:
            raise ValueError(f"warmup must be smaller than steps ({self.steps}) so some steps are measured, "
                             f"got {self.warmup}")
        _int_at_least("baseline_steps", self.baseline_steps, 0)
        if self.strategy != "ddp" and self.baseline_steps:
            raise ValueError("baseline_steps (the no-op comm hook baseline) is only available for strategy 'ddp'")
        _int_at_least("batch_size", self.batch_size, 1)
        _int_at_least("seq_len", self.seq_len, 1)
        if self.seq_len > 512:
            raise ValueError(f"seq_len must be <= 512 (DistilBERT's position embeddings), got {self.seq_len}")
        _choice("model", self.model, MODELS)
        _choice("model_source", self.model_source, MODEL_SOURCES)
        if self.model_path is not None and not os.path.isdir(self.model_path):
            raise ValueError(f"model_path must be an existing folder with a Hugging Face model, "
                             f"got {self.model_path!r} (not found)")
        if self.data not in DATA_SOURCES:
            if not os.path.isfile(self.data):
                raise ValueError(f"data must be one of {', '.join(DATA_SOURCES)} or an existing local file "
                                 f"(.csv, .tsv, .json, .jsonl, .parquet), got {self.data!r} (not found)")
            if not self.data.endswith((".csv", ".tsv", ".json", ".jsonl", ".parquet")):
                raise ValueError(f"data file must end in .csv, .tsv, .json, .jsonl or .parquet, got {self.data!r}")
        if not isinstance(self.record, bool):
            raise ValueError(f"record must be true or false, got {self.record!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"lr must be a number > 0, got {self.lr!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")
        if not isinstance(self.zero, ZeroConfig):
            raise ValueError(f"zero must be a ZeroConfig or a dict of its fields, got {type(self.zero).__name__}")
        self.zero.validate()
        # Machine checks last: they need the device count.
        ngpu = cuda_device_count if cuda_device_count is not None else device_count()
        if self.backend == "nccl":
            if ngpu == 0:
                raise ValueError("backend 'nccl' needs CUDA GPUs and this machine has none; use 'gloo' or 'auto'")
            if self.nproc > ngpu:
                raise ValueError(f"nproc must be <= {ngpu} (GPUs on this machine) under backend 'nccl', "
                                 f"got {self.nproc}")
        return self

    def resolved_backend(self, cuda_device_count: int | None = None) -> str:
        """The backend 'auto' resolves to: nccl when there are at least nproc GPUs, else gloo."""
        if self.backend != "auto":
            return self.backend
        ngpu = cuda_device_count if cuda_device_count is not None else device_count()
        return "nccl" if ngpu >= self.nproc else "gloo"

    # ---- serialisation ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        """Build from `to_dict()` output; unknown keys are refused by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown RunConfig field(s): {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
        return cls(**d)

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with some fields changed (the run directory is reset unless given)."""
        changes.setdefault("out", None)
        return dataclasses.replace(self, **changes)


def tiny(**overrides: Any) -> RunConfig:
    """Preset for tests and quick labs: the tiny model, 2 ranks, few short steps."""
    base = dict(model="tiny", nproc=2, steps=4, warmup=1, batch_size=4, seq_len=32, bucket_mb=1.0,
                model_source="random", data="offline", timeout_s=300.0)
    base.update(overrides)
    return RunConfig(**base)


def device_count() -> int:
    """CUDA GPUs visible to this process.

    Asked through NVML where possible so the notebook kernel creates no CUDA context (ranks are started with
    exec, never fork, so even a context here could not leak into them).
    """
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken driver: no GPUs usable
        return 0


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def dump_json(obj: Any, path: str) -> None:
    """Write JSON atomically (write then rename), so a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)
