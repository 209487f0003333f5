"""Beyond data parallelism, checked before launch: how a run splits the model over its ranks (tensor parallelism,
a pipeline), how many data-parallel replicas of that split it runs, a pipeline's micro-batches and schedule,
dropout, and the single-process reference. Pure.

- `ParallelConfig`: the options group `RunConfig.parallel` (dp_degree, microbatches, schedule; flat names
  dp_degree, microbatches, pp_schedule: dtlab.config.options);
- `layout(cfg)` gives the run's degrees {"dp", "tp", "pp"} (their product is the world size): a 'tp' run of
  4 ranks with dp_degree 2 is dp 2 x tp 2; 'pp' the same with stages; every other strategy is dp = world.
- `split_layers(n_layers, stages)` is the one rule for which transformer blocks each pipeline stage holds.
- dtlab.config.rules (`layout`, `reference`) refuses, by field, a split the model cannot take: a tensor-parallel
  degree that does not divide the attention heads and the feed-forward width, more stages than layers, a batch
  the micro-batches do not divide, 1F1B with fewer micro-batches than stages, a reference that dropout would make
  incomparable.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.config.options import label
from dtlab.config.strategies import strategy_spec
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
        """Each field on its own (ValueError naming it); dtlab.config.rules checks them against the run."""
        int_at_least(label("parallel", "dp_degree"), self.dp_degree, 1)
        int_at_least(label("parallel", "microbatches"), self.microbatches, 1)
        choice(label("parallel", "schedule"), self.schedule, PP_SCHEDULES)


@dataclass(kw_only=True)
class ChecksConfig:
    """What a run checks itself against while it trains (`RunConfig.checks`; flat name reference)."""

    reference: bool = False
    """Every rank also trains an unparallelised copy of the model on the step's global batch and records how its
    loss and gradients compare with it (strategies 'tp', 'pp', 'fsdp2'; needs dropout 0); results.reference."""

    def validate(self) -> None:
        """The field on its own (ValueError naming it); dtlab.config.rules checks it against the strategy."""
        if not isinstance(self.reference, bool):
            raise ValueError(f"{label('checks', 'reference')} must be true or false, got {self.reference!r}")


def world_size(cfg) -> int:
    """Ranks in the job: nproc on each of nnodes nodes."""
    return int(cfg.nproc) * int(getattr(cfg, "nnodes", 1) or 1)


def layout(cfg, spec=None) -> dict:
    """The run's degrees {"dp": d, "tp": t, "pp": p}, d x t x p = the world size (validated configs only; `spec`:
    the strategy's spec, when the caller has it)."""
    world, spec = world_size(cfg), spec or strategy_spec(cfg.strategy)
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
