"""Beyond data parallelism, checked before launch: how a run splits the model over its ranks (tensor parallelism,
a pipeline), how many data-parallel replicas of that split it runs, a pipeline's micro-batches and schedule,
dropout, and the single-process reference. Pure.

- `ParallelConfig`: the options group `RunConfig.parallel` (dp_degree, microbatches, schedule; flat names
  dp_degree, microbatches, pp_schedule: dtlab.config.options);
- `layout(cfg)` gives the run's degrees {"dp", "tp", "pp"} (their product is the world size): a 'tp' run of
  4 ranks with dp_degree 2 is dp 2 x tp 2; 'pp' the same with stages; every other strategy is dp = world.
- `split_layers(n_layers, stages)` is the one rule for which transformer blocks each pipeline stage holds.
- `validate_parallel(cfg)` refuses, by field, a split the model cannot take: a tensor-parallel degree that does
  not divide the attention heads and the feed-forward width, more stages than layers, a batch the micro-batches
  do not divide, 1F1B with fewer micro-batches than stages, a reference that dropout would make incomparable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.config.models import model_arch
from dtlab.config.options import label
from dtlab.config.strategies import SUPPORT_FIELDS, strategy_spec
from dtlab.config.validate import choice, int_at_least

PP_SCHEDULES = ("gpipe", "1f1b")
AXES = ("dp", "tp", "pp")


@dataclass(kw_only=True)
class ParallelConfig:
    """A model-parallel layout's options (`RunConfig.parallel`; strategies 'tp' and 'pp'): its data-parallel replicas
    and a pipeline's micro-batches and schedule."""

    dp_degree: int = 1
    """Data-parallel replicas of a model-parallel layout ('tp', 'pp'): the ranks form a dp_degree x
    (ranks / dp_degree) DeviceMesh, each replica trains on its own batch and the replicas average gradients."""
    microbatches: int = 1
    """Micro-batches M per step of a pipeline (strategy 'pp'): the batch is cut into M equal parts that flow
    through the stages one after another (batch_size must divide by M); see dtlab.config.parallel."""
    schedule: str = "gpipe"
    """A pipeline's schedule: 'gpipe' (every forward, then every backward) or '1f1b' (one forward, one backward:
    at most P micro-batches' activations in flight; needs microbatches >= the P stages)."""

    def validate(self) -> None:
        """Each field on its own (ValueError naming it); `validate_parallel` checks them against the run."""
        int_at_least(label("parallel", "dp_degree"), self.dp_degree, 1)
        int_at_least(label("parallel", "microbatches"), self.microbatches, 1)
        choice(label("parallel", "schedule"), self.schedule, PP_SCHEDULES)


def world_size(cfg) -> int:
    """Ranks in the job: nproc on each of nnodes nodes."""
    return int(cfg.nproc) * int(getattr(cfg, "nnodes", 1) or 1)


def layout(cfg) -> dict:
    """The run's degrees {"dp": d, "tp": t, "pp": p}, d x t x p = the world size (validated configs only)."""
    world, spec = world_size(cfg), strategy_spec(cfg.strategy)
    if spec.model_axis is None:
        return {"dp": world, "tp": 1, "pp": 1}
    dp = int(cfg.parallel.dp_degree)
    return {
        "dp": dp,
        "tp": world // dp if spec.model_axis == "tp" else 1,
        "pp": world // dp if spec.model_axis == "pp" else 1,
    }


def split_layers(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """[start, stop) of the transformer blocks each of `stages` pipeline stages holds: as even as possible, the
    extra blocks of an uneven split on the last stages (the first stage also holds the embeddings)."""
    if stages < 1 or stages > n_layers:
        raise ValueError(f"stages must be between 1 and the {n_layers} layers, got {stages}")
    base, extra = divmod(n_layers, stages)
    sizes = [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [(a, a + n) for a, n in zip(starts, sizes)]


def validate_parallel(cfg) -> None:
    """Refuse a bad parallel layout by field name (ValueError), after nproc was resolved."""
    spec, par = strategy_spec(cfg.strategy), cfg.parallel
    if not isinstance(par, ParallelConfig):
        raise ValueError(f"parallel must be a ParallelConfig or a dict of its fields, got {type(par).__name__}")
    par.validate()
    if not isinstance(cfg.reference, bool):
        raise ValueError(f"reference must be true or false, got {cfg.reference!r}")
    if cfg.dropout is not None and (
        isinstance(cfg.dropout, bool)
        or not isinstance(cfg.dropout, (int, float))
        or not math.isfinite(cfg.dropout)
        or not 0 <= cfg.dropout < 1
    ):
        raise ValueError(f"dropout must be None (the model's own) or a number in [0, 1), got {cfg.dropout!r}")
    for name, value, default in (
        ("microbatches", par.microbatches, 1),
        ("pp_schedule", par.schedule, "gpipe"),
        ("dp_degree", par.dp_degree, 1),
        ("reference", cfg.reference, False),
    ):
        if value != default and not getattr(spec, SUPPORT_FIELDS[name]):
            raise spec.refuse(name, value)
    if cfg.reference and cfg.dropout != 0:
        raise ValueError(
            f"reference needs dropout 0 (got {cfg.dropout!r}): with dropout on, the run and its "
            "single-process copy draw different masks and their losses cannot be compared"
        )
    world = world_size(cfg)
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
    if spec.model_axis == "pp":
        if per > arch["n_layers"]:
            raise ValueError(
                f"the {what} (nproc x nnodes / dp_degree = {per}) must be at most {cfg.model}'s "
                f"{arch['n_layers']} layers (one or more transformer blocks per stage)"
            )
        if cfg.batch_size % par.microbatches:
            raise ValueError(
                f"microbatches must divide batch_size ({cfg.batch_size}) into equal micro-batches, "
                f"got {par.microbatches}"
            )
        if par.schedule == "1f1b" and par.microbatches < per:
            raise ValueError(
                f"microbatches must be >= the {per} pipeline stages for pp_schedule '1f1b' (its "
                f"warm-up fills every stage), got {par.microbatches}; use 'gpipe' or more micro-batches"
            )
