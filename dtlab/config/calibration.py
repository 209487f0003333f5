"""CalibConfig: what a calibration sweep measures, checked before anything starts (pure, like RunConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.config.job import JobConfig
from dtlab.config.run import MODELS, RunConfig
from dtlab.config.validate import choice, int_at_least

# "ps": a parameter-server round, dist.reduce to rank 0 then dist.broadcast from it (dtlab.rank.strategies.ps, one
# bucket)
OPS = ("all_reduce", "reduce_scatter", "all_gather", "ps")

#: What runs beside the timed collectives: nothing, or a training rank's backward pass (see CalibConfig.load).
LOADS = ("idle", "backward")
# Powers of 2 from 4 KiB to 64 MiB: 15 sizes spanning the latency- and bandwidth-bound regimes, dense
# enough that each protocol regime gets several points (see dtlab.model.fit.fit_piecewise).
DEFAULT_SIZES = tuple(2**k for k in range(12, 27))


@dataclass(kw_only=True)
class CalibConfig(JobConfig):
    """What to measure. Sizes are full message bytes (nccl-tests convention), rounded up to a multiple of
    4 x lcm(nproc, group_sizes) so every rank's share is a whole number of fp32 elements."""

    nproc: int = 2
    """Ranks per node (nproc x nnodes at least 2: a collective needs peers); placed like a run's
    (dtlab.config.placement)."""
    ops: tuple = ("all_reduce",)
    """Collectives to time: all_reduce, reduce_scatter, all_gather, ps (reduce to rank 0 + broadcast)."""
    sizes: tuple = DEFAULT_SIZES
    """Full message sizes in bytes."""
    warmup: int = 3
    """Untimed iterations before each timed block of a size."""
    iters: int = 12
    """Timed samples per size, spread over the rounds."""
    batch: int | None = None
    """Back-to-back calls per timed sample (K); the sample is their mean. None: 20 on CUDA, 1 on gloo-CPU
    (where one call is milliseconds and each sample keeps its own barrier)."""
    rounds: int = 3
    """Passes over all sizes, each in a freshly shuffled order (1 = one block per size, as nccl-tests)."""
    form: str = "ring"
    """Which alpha-beta form the profile fits: 'ring' or 'textbook' (see dtlab.model.costmodel)."""
    fit_min_bytes: int | None = None
    """Fit only sizes >= this (collectives switch protocol between small and large messages)."""
    fit_max_bytes: int | None = None
    """Fit only sizes <= this."""
    group_sizes: tuple | None = None
    """Also time every op on the first k ranks, for each k here (e.g. 2,3,4 with nproc 4; the other ranks wait at
    the barrier), so several p are measured in one launch, interleaved under the same load. None: nproc only."""
    load: str = "idle"
    """'idle' (nothing else runs) or 'backward': in every round each size is also timed issued from inside a
    replayed backward pass of a training rank (the model's own layers and shapes, on the rank's device and thread
    budget), as DDP issues a bucket, so the profile holds a loaded fit beside the idle one: what a bucket costs
    while backward compute shares the cores (on a GPU: the SMs and memory bandwidth); dtlab.rank.contention."""
    load_model: str = "distilbert"
    """The model whose backward pass is the load: 'distilbert' or 'tiny' (load 'backward' only)."""
    load_batch_size: int = 8
    """Samples per rank in the load's backward pass (a training rank's batch_size)."""
    load_seq_len: int = 64
    """Tokens per sample in the load's backward pass (a training rank's seq_len)."""

    def __post_init__(self) -> None:
        if isinstance(self.ops, str):
            self.ops = tuple(o.strip() for o in self.ops.split(",") if o.strip())
        self.ops, self.sizes = tuple(self.ops), tuple(self.sizes)
        if isinstance(self.group_sizes, str):  # the CLI's "2,3,4"
            self.group_sizes = tuple(int(k) if k.strip().isdigit() else k for k in self.group_sizes.split(","))
        if self.group_sizes is not None:
            self.group_sizes = tuple(self.group_sizes)

    def validate(self, cuda_device_count: int | None = None) -> CalibConfig:
        """Refuse bad fields by name, before anything starts."""
        int_at_least("nproc", self.nproc, 1)
        if isinstance(self.nnodes, int) and self.nproc * self.nnodes < 2:
            raise ValueError(
                f"nproc x nnodes must be >= 2 (a collective needs peers), got nproc={self.nproc}, "
                f"nnodes={self.nnodes}; one GPU hosts 2 ranks (dtlab.config.placement), so use nproc=2 "
                "(dtlab.course.labs.calibration_ranks(cfg) gives a run's ranks, at least 2)"
            )
        if not self.ops or any(o not in OPS for o in self.ops):
            raise ValueError(f"ops must be a non-empty subset of {', '.join(OPS)}, got {list(self.ops)!r}")
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 for s in self.sizes):
            raise ValueError(f"sizes must be a non-empty list of integers >= 4 (bytes), got {list(self.sizes)!r}")
        int_at_least("warmup", self.warmup, 0)
        int_at_least("iters", self.iters, 1)
        int_at_least("rounds", self.rounds, 1)
        if self.batch is not None:
            int_at_least("batch", self.batch, 1)
        if self.group_sizes is not None and (
            not self.group_sizes
            or any(
                isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= self.nproc * self.nnodes
                for k in self.group_sizes
            )
        ):
            raise ValueError(
                f"group_sizes must be integers between 2 and nproc x nnodes "
                f"({self.nproc * self.nnodes}), got {list(self.group_sizes)!r}"
            )
        if self.rounds > self.iters:
            raise ValueError(
                f"rounds must be <= iters ({self.iters}) so every round times each size, got {self.rounds}"
            )
        choice("form", self.form, ("ring", "textbook"))
        choice("load", self.load, LOADS)
        choice("load_model", self.load_model, MODELS)
        int_at_least("load_batch_size", self.load_batch_size, 1)
        int_at_least("load_seq_len", self.load_seq_len, 1)
        if self.load_seq_len > 512:
            raise ValueError(f"load_seq_len must be <= 512 (DistilBERT's position embeddings), got {self.load_seq_len}")
        for name in ("fit_min_bytes", "fit_max_bytes"):
            if getattr(self, name) is not None:
                int_at_least(name, getattr(self, name), 0)
        # The machine checks (nccl needs CUDA, one GPU per rank) are the training runs' own.
        RunConfig(nproc=self.nproc, backend=self.backend).validate(cuda_device_count)
        self.validate_job()
        return self

    def resolved_backend(self) -> str:
        """The torch.distributed backend the ranks use, placed like a run's (dtlab.config.placement)."""
        return RunConfig(nproc=self.nproc, backend=self.backend).resolved_backend()

    def ranks_timed(self) -> list[int]:
        """The group sizes p timed: group_sizes (ascending, deduplicated), else every rank: [nproc x nnodes]."""
        return sorted(set(self.group_sizes)) if self.group_sizes else [self.nproc * self.nnodes]

    def rounded_sizes(self) -> list[int]:
        unit = 4 * math.lcm(self.nproc * self.nnodes, *self.ranks_timed())
        return sorted({-(-s // unit) * unit for s in self.sizes})
