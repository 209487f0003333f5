"""The strategies, one spec each: which rank module and class trains, how its communication is recorded and priced
and what it supports. Every check reads these specs; nothing else compares strategy names.

A new strategy = a module in dtlab/rank/strategies/ with a dtlab.rank.loop.Strategy class plus one spec here. A new
lever names the strategies that support it by adding a field below.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """What one strategy is and supports (the names used in error messages are the field docs)."""

    name: str
    """The `RunConfig.strategy` value."""
    module: str
    """The rank-side module that trains (`python -m dtlab.rank.worker` imports it)."""
    rank_class: str
    """The class in `module` that trains one rank (a dtlab.rank.loop.Strategy; its `for_rank` may pick another
    for a rank or a config: the asynchronous server on rank 0, local SGD under 'ddp')."""
    title: str
    """One line for tables and help."""
    records: str
    """What the run directory holds of its communication: 'buckets' (DDP's gradient buckets through the recording
    comm hook, one row per bucket) or 'collectives' (every collective with its op, bytes and phase; the
    asynchronous server's messages as ops 'push' and 'pull'). Local SGD's parameter averages are collectives
    (op 'all_reduce', phase 'average') whatever the strategy records otherwise."""
    bucket_op: str | None = None
    """For 'buckets': the calibrated op that prices one bucket ('all_reduce', or 'ps' for reduce + broadcast)."""
    compute_baseline: bool = False
    """No-op comm hook steps after the timed ones measure T_comp (`baseline_steps`)."""
    comm_hooks: bool = False
    """DDP compression hooks (`comm_hook` fp16, bf16, powersgd) apply."""
    accumulate: bool = False
    """Gradient accumulation (`accumulate` K) with DDP's no_sync."""
    stragglers: bool = False
    """Its rank loop injects `straggler` delays and the recorded buckets give each rank's wait."""
    checkpoints: bool = False
    """`checkpoint_every` / `max_restarts` (torch.distributed.checkpoint, torchrun restarts) are wired."""
    needs_record: bool = False
    """The recording hook is the strategy's own transport: `record=False` is refused."""
    blocked_time: bool = False
    """Exposed communication is measured as the time the rank was blocked waiting for its collectives
    (T_comp = T_step - t_blocked), not as T_step minus a no-op baseline: its collectives may overlap compute
    (ZeRO-3's side streams) or sit on the compute path (tensor parallelism, a pipeline's sends and receives)."""
    shards: bool = False
    """Parameters, gradients and optimizer state are partitioned over the ranks (one rank shards nothing)."""
    model_axis: str | None = None
    """How one replica splits the model over its ranks: 'tp' (each layer's weights, Megatron-style), 'pp'
    (the layers, into pipeline stages) or None (every rank runs the whole model)."""
    microbatches: bool = False
    """A pipeline's `microbatches` and `pp_schedule` apply."""
    mesh: bool = False
    """`dp_degree` > 1 applies: data-parallel replicas of its model-parallel layout on a 2-D DeviceMesh."""
    reference: bool = False
    """`reference`: every rank also trains a single-process copy and records how loss and gradients compare."""
    gloo_cuda_note: str = ""
    """What gloo on CUDA tensors (ranks sharing a GPU before NCCL 2.30) means for this strategy's numbers."""
    gloo_cuda_refused: str = ""
    """Why this strategy cannot run on gloo with CUDA tensors ('' when it can): a placement that would put it there
    runs it on CPU instead when the device is 'auto', and is refused when 'cuda' was asked for."""
    evaluates: bool = False
    """Held-out evaluation every `eval_every` steps on one rank, outside the timed step (dtlab.rank.evaluation)."""
    lr_schedule: bool = False
    """Its optimizer is dtlab's own AdamW: `lr_scaling` with the batch and `warmup_steps` apply."""
    local_sgd: bool = False
    """Local SGD (`local_sgd` H): no gradient all-reduce, parameters averaged every H steps (dtlab.rank.local_sgd)."""
    asynchronous: bool = False
    """Workers push gradients to a server and pull parameters without waiting for each other: one optimizer
    update per pushed gradient, `max_staleness` and `staleness_policy` apply (dtlab.rank.strategies.async_ps)."""
    server_ranks: int = 0
    profiles: bool = False
    """`profile=True` records a PyTorch profiler trace of the measured steps (dtlab.rank.profiling)."""
    """Ranks (the lowest) that serve and take no training steps of their own (the asynchronous server: 1)."""


#: Which spec field says whether a strategy supports a RunConfig field.
SUPPORT_FIELDS = {
    "baseline_steps": "compute_baseline",
    "comm_hook": "comm_hooks",
    "accumulate": "accumulate",
    "straggler": "stragglers",
    "checkpoint_every": "checkpoints",
    "max_restarts": "checkpoints",
    "microbatches": "microbatches",
    "pp_schedule": "microbatches",
    "dp_degree": "mesh",
    "reference": "reference",
}
#: the convergence levers (dtlab.config.convergence)
SUPPORT_FIELDS.update(
    {
        "eval_every": "evaluates",
        "lr_scaling": "lr_schedule",
        "warmup_steps": "lr_schedule",
        "base_batch": "lr_schedule",
        "local_sgd": "local_sgd",
        "max_staleness": "asynchronous",
        "staleness_policy": "asynchronous",
        "profile": "profiles",
    }
)


STRATEGIES: dict[str, StrategySpec] = {
    s.name: s
    for s in (
        StrategySpec(
            name="ddp",
            module="dtlab.rank.strategies.ddp",
            rank_class="DDPStrategy",
            title="ring all-reduce (ddp)",
            records="buckets",
            bucket_op="all_reduce",
            compute_baseline=True,
            comm_hooks=True,
            accumulate=True,
            stragglers=True,
            checkpoints=True,
            evaluates=True,
            lr_schedule=True,
            local_sgd=True,
            profiles=True,
        ),
        StrategySpec(
            name="ps",
            module="dtlab.rank.strategies.ps",
            rank_class="PSStrategy",
            title="reduce + broadcast (ps)",
            records="buckets",
            bucket_op="ps",
            compute_baseline=True,
            stragglers=True,
            needs_record=True,
            evaluates=True,
            lr_schedule=True,
        ),
        StrategySpec(
            name="zero3",
            module="dtlab.rank.strategies.zero3",
            rank_class="Zero3",
            title="DeepSpeed ZeRO-3 (zero3)",
            records="collectives",
            blocked_time=True,
            shards=True,
            gloo_cuda_note="ZeRO-3 runs DeepSpeed's CUDA accelerator over gloo: each all-gather and reduce-scatter "
            "is copied to host memory and back, and gloo's reduce-scatter is an all-reduce then a "
            "chunk (twice the data)",
        ),
        StrategySpec(
            name="fsdp2",
            module="dtlab.rank.strategies.fsdp2",
            rank_class="FullyShard",
            title="PyTorch FSDP2 fully_shard (fsdp2)",
            records="collectives",
            blocked_time=True,
            shards=True,
            reference=True,
        ),
        StrategySpec(
            name="tp",
            module="dtlab.rank.strategies.tp",
            rank_class="TensorParallel",
            title="tensor parallel, Megatron-style (tp)",
            records="collectives",
            blocked_time=True,
            model_axis="tp",
            mesh=True,
            reference=True,
        ),
        StrategySpec(
            name="pp",
            module="dtlab.rank.strategies.pp",
            rank_class="Pipeline",
            title="pipeline parallel (pp)",
            records="collectives",
            blocked_time=True,
            model_axis="pp",
            microbatches=True,
            mesh=True,
            reference=True,
            gloo_cuda_refused="torch.distributed.pipelining sends activations point to point "
            "(batch_isend_irecv), and gloo's send of a CUDA tensor reads device memory as "
            "host memory: every stage fails with 'writev: Bad address' (torch 2.11, gloo "
            "on an H200)",
        ),
        StrategySpec(
            name="async",
            module="dtlab.rank.strategies.async_ps",
            rank_class="AsyncWorker",
            title="asynchronous parameter server (async)",
            records="collectives",
            evaluates=True,
            lr_schedule=True,
            asynchronous=True,
            server_ranks=1,
            gloo_cuda_note="the server's parameters and every pushed gradient are staged through host memory",
        ),
    )
}


def strategy_spec(name: str) -> StrategySpec:
    """The spec of strategy `name` (a recorded run's config names it: dtlab.results.upgrade)."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {name!r}")
    return STRATEGIES[name]
