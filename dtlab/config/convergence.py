"""The levers with a convergence cost, checked before launch, and the rules the ranks and the model share.

- `eval_every` N: held-out accuracy every N optimizer steps (and before step 0 and after the last), on one rank,
  between steps: outside the timed step (dtlab.rank.evaluation);
- `local_sgd` H: no gradient all-reduce; every rank steps its own optimizer and the parameters are averaged
  after every H local steps (Lin et al., "Don't use large mini-batches, use local SGD"): one all-reduce of every
  parameter per H steps (dtlab.rank.local_sgd);
- strategy 'async' with `max_staleness` s and `staleness_policy`: an applied gradient was computed at most s
  server updates ago (Tsitsiklis et al. 1986: asynchronous SGD converges under bounded staleness);
- `lr_scaling` with `base_batch` and `warmup_steps`: lr x k ('linear', Goyal et al. 2017) or x sqrt(k) ('sqrt',
  for adaptive optimizers), k = the samples behind one optimizer update / base_batch, with a linear warmup.

Pure: the ranks build their schedule from `lr_factor`, the model and the tests read the same function.
"""

from __future__ import annotations

import math

from dtlab.config.checks import choice, int_at_least
from dtlab.config.strategies import strategy_spec

LR_SCALINGS = ("none", "linear", "sqrt")
STALENESS_POLICIES = ("drop", "wait")
DEFAULT_MAX_STALENESS = 2
#: the generated sentences' held-out split and GLUE SST-2's validation split have this many sentences
HELDOUT_SENTENCES = 872
#: evaluating full DistilBERT on a CPU costs about 75-115 ms a sentence: a subset of this many, said so in the run
CPU_DISTILBERT_EVAL_SAMPLES = 64


def update_batch(cfg) -> int:
    """Samples behind one optimizer update: the global batch of a synchronous step (batch_size x accumulate x
    every rank), one rank's batch under local SGD (each rank updates on its own gradient), one worker's batch
    for the asynchronous server (one update per pushed gradient)."""
    spec = strategy_spec(cfg.strategy)
    per_rank = cfg.batch_size * cfg.accumulate
    if spec.asynchronous or cfg.local_sgd:
        return per_rank
    return per_rank * cfg.nproc * getattr(cfg, "nnodes", 1)


def lr_multiplier(rule: str, k: float) -> float:
    """The learning-rate factor of a scaling rule for a batch k times the base batch: none 1, linear k, sqrt
    sqrt(k)."""
    choice("lr_scaling", rule, LR_SCALINGS)
    if not (k > 0 and math.isfinite(k)):
        raise ValueError(f"k (update batch / base batch) must be a positive number, got {k!r}")
    return {"none": 1.0, "linear": float(k), "sqrt": math.sqrt(k)}[rule]


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The fraction of the peak learning rate optimizer step `step` (0-based) uses: (step + 1) / warmup_steps
    during the warmup, 1 after it (0 warmup steps: always 1). torch's LambdaLR calls it with the number of
    scheduler steps taken so far, so the scheduler steps once after each optimizer step."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    return 1.0


def peak_lr(cfg) -> float:
    """`cfg.lr` scaled by `cfg.lr_scaling` for this run's update batch over `cfg.base_batch` (None: batch_size)."""
    base = cfg.base_batch if cfg.base_batch is not None else cfg.batch_size
    return cfg.lr * lr_multiplier(cfg.lr_scaling, update_batch(cfg) / base)


def lr_at(cfg, step: int) -> float:
    """The learning rate optimizer step `step` of this run uses (the scaling rule and the warmup)."""
    return peak_lr(cfg) * warmup_factor(step, cfg.warmup_steps)


def lr_rule_text(cfg) -> str:
    """The rule in words, with this run's numbers (recorded in config.json)."""
    base = cfg.base_batch if cfg.base_batch is not None else cfg.batch_size
    k = update_batch(cfg) / base
    text = (f"lr {cfg.lr:g} x {lr_multiplier(cfg.lr_scaling, k):.4g} ({cfg.lr_scaling}, k = update batch "
            f"{update_batch(cfg)} / base batch {base} = {k:.4g}) = {peak_lr(cfg):.4g}")
    if cfg.warmup_steps:
        text += f", warmed up linearly over {cfg.warmup_steps} steps: step s uses (s + 1) / {cfg.warmup_steps} of it"
    return text


def eval_due(steps_done: int, every: int, total: int) -> bool:
    """Whether a run evaluates after `steps_done` optimizer steps: before the first (0), every `every`, and
    after the last (`total`)."""
    return bool(every) and (steps_done == 0 or steps_done % every == 0 or steps_done == total)


def eval_samples_for(cfg, device_type: str) -> int | None:
    """Held-out sentences one evaluation uses: cfg.eval_samples, or None (all) except full DistilBERT on a CPU
    (CPU_DISTILBERT_EVAL_SAMPLES: a subset, which the run records)."""
    if cfg.eval_samples is not None:
        return cfg.eval_samples
    if device_type == "cpu" and cfg.model == "distilbert":
        return CPU_DISTILBERT_EVAL_SAMPLES
    return None


def validate_convergence(cfg) -> None:
    """Refuse bad convergence-lever settings by name before launch (ValueError)."""
    spec = strategy_spec(cfg.strategy)
    int_at_least("eval_every", cfg.eval_every, 0)
    if cfg.eval_samples is not None:
        int_at_least("eval_samples", cfg.eval_samples, 1)
    if cfg.eval_every and not spec.evaluates:
        raise spec.refuse("eval_every", cfg.eval_every, "its rank loop has no place to evaluate between steps")
    if cfg.eval_every and cfg.data not in ("auto", "glue", "offline"):
        raise ValueError(f"eval_every needs a held-out split: data 'auto', 'glue' (SST-2 validation) or 'offline' "
                         f"(dtlab's held-out generated sentences); a local file has none, got data {cfg.data!r}")
    choice("lr_scaling", cfg.lr_scaling, LR_SCALINGS)
    if cfg.base_batch is not None:
        int_at_least("base_batch", cfg.base_batch, 1)
    int_at_least("warmup_steps", cfg.warmup_steps, 0)
    for name, default in (("lr_scaling", "none"), ("warmup_steps", 0), ("base_batch", None)):
        if getattr(cfg, name) != default and not spec.lr_schedule:
            raise spec.refuse(name, getattr(cfg, name), "its optimizer is not built by dtlab's loop")
    int_at_least("local_sgd", cfg.local_sgd, 0)
    if cfg.local_sgd:
        if not spec.local_sgd:
            raise spec.refuse("local_sgd", cfg.local_sgd, "it needs a rank loop that steps its own optimizer")
        for name, off, why in (("comm_hook", "none", "local SGD all-reduces parameters, not DDP's gradient buckets"),
                               ("straggler", None, "the straggler rule reads DDP's buckets"),
                               ("checkpoint_every", 0, "each rank's own optimizer state is not checkpointed"),
                               ("max_restarts", 0, "each rank's own optimizer state is not checkpointed")):
            if getattr(cfg, name) != off:
                raise ValueError(f"local_sgd {cfg.local_sgd} cannot be combined with {name} "
                                 f"{getattr(cfg, name)!r}: {why}")
    int_at_least("max_staleness", cfg.max_staleness, 0)
    choice("staleness_policy", cfg.staleness_policy, STALENESS_POLICIES)
    for name, default in (("max_staleness", DEFAULT_MAX_STALENESS), ("staleness_policy", "drop")):
        if getattr(cfg, name) != default and not spec.asynchronous:
            raise spec.refuse(name, getattr(cfg, name), "only an asynchronous server has stale gradients")
    if spec.asynchronous and cfg.nproc * getattr(cfg, "nnodes", 1) <= spec.server_ranks:
        raise ValueError(f"strategy {spec.name!r} needs at least {spec.server_ranks + 1} ranks (rank 0 is the "
                         f"server, the others workers), got nproc {cfg.nproc}")
