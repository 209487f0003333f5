"""RunConfig: the one typed, validated description of a training run.

Validation is pure (no torch.distributed, no CUDA initialisation in the caller's process) so that every bad
field is refused before any process starts. `validate()` checks the fields against each other and against the
machine (GPU count) and raises `ValueError` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

from dtlab.config.baseline import auto_baseline_steps
from dtlab.config.compression import CompressionConfig
from dtlab.config.convergence import EvaluationConfig, LrScheduleConfig, SyncConfig
from dtlab.config.datafile import check_data_file
from dtlab.config.ddp import DDPConfig
from dtlab.config.job import JobConfig
from dtlab.config.measurement import MeasurementConfig
from dtlab.config.options import FLAT, nest
from dtlab.config.parallel import ChecksConfig, ParallelConfig
from dtlab.config.placement import BACKENDS, DEVICES, device_count, machine_gpus, plan
from dtlab.config.restarts import RestartsConfig
from dtlab.config.rules import check_run
from dtlab.config.stragglers import StragglersConfig
from dtlab.config.strategies import STRATEGIES, strategy_spec
from dtlab.config.validate import choice, finite, int_at_least, refuse_unknown

MODELS = ("distilbert", "tiny")
MODEL_SOURCES = ("auto", "hub", "random")
DATA_SOURCES = ("auto", "glue", "offline")
OPTIMIZER_IMPLS = ("auto", "foreach", "fused", "for-loop")  # torch.optim.AdamW's implementations
#: The form a run records (config.json's "config" holds it as `config_version`): 2 = the option groups, 3 = memory
#: events name the optimizer state's bytes opt_bytes, as steps name its time t_opt, 4 = the options only DDP's loop,
#: the straggler rule and the reference check read in their groups (ddp, stragglers, checks), 5 = what every strategy's
#: loop measures beside training (baseline_steps, profile) in `measurement`, out of `ddp`. Records of an earlier form
#: are brought to this one by dtlab.results.upgrade.
CONFIG_VERSION = 5


@dataclass(kw_only=True)
class ZeroConfig:
    """DeepSpeed ZeRO-3 knobs that shape communication.

    None means "auto": sized from the model's hidden size h when the run starts, with Hugging Face's rule for
    DeepSpeed's "auto" values (reduce_bucket_size = h^2, stage3_prefetch_bucket_size = int(0.9 h^2),
    stage3_param_persistence_threshold = 10 h). DeepSpeed's own defaults (5e8, 5e7, 1e5 elements) are sized for
    models of billions of parameters: its 5e8-element reduce bucket alone is 2 GB of fp32 on every GPU, more
    than DistilBERT's parameters, gradients and optimizer state per rank together. The resolved values and the
    rule are recorded in `run.resolved["zero_effective"]` / `["zero_auto"]`.
    """

    reduce_bucket_size: int | None = None
    """Elements per reduce-scatter bucket of gradients (auto: h^2; DistilBERT 589,824 = 2.4 MB fp32)."""
    stage3_prefetch_bucket_size: int | None = None
    """Elements of parameters prefetched (all-gathered) ahead of use; 0 turns prefetching off
    (auto: int(0.9 h^2); DistilBERT 530,841)."""
    stage3_param_persistence_threshold: int | None = None
    """Parameters with at most this many elements stay whole on every rank: never gathered in forward or
    backward, re-gathered once per step after the optimizer update (auto: 10 h; DistilBERT 7,680)."""
    stage3_max_reuse_distance: int = 1_000_000_000
    """Elements. A parameter gathered in forward is kept for backward if it is used again within this
    distance; the default keeps every parameter of a model under 5e8 parameters, so backward gathers
    nothing. 0 (with prefetch 0) gives the textbook pattern: gather in forward and again in backward."""
    overlap_comm: bool = True
    """Overlap gradient reduce-scatter with backward compute."""

    AUTO_FIELDS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")

    def resolve(self, hidden: int) -> dict:
        """The three sized knobs for a model of hidden size `hidden` (explicit values win over auto)."""
        auto = {
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
        }
        return {k: (auto[k] if getattr(self, k) is None else getattr(self, k)) for k in self.AUTO_FIELDS}

    def validate(self) -> None:
        for name, low in (
            ("reduce_bucket_size", 1),
            ("stage3_prefetch_bucket_size", 0),
            ("stage3_param_persistence_threshold", 0),
            ("stage3_max_reuse_distance", 0),
        ):
            v = getattr(self, name)
            if v is None and name in self.AUTO_FIELDS:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                auto = " or None (auto: sized from the model)" if name in self.AUTO_FIELDS else ""
                raise ValueError(f"zero.{name} must be an integer >= {low} (elements){auto}, got {v!r}")
        if not isinstance(self.overlap_comm, bool):
            raise ValueError(f"zero.overlap_comm must be true or false, got {self.overlap_comm!r}")


@dataclass(kw_only=True)
class RunConfig(JobConfig):
    """Everything that defines one run. Times are seconds, sizes are as named (MiB, tokens, samples). The launch
    fields (backend, out, timeout_s, nodes and rendezvous) are JobConfig's, shared with CalibConfig."""

    strategy: str = "ddp"
    """'ddp' (PyTorch DistributedDataParallel), 'zero3' (DeepSpeed ZeRO stage 3), 'ps' (DDP's buckets reduced
    to rank 0 and broadcast back: a parameter server colocated with rank 0), 'async' (rank 0 a server, the
    others workers pushing gradients without waiting for each other), 'fsdp2' (PyTorch's fully_shard), 'tp'
    (Megatron-style tensor parallelism) or 'pp' (a pipeline of stages); see dtlab.config.strategies."""
    nproc: int | None = None
    """Number of ranks (processes) on each node. None: one per GPU and at least 2 (2 gloo ranks on a machine
    without a GPU; on one GPU, 2 ranks share it: see dtlab.config.placement)."""
    device: str = "auto"
    """'auto' (CUDA whenever the machine has a GPU: a GPU machine never runs silently on the CPU), 'cuda' or
    'cpu' (gloo ranks on the CPU even when GPUs are present)."""
    steps: int = 8
    """Timed optimizer steps (the first `warmup` of them are excluded from summaries)."""
    warmup: int = 2
    """Leading steps excluded from medians: step 0 allocates and runs DDP's single first-iteration bucket,
    step 1 rebuilds the buckets in gradient-ready order."""
    batch_size: int = 8
    """Samples per rank per step (the global batch is batch_size x nproc); for 'tp' and 'pp', whose ranks share
    one batch, per data-parallel replica (the global batch is batch_size x dp_degree)."""
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
    or a path to a local .csv/.tsv/.json/.jsonl/.parquet file with columns `sentence` and `label`. A file is
    read and checked by `validate()` before anything starts (non-empty sentences, labels 0/1, at least
    batch_size x nproc rows); a run needing more rows than it has cycles through it (dtlab.rank.data)."""
    record: bool = True
    """Record every bucket with the comm hook; False runs plain DDP (its built-in all-reduce, no hook), which
    the overhead benchmark compares against."""
    lr: float | None = None
    """AdamW's base learning rate (before `lr_scaling` and the warmup). None (auto): set by each rank once the model
    is built, from the weights it got: 2e-5 (the fine-tuning rate) for pretrained weights, a rate that trains the
    model from random weights otherwise (tiny 1e-3, measured; DistilBERT 1e-4, BERT pre-training's rate, checked on
    one GPU). The run records the rate and why in `run.resolved["lr"]` (`run.lr`); see
    dtlab.config.convergence.resolve_lr."""
    seed: int = 0
    """Seed for weights (random init), data order and dropout. Same config + same seed = same losses: on CPU
    with gloo bit for bit on every rank (tested); on CUDA only with `deterministic`."""
    deterministic: bool = False
    """Ask for bit-identical reruns on CUDA: deterministic kernels (torch.use_deterministic_algorithms,
    CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN benchmark off) and one fixed NCCL reduction order (NCCL_ALGO=Ring,
    NCCL_PROTO=Simple) for a given world size and topology. It can cost speed, so it is off by default; CPU runs
    with gloo are bit-identical without it."""
    optimizer_impl: str = "auto"
    """Which of torch's AdamW implementations every rank runs: 'auto' (torch's default for the device:
    multi-tensor on CUDA, a per-parameter loop on CPU), 'foreach' (multi-tensor), 'fused' (one kernel) or
    'for-loop'. Forcing 'foreach' on a CPU runs the code path a GPU takes by default; the one used is recorded
    in `run.resolved["optimizer"]`."""
    stall_s: float | None = None
    """Watchdog: seconds a rank may go without writing a new event once it has started stepping; past it the
    ranks' Python stacks are dumped into their logs, the run is stopped and RunFailed names the silent rank.
    None derives it from the run: max(60 s, 10 x the median step time seen so far). Before a rank's first
    step (imports, rendezvous, model download and build, DeepSpeed setup) it gets max(stall_s, 600 s), and
    max(stall_s, 120 s) with the tiny model, which downloads nothing."""
    dropout: float | None = None
    """Dropout probability of every dropout layer; None keeps the model's own (DistilBERT: 0.1, and 0.2 before
    the classifier). 0 makes a run comparable, step by step, with a single process (`checks.reference`)."""
    # ---- option groups: what one strategy or lever reads (dtlab.config.options: the flat names and who reads them)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """A model-parallel layout ('tp', 'pp'): dp_degree, microbatches, schedule (dtlab.config.parallel)."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """DDP's gradient compression hooks: hook, powersgd_rank, powersgd_start_iter (dtlab.config.compression)."""
    restarts: RestartsConfig = field(default_factory=RestartsConfig)
    """Checkpoints and restarts: checkpoint_every, max_restarts (dtlab.config.restarts)."""
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    """Held-out evaluation between steps: every, samples (dtlab.config.convergence)."""
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    """The learning-rate rule: scaling, base_batch, warmup_steps (dtlab.config.convergence)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Synchronising less than every step: local_sgd, max_staleness, staleness_policy (dtlab.config.convergence)."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    """DDP's loop: bucket_mb, accumulate (dtlab.config.ddp)."""
    measurement: MeasurementConfig = field(default_factory=MeasurementConfig)
    """What the loop measures beside training: baseline_steps, profile (dtlab.config.measurement)."""
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
    """Slowed ranks: slow (flat name straggler; dtlab.config.stragglers)."""
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    """What a run checks itself against: reference (dtlab.config.parallel)."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO-3 knobs (used when strategy == 'zero3')."""

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():  # a dict of a group's fields becomes the group; a given group is copied
            value = getattr(self, name)
            if isinstance(value, dict):
                refuse_unknown(name, value, cls)
                setattr(self, name, cls(**value))
            elif isinstance(value, cls):
                setattr(self, name, dataclasses.replace(value))

    # ---- validation -------------------------------------------------------------------------------------
    def validate(self, cuda_device_count: int | None = None, nccl_version=None) -> RunConfig:
        """Check every field; raise ValueError naming the field and what is allowed. Returns self.

        `cuda_device_count` and `nccl_version` default to this machine's (asked without initialising CUDA). The
        "auto" fields (nproc, measurement.baseline_steps: None) are resolved here; `lr` None stays None, as it
        depends on the weights the rank loads (dtlab.config.convergence.resolve_lr)."""
        choice("strategy", self.strategy, tuple(STRATEGIES))
        spec = strategy_spec(self.strategy)  # looked up once: every rule below reads this spec
        self._resolve_auto(cuda_device_count, spec)
        int_at_least("nproc", self.nproc, 1)
        choice("backend", self.backend, BACKENDS)
        int_at_least("steps", self.steps, 1)
        int_at_least("warmup", self.warmup, 0)
        if self.warmup >= self.steps:
            raise ValueError(
                f"warmup must be smaller than steps ({self.steps}) so some steps are measured, got {self.warmup}"
            )
        int_at_least("batch_size", self.batch_size, 1)
        int_at_least("seq_len", self.seq_len, 1)
        if self.seq_len > 512:
            raise ValueError(f"seq_len must be <= 512 (DistilBERT's position embeddings), got {self.seq_len}")
        self._validate_sources()
        for name in ("record", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.lr is not None:
            finite("lr", self.lr, "or None (auto: chosen by the run from the weights it loads)", low=0.0, high=10.0)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32) (numpy's range), got {self.seed!r}")
        if self.model_path is not None and not isinstance(self.model_path, str):
            raise ValueError(f"model_path must be a path (string) or None, got {self.model_path!r}")
        if self.stall_s is not None:
            finite("stall_s", self.stall_s, "(seconds) or None (derived from the step time)", low=0.0)
        for name, cls in GROUPS.items():  # each option group checks its own fields
            group = getattr(self, name)
            if not isinstance(group, cls):
                raise ValueError(f"{name} must be a {cls.__name__} or a dict of its fields, got {type(group).__name__}")
            group.validate()
        # Machine checks last: they need the device count.
        choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        choice("device", self.device, DEVICES)
        placed = self.placement(cuda_device_count, nccl_version)  # ValueError when the GPUs cannot host the ranks
        check_run(self, spec, placed)  # the rules between fields, groups, the strategy and the placement
        self.validate_job()  # the launch fields, nodes and rendezvous last (they fill in rdzv_id)
        return self

    def _validate_sources(self) -> None:
        """Where the model and the data come from: names, an existing model folder, a local data file read and
        checked here, in the caller's process, so a bad file never reaches a rank."""
        choice("model", self.model, MODELS)
        choice("model_source", self.model_source, MODEL_SOURCES)
        if self.model_path is not None and not os.path.isdir(self.model_path):
            raise ValueError(
                f"model_path must be an existing folder with a Hugging Face model, got {self.model_path!r} (not found)"
            )
        if not isinstance(self.data, str):
            raise ValueError(f"data must be a string (a source name or a file path), got {self.data!r}")
        if self.data not in DATA_SOURCES:
            if not os.path.isfile(self.data):
                raise ValueError(
                    f"data must be one of {', '.join(DATA_SOURCES)} or an existing local file "
                    f"(.csv, .tsv, .json, .jsonl, .parquet), got {self.data!r} (not found)"
                )
            if not self.data.lower().endswith((".csv", ".tsv", ".json", ".jsonl", ".parquet")):
                raise ValueError(f"data file must end in .csv, .tsv, .json, .jsonl or .parquet, got {self.data!r}")

            check_data_file(self.data, min_rows=self.batch_size * self.nproc)

    def _resolve_auto(self, cuda_device_count: int | None = None, spec=None) -> None:
        if self.nproc is None:
            self.nproc = max(2, cuda_device_count if cuda_device_count is not None else device_count())
        if self.measurement.baseline_steps is None:
            self.measurement.baseline_steps = (
                auto_baseline_steps(self.steps, self.warmup)
                if (spec or strategy_spec(self.strategy)).compute_baseline
                else 0
            )

    def placement(self, cuda_device_count: int | None = None, nccl_version=None):
        """Where the ranks run (backend, device, ranks per GPU, banner text): `dtlab.config.placement.plan` for this
        config on this machine (or on `cuda_device_count` GPUs with `nccl_version`, for tests)."""

        self._resolve_auto(cuda_device_count)
        if cuda_device_count is None:
            cuda_device_count, found = machine_gpus()
            nccl_version = nccl_version if nccl_version is not None else found
        return plan(self.nproc, self.backend, self.device, cuda_device_count, nccl_version, strategy=self.strategy)

    def resolved_backend(self, cuda_device_count: int | None = None, nccl_version=None) -> str:
        """The torch.distributed backend the ranks use ('nccl' or 'gloo'): see `placement()`."""
        return self.placement(cuda_device_count, nccl_version).backend

    # ---- serialisation ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field, the groups nested, with `config_version` (CONFIG_VERSION)."""
        return {"config_version": CONFIG_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        """Build from `to_dict()` output (or any dict of fields and flat names, dtlab.config.options.FLAT); unknown
        keys, top-level or in a group, are refused by name, and so is a record of another `config_version` (a run
        recorded by an earlier dtlab: read it with dtlab.results.upgrade.upgrade first)."""
        if not isinstance(d, dict):
            raise ValueError(f"a RunConfig is built from a dict of its fields, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("config_version", CONFIG_VERSION)
        if version != CONFIG_VERSION:
            raise ValueError(
                f"config_version {version!r} is not this dtlab's ({CONFIG_VERSION}): a config recorded by another "
                "version; dtlab.results.upgrade.upgrade(config) brings an earlier one to this form"
            )
        refuse_unknown("RunConfig", d, cls, also=tuple(FLAT))
        return cls(**d)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some fields changed, flat option names included (the run directory is reset unless given)."""
        changes.setdefault("out", None)
        return dataclasses.replace(self, **changes)


#: RunConfig's option groups: field name -> dataclass (dtlab.config.options has their flat names)
GROUPS = {
    "ddp": DDPConfig,
    "measurement": MeasurementConfig,
    "stragglers": StragglersConfig,
    "checks": ChecksConfig,
    "parallel": ParallelConfig,
    "compression": CompressionConfig,
    "restarts": RestartsConfig,
    "evaluation": EvaluationConfig,
    "lr_schedule": LrScheduleConfig,
    "sync": SyncConfig,
    "zero": ZeroConfig,
}
_fields_init = RunConfig.__init__


@functools.wraps(_fields_init)
def _init(self, **values: Any) -> None:
    """RunConfig(...) also takes the flat option names (microbatches=4), each moved into its group by
    dtlab.config.options.nest."""
    _fields_init(self, **nest(values))


RunConfig.__init__ = _init


def tiny(**overrides: Any) -> RunConfig:
    """Preset for tests and quick labs: the tiny model, 2 ranks, few short steps."""
    base = dict(
        model="tiny",
        nproc=2,
        steps=4,
        warmup=1,
        batch_size=4,
        seq_len=32,
        bucket_mb=1.0,
        model_source="random",
        data="offline",
        timeout_s=300.0,
    )
    base.update(overrides)
    return RunConfig.from_dict(base)
