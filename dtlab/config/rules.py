"""The rules between a run's fields, in one place: what the strategy supports, and the option groups against each
other and against the run.

Each option group checks its own fields (its dataclass's `validate()`: a number in range, a name from a list).
Every rule that reads more than one group, or a field against the strategy or the placement, is a function here,
listed in `RULES`; `RunConfig.validate` looks the strategy's spec up once and runs them all with it
(`check_run`). Each raises ValueError naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math

from dtlab.config.convergence import DEFAULT_MAX_STALENESS
from dtlab.config.models import model_arch
from dtlab.config.parallel import world_size
from dtlab.config.stragglers import parse_straggler
from dtlab.config.strategies import STRATEGIES, SUPPORT_FIELDS, StrategySpec


def refuse(spec: StrategySpec, field: str, value, why: str = "") -> ValueError:
    """The ValueError for a field (set to `value`) that strategy `spec` does not support, naming those that do. The
    field is named as a user gives it, flat (`straggler`, `comm_hook`: dtlab.config.options.FLAT)."""
    allowed = [s.name for s in STRATEGIES.values() if getattr(s, SUPPORT_FIELDS[field])]
    return ValueError(
        f"{field} {value!r} applies to strategy {' or '.join(repr(a) for a in allowed)} only, "
        f"got strategy {spec.name!r}" + (f": {why}" if why else "")
    )


def check_run(cfg, spec: StrategySpec, placed) -> None:
    """Every rule of `RULES` for validated fields `cfg` of strategy `spec`, placed as `placed`
    (dtlab.config.placement.Placement)."""
    for rule in RULES:
        rule(cfg, spec, placed)


def measurement(cfg, spec, placed) -> None:
    """The no-op baseline and the profiler follow the DDP loop's steps."""
    m = cfg.measurement
    if m.baseline_steps and not spec.compute_baseline:
        raise refuse(spec, "baseline_steps", m.baseline_steps, "the no-op comm hook baseline")
    if m.profile and not spec.profiles:
        raise refuse(spec, "profile", m.profile, "the profiler's schedule follows the DDP loop's steps")


def levers(cfg, spec, placed) -> None:
    """Compression hooks and accumulation reach only what DDP all-reduces itself; both need the recorder."""
    comp = cfg.compression
    if comp.hook != "none" and not spec.comm_hooks:
        raise refuse(
            spec,
            "comm_hook",
            comp.hook,
            "a DDP compression hook reaches only the buckets DDP all-reduces itself "
            "(ZeRO-3 reduce-scatters inside DeepSpeed; ps reduces with its own hook)",
        )
    if cfg.ddp.accumulate != 1 and not spec.accumulate:
        raise refuse(
            spec, "accumulate", cfg.ddp.accumulate, "gradient accumulation is wired through DDP's no_sync only"
        )
    if spec.needs_record and not cfg.record:
        raise ValueError(
            f"strategy {spec.name!r} needs record=True: the recording hook is what reduces each "
            "bucket (without it DDP would all-reduce)"
        )
    if comp.hook != "none" and not cfg.record:
        raise ValueError(f"comm_hook {comp.hook!r} needs record=True: the recorder is what installs the hook")
    if comp.hook == "bf16" and placed.backend == "gloo" and placed.device == "cuda":
        raise ValueError(
            "comm_hook 'bf16' is not supported for gloo on CUDA tensors here; use 'fp16', or NCCL (one rank per GPU)"
        )


def stragglers(cfg, spec, placed) -> None:
    """A straggler needs a rank loop that injects delays, a rule that parses for these ranks, and the recorder
    (the wait times and the FACTOR rule's compute times are read from the recorded buckets)."""
    if cfg.stragglers.slow is None:
        return
    if not spec.stragglers:
        raise refuse(spec, "straggler", cfg.stragglers.slow, "its rank loop does not inject delays")
    parse_straggler(cfg.stragglers.slow, cfg.nproc)
    if not cfg.record:
        raise ValueError(
            "straggler needs record=True: the wait times and the FACTOR rule's compute times are "
            "read from the recorded buckets"
        )


def restarts(cfg, spec, placed) -> None:
    """Checkpoints: within the run, wired into the strategy's loop, on one node for restarts, not with PowerSGD."""
    rs = cfg.restarts
    if rs.checkpoint_every > cfg.steps:
        raise ValueError(
            f"checkpoint_every must be <= steps ({cfg.steps}) so that a checkpoint is written "
            f"(0 turns checkpoints off), got {rs.checkpoint_every}"
        )
    if (rs.checkpoint_every or rs.max_restarts) and not spec.checkpoints:
        field = "checkpoint_every" if rs.checkpoint_every else "max_restarts"
        raise refuse(
            spec, field, getattr(rs, field), "its rank loop does not save or resume torch.distributed.checkpoint state"
        )
    if rs.max_restarts and cfg.nnodes > 1:
        raise ValueError(
            "max_restarts applies to single-node runs (nnodes 1): a restarted attempt keys its "
            "rendezvous by the restart count, which every node's agent would have to agree on; "
            "use checkpoint_every and relaunch the job instead"
        )
    if rs.checkpoint_every and cfg.compression.hook == "powersgd":
        raise ValueError(
            "checkpoint_every with comm_hook 'powersgd' is refused: PowerSGD's error-feedback state "
            "is not checkpointed, so a resumed run would not continue the same training; use "
            "comm_hook 'none', 'fp16' or 'bf16'"
        )


def reference(cfg, spec, placed) -> None:
    """The layout options and the single-process reference: supported by the strategy, dropout off."""
    par = cfg.parallel
    for name, value, default in (
        ("microbatches", par.microbatches, 1),
        ("pp_schedule", par.schedule, "gpipe"),
        ("dp_degree", par.dp_degree, 1),
        ("reference", cfg.checks.reference, False),
    ):
        if value != default and not getattr(spec, SUPPORT_FIELDS[name]):
            raise refuse(spec, name, value)
    if cfg.checks.reference and cfg.dropout != 0:
        raise ValueError(
            f"reference needs dropout 0 (got {cfg.dropout!r}): with dropout on, the run and its "
            "single-process copy draw different masks and their losses cannot be compared"
        )


def layout(cfg, spec, placed) -> None:
    """A model-parallel layout: equal replicas, at least 2 ranks a replica, a split the model allows."""
    par, world = cfg.parallel, world_size(cfg)
    if world % par.dp_degree:
        raise ValueError(
            f"dp_degree must divide the {world} ranks (nproc x nnodes) into equal replicas, got {par.dp_degree}"
        )
    if spec.model_axis is None:
        return
    per = world // par.dp_degree
    arch = model_arch(cfg.model)
    what = {"tp": "tensor-parallel degree", "pp": "pipeline stages"}[spec.model_axis]
    if per < 2:
        raise ValueError(
            f"strategy {cfg.strategy!r} needs at least 2 ranks per replica ({what}); nproc x nnodes "
            f"{world} / dp_degree {par.dp_degree} = {per}"
        )
    if spec.model_axis == "tp":
        for name in ("n_heads", "hidden_dim"):
            if arch[name] % per:
                raise ValueError(
                    f"the {what} (nproc x nnodes / dp_degree = {per}) must divide {cfg.model}'s "
                    f"{name} ({arch[name]}): each rank holds whole heads and an equal share of the "
                    "feed-forward columns"
                )
    elif per > arch["n_layers"]:
        raise ValueError(
            f"the {what} (nproc x nnodes / dp_degree = {per}) must be at most {cfg.model}'s "
            f"{arch['n_layers']} layers (one or more transformer blocks per stage)"
        )
    elif cfg.batch_size % par.microbatches:
        raise ValueError(
            f"microbatches must divide batch_size ({cfg.batch_size}) into equal micro-batches, got {par.microbatches}"
        )
    elif par.schedule == "1f1b" and par.microbatches < per:
        raise ValueError(
            f"microbatches must be >= the {per} pipeline stages for pp_schedule '1f1b' (its "
            f"warm-up fills every stage), got {par.microbatches}; use 'gpipe' or more micro-batches"
        )


def evaluation(cfg, spec, placed) -> None:
    """Held-out evaluation and the learning-rate rule need the strategy's own loop and optimizer."""
    ev, sched = cfg.evaluation, cfg.lr_schedule
    if ev.every and not spec.evaluates:
        raise refuse(spec, "eval_every", ev.every, "its rank loop has no place to evaluate between steps")
    if ev.every and cfg.data not in ("auto", "glue", "offline"):
        raise ValueError(
            f"eval_every needs a held-out split: data 'auto', 'glue' (SST-2 validation) or 'offline' "
            f"(dtlab's held-out generated sentences); a local file has none, got data {cfg.data!r}"
        )
    for name, value, default in (
        ("lr_scaling", sched.scaling, "none"),
        ("warmup_steps", sched.warmup_steps, 0),
        ("base_batch", sched.base_batch, None),
    ):
        if value != default and not spec.lr_schedule:
            raise refuse(spec, name, value, "its optimizer is not built by dtlab's loop")


def local_sgd(cfg, spec, placed) -> None:
    """Local SGD steps each rank's own optimizer: no gradient hook, straggler rule or checkpoint goes with it."""
    sync = cfg.sync
    if not sync.local_sgd:
        return
    if not spec.local_sgd:
        raise refuse(spec, "local_sgd", sync.local_sgd, "it needs a rank loop that steps its own optimizer")
    for name, value, off, why in (
        ("comm_hook", cfg.compression.hook, "none", "local SGD all-reduces parameters, not DDP's gradient buckets"),
        ("straggler", cfg.stragglers.slow, None, "the straggler rule reads DDP's buckets"),
        ("checkpoint_every", cfg.restarts.checkpoint_every, 0, "each rank's own optimizer state is not checkpointed"),
        ("max_restarts", cfg.restarts.max_restarts, 0, "each rank's own optimizer state is not checkpointed"),
    ):
        if value != off:
            raise ValueError(f"local_sgd {sync.local_sgd} cannot be combined with {name} {value!r}: {why}")


def asynchronous(cfg, spec, placed) -> None:
    """Staleness belongs to an asynchronous server, which needs a worker beside it."""
    sync = cfg.sync
    for name, value, default in (
        ("max_staleness", sync.max_staleness, DEFAULT_MAX_STALENESS),
        ("staleness_policy", sync.staleness_policy, "drop"),
    ):
        if value != default and not spec.asynchronous:
            raise refuse(spec, name, value, "only an asynchronous server has stale gradients")
    if spec.asynchronous and world_size(cfg) <= spec.server_ranks:
        raise ValueError(
            f"strategy {spec.name!r} needs at least {spec.server_ranks + 1} ranks (rank 0 is the "
            f"server, the others workers), got nproc {cfg.nproc}"
        )


def dropout(cfg, spec, placed) -> None:
    """The model's dropout: None (its own) or a probability (the reference check needs 0)."""
    d = cfg.dropout
    number = not isinstance(d, bool) and isinstance(d, (int, float)) and math.isfinite(d)
    if d is not None and not (number and 0 <= d < 1):
        raise ValueError(f"dropout must be None (the model's own) or a number in [0, 1), got {d!r}")


#: every rule, in the order they run (the fields a later rule reads are checked by an earlier one)
RULES = (
    dropout,
    measurement,
    levers,
    stragglers,
    restarts,
    reference,
    layout,
    evaluation,
    local_sgd,
    asynchronous,
)
