"""The levers with a convergence cost, checked before launch, and the rules the ranks and the model share.

- `eval_every` N: held-out accuracy every N optimizer steps (and before step 0 and after the last), on one rank,
  between steps: outside the timed step (dtlab.rank.evaluation);
- `local_sgd` H: no gradient all-reduce; every rank steps its own optimizer and the parameters are averaged
  after every H local steps (Lin et al., "Don't use large mini-batches, use local SGD"): one all-reduce of every
  parameter per H steps (dtlab.rank.local_sgd);
- strategy 'async' with `max_staleness` s and `staleness_policy`: an applied gradient was computed at most s
  server updates ago (Tsitsiklis et al. 1986: asynchronous SGD converges under bounded staleness);
- `lr_scaling` with `base_batch` and `warmup_steps`: lr x k ('linear', Goyal et al. 2017) or x sqrt(k) ('sqrt',
  for adaptive optimizers), k = the samples behind one optimizer update / base_batch, with a linear warmup;
- `lr` None (the default): the base rate is resolved by the rank once the model is built (`resolve_lr`):
  FINE_TUNING_LR for pretrained weights, RANDOM_INIT_LR[model] for random ones; scaling and warmup apply on top.

Pure: the ranks build their schedule from `lr_factor`, the model and the tests read the same function.
"""

from __future__ import annotations

import math

from dtlab.config.validate import choice, int_at_least
from dtlab.config.strategies import strategy_spec

LR_SCALINGS = ("none", "linear", "sqrt")
STALENESS_POLICIES = ("drop", "wait")
DEFAULT_MAX_STALENESS = 2
#: the generated sentences' held-out split and GLUE SST-2's validation split have this many sentences
HELDOUT_SENTENCES = 872
#: evaluating full DistilBERT on a CPU costs about 75-115 ms a sentence: a subset of this many, said so in the run
CPU_DISTILBERT_EVAL_SAMPLES = 64


#: AdamW's base rate for fine-tuning pretrained weights: the low end of BERT's GLUE fine-tuning range (2e-5 to
#: 5e-5, Devlin et al. 2019), what DistilBERT is fine-tuned with on SST-2.
FINE_TUNING_LR = 2e-5
#: A base rate that trains each model from random weights, and where it comes from (docs/convergence.md). The
#: fine-tuning rate does not train the tiny model (a 200-step run at 2e-5 stays at the majority class, 0.534);
#: random-init DistilBERT learned at 2e-5 on the GPU too, less reliably than at 1e-4 (0.764 to 0.992 over 4 seeds).
RANDOM_INIT_LR = {
    "tiny": (
        1e-3,
        "measured: `dtlab run --model tiny --steps 200 --eval-every 50`, 2 CPU ranks, seeds 0, 1, 2 reached "
        "0.955 to 1.0 held-out accuracy at step 200, where 2e-5 stays at 0.466 to 0.534",
    ),
    "distilbert": (
        1e-4,
        "taken from BERT's pre-training from scratch, Devlin et al. 2019; checked on one H200 GPU: 150 "
        "steps of 16 sentences, seeds 0 to 3, 0.89 to 0.96 held-out accuracy at step 150, where 3e-4 "
        "and 1e-3 stay at 0.466 to 0.534; not measured on a CPU, for longer runs or larger batches",
    ),
}


def default_lr(model: str, pretrained: bool) -> dict:
    """The base learning rate a run of `model` takes when `lr` is not set, and why: {"value", "source"}."""
    if pretrained:
        return {
            "value": FINE_TUNING_LR,
            "source": f"default for pretrained weights: the fine-tuning rate "
            f"{FINE_TUNING_LR:g} (BERT's GLUE range 2e-5 to 5e-5)",
        }
    if model not in RANDOM_INIT_LR:
        raise ValueError(f"model must be one of {', '.join(map(repr, RANDOM_INIT_LR))}, got {model!r}")
    value, why = RANDOM_INIT_LR[model]
    return {"value": value, "source": f"default for a randomly initialised {model} model ({why})"}


def weights_known(cfg) -> bool | None:
    """Whether the run's weights will be pretrained, as far as the config alone decides it: False for the tiny model
    or model_source 'random', True for model_source 'hub' or a model_path (those runs fail rather than fall back to
    random weights), None for 'auto' (the local cache or the hub decide, in the rank)."""
    if cfg.model == "tiny" or cfg.model_source == "random":
        return False
    if cfg.model_source == "hub" or cfg.model_path:
        return True
    return None


def resolve_lr(cfg, pretrained: bool | None = None) -> dict:
    """The run's base learning rate (before `lr_scaling` and the warmup) and why: {"value", "source"}. An explicit
    `cfg.lr` wins; otherwise `default_lr` for the weights: `pretrained` as the rank found them once the model was
    built (dtlab.rank.optim.settle_lr), or None: as the config decides (`weights_known`), and a ValueError where
    only the rank can tell (model_source 'auto'; read `run.lr` or `run.resolved["lr"]` of a run)."""
    if cfg.lr is not None:
        return {"value": cfg.lr, "source": "set explicitly (RunConfig.lr, --lr)"}
    if pretrained is None:
        pretrained = weights_known(cfg)
    if pretrained is None:
        raise ValueError(
            f"lr is None (auto) with model_source {cfg.model_source!r}: the run picks "
            f"{FINE_TUNING_LR:g} if pretrained weights load, else the rate for random weights "
            f"({RANDOM_INIT_LR[cfg.model][0]:g}); read run.lr of a run, or set lr"
        )
    return default_lr(cfg.model, pretrained)


def base_lr(cfg, pretrained: bool | None = None) -> float:
    """`resolve_lr`'s value: the rate `peak_lr` scales."""
    return resolve_lr(cfg, pretrained)["value"]


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
    """The base rate (`base_lr`: `cfg.lr` or its default) scaled by `cfg.lr_scaling` for this run's update batch
    over `cfg.base_batch` (None: batch_size)."""
    base = cfg.base_batch if cfg.base_batch is not None else cfg.batch_size
    return base_lr(cfg) * lr_multiplier(cfg.lr_scaling, update_batch(cfg) / base)


def lr_at(cfg, step: int) -> float:
    """The learning rate optimizer step `step` of this run uses (the scaling rule and the warmup)."""
    return peak_lr(cfg) * warmup_factor(step, cfg.warmup_steps)


def lr_rule_text(cfg) -> str:
    """The rule in words, with this run's numbers (recorded in config.json)."""
    base = cfg.base_batch if cfg.base_batch is not None else cfg.batch_size
    k = update_batch(cfg) / base
    text = (
        f"lr {base_lr(cfg):g} x {lr_multiplier(cfg.lr_scaling, k):.4g} ({cfg.lr_scaling}, k = update batch "
        f"{update_batch(cfg)} / base batch {base} = {k:.4g}) = {peak_lr(cfg):.4g}"
    )
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
        raise ValueError(
            f"eval_every needs a held-out split: data 'auto', 'glue' (SST-2 validation) or 'offline' "
            f"(dtlab's held-out generated sentences); a local file has none, got data {cfg.data!r}"
        )
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
        for name, off, why in (
            ("comm_hook", "none", "local SGD all-reduces parameters, not DDP's gradient buckets"),
            ("straggler", None, "the straggler rule reads DDP's buckets"),
            ("checkpoint_every", 0, "each rank's own optimizer state is not checkpointed"),
            ("max_restarts", 0, "each rank's own optimizer state is not checkpointed"),
        ):
            if getattr(cfg, name) != off:
                raise ValueError(
                    f"local_sgd {cfg.local_sgd} cannot be combined with {name} {getattr(cfg, name)!r}: {why}"
                )
    int_at_least("max_staleness", cfg.max_staleness, 0)
    choice("staleness_policy", cfg.staleness_policy, STALENESS_POLICIES)
    for name, default in (("max_staleness", DEFAULT_MAX_STALENESS), ("staleness_policy", "drop")):
        if getattr(cfg, name) != default and not spec.asynchronous:
            raise spec.refuse(name, getattr(cfg, name), "only an asynchronous server has stale gradients")
    if spec.asynchronous and cfg.nproc * getattr(cfg, "nnodes", 1) <= spec.server_ranks:
        raise ValueError(
            f"strategy {spec.name!r} needs at least {spec.server_ranks + 1} ranks (rank 0 is the "
            f"server, the others workers), got nproc {cfg.nproc}"
        )
