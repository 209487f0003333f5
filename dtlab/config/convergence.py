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

Their options are three groups of RunConfig (flat names in dtlab.config.options): `evaluation` (EvaluationConfig:
every, samples), `lr_schedule` (LrScheduleConfig: scaling, base_batch, warmup_steps) and `sync` (SyncConfig:
local_sgd, max_staleness, staleness_policy: when replicas synchronise, if not every step).

Pure: the ranks build their schedule from `lr_factor`, the model and the tests read the same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.config.options import label
from dtlab.config.strategies import strategy_spec
from dtlab.config.validate import choice, int_at_least

LR_SCALINGS = ("none", "linear", "sqrt")
STALENESS_POLICIES = ("drop", "wait")
DEFAULT_MAX_STALENESS = 2


@dataclass(kw_only=True)
class EvaluationConfig:
    """Held-out evaluation between steps (`RunConfig.evaluation`; flat names eval_every, eval_samples)."""

    every: int = 0
    """Held-out accuracy every N optimizer steps, before step 0 and after the last (0: off): on rank 0 (the
    server for 'async') between steps, outside the timed step, its time recorded apart (run.evals); see
    dtlab.config.convergence."""
    samples: int | None = None
    """Held-out sentences per evaluation (None: all 872, except full DistilBERT on a CPU: 64, recorded)."""

    def validate(self) -> None:
        int_at_least(label("evaluation", "every"), self.every, 0)
        if self.samples is not None:
            int_at_least(label("evaluation", "samples"), self.samples, 1)


@dataclass(kw_only=True)
class LrScheduleConfig:
    """The learning-rate rule on top of `lr` (`RunConfig.lr_schedule`; flat names lr_scaling, base_batch,
    warmup_steps): read by the ranks' optimizer (dtlab.rank.optim) through `lr_at`."""

    scaling: str = "none"
    """Scale lr with the batch: 'none', 'linear' (x k) or 'sqrt' (x sqrt(k)), k = samples per optimizer update
    / base_batch (Goyal et al. 2017)."""
    base_batch: int | None = None
    """The batch `lr` was tuned for, in samples per update (None: batch_size, one rank's batch)."""
    warmup_steps: int = 0
    """Learning-rate warmup: step s < warmup_steps uses lr x (s + 1) / warmup_steps (not `warmup`, which only
    leaves steps out of the medians)."""

    def validate(self) -> None:
        choice(label("lr_schedule", "scaling"), self.scaling, LR_SCALINGS)
        if self.base_batch is not None:
            int_at_least(label("lr_schedule", "base_batch"), self.base_batch, 1)
        int_at_least(label("lr_schedule", "warmup_steps"), self.warmup_steps, 0)


@dataclass(kw_only=True)
class SyncConfig:
    """When replicas synchronise, if not every step (`RunConfig.sync`; flat names local_sgd, max_staleness,
    staleness_policy): local SGD's averaging period and the asynchronous server's staleness bound."""

    local_sgd: int = 0
    """Local SGD: 0 off; H: no gradient all-reduce, each rank steps its own AdamW and the parameters are averaged
    after every H steps (1/H of the gradient bytes per step on average). Strategy 'ddp' only."""
    max_staleness: int = DEFAULT_MAX_STALENESS
    """Strategy 'async': the most server updates between a worker's pull and the update its gradient makes."""
    staleness_policy: str = "drop"
    """Strategy 'async': 'drop' (a staler gradient is not applied) or 'wait' (the server holds a worker's pull
    until its next gradient cannot be staler: stale-synchronous, nothing dropped)."""

    def validate(self) -> None:
        int_at_least(label("sync", "local_sgd"), self.local_sgd, 0)
        int_at_least(label("sync", "max_staleness"), self.max_staleness, 0)
        choice(label("sync", "staleness_policy"), self.staleness_policy, STALENESS_POLICIES)


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
    built (`settle_lr`), or None: as the config decides (`weights_known`), and a ValueError where
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
    return _update_batch(cfg, strategy_spec(cfg.strategy).asynchronous)


def _update_batch(cfg, asynchronous: bool) -> int:
    per_rank = cfg.batch_size * cfg.ddp.accumulate
    if asynchronous or cfg.sync.local_sgd:
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


def _base_batch(cfg) -> int:
    return cfg.lr_schedule.base_batch if cfg.lr_schedule.base_batch is not None else cfg.batch_size


def peak_lr(cfg) -> float:
    """The base rate (`base_lr`: `cfg.lr` or its default) scaled by `cfg.lr_schedule.scaling` for this run's update
    batch over `cfg.lr_schedule.base_batch` (None: batch_size)."""
    return base_lr(cfg) * lr_multiplier(cfg.lr_schedule.scaling, update_batch(cfg) / _base_batch(cfg))


def lr_at(cfg, step: int) -> float:
    """The learning rate optimizer step `step` of this run uses (the scaling rule and the warmup)."""
    return peak_lr(cfg) * warmup_factor(step, cfg.lr_schedule.warmup_steps)


def lr_rule_text(cfg) -> str:
    """The rule in words, with this run's numbers (recorded in config.json)."""
    return _rule_text(cfg.lr_schedule, base_lr(cfg), update_batch(cfg), _base_batch(cfg))


@dataclass(frozen=True)
class LrPlan:
    """A rank's learning rate, settled once its model is built (`lr_plan`): the base rate and where it came from,
    the peak its optimizer starts from (the base scaled by the rule), the warmup and the rule in words."""

    value: float
    source: str
    peak: float
    warmup_steps: int
    rule: str

    def factor(self, step: int) -> float:
        """The fraction of `peak` optimizer step `step` uses (`warmup_factor`): what torch's LambdaLR asks."""
        return warmup_factor(step, self.warmup_steps)


def lr_plan(cfg, pretrained: bool | None, asynchronous: bool) -> LrPlan:
    """The run's learning rate for weights that are `pretrained` or not (`resolve_lr`), scaled (`peak_lr`) and
    warmed up as `cfg.lr_schedule` says: every number the rank's optimizer and config.json need, at once.
    `asynchronous`: the strategy's spec says so (one update per worker's gradient, `update_batch`)."""
    rec = resolve_lr(cfg, pretrained)
    batch, base = _update_batch(cfg, asynchronous), _base_batch(cfg)
    peak = rec["value"] * lr_multiplier(cfg.lr_schedule.scaling, batch / base)
    rule = _rule_text(cfg.lr_schedule, rec["value"], batch, base)
    return LrPlan(rec["value"], rec["source"], peak, cfg.lr_schedule.warmup_steps, rule)


def settle_lr(cfg, pretrained: bool | None, asynchronous: bool) -> LrPlan:
    """A rank's `lr_plan` once its model is built (weights `pretrained` or not; `asynchronous`: the strategy's spec
    says so), with `cfg.lr` set on the rank's config to the base rate, as validate() does for the other auto fields,
    so the reference reads the rate the run trains at. Every optimizer of the rank is built from the plan."""
    plan = lr_plan(cfg, pretrained, asynchronous)
    cfg.lr = plan.value
    return plan


def _rule_text(sched, base_value: float, batch: int, base: int) -> str:
    k = batch / base
    peak = base_value * lr_multiplier(sched.scaling, k)
    text = (
        f"lr {base_value:g} x {lr_multiplier(sched.scaling, k):.4g} ({sched.scaling}, k = update batch "
        f"{batch} / base batch {base} = {k:.4g}) = {peak:.4g}"
    )
    if sched.warmup_steps:
        n = sched.warmup_steps
        text += f", warmed up linearly over {n} steps: step s uses (s + 1) / {n} of it"
    return text


def eval_due(steps_done: int, every: int, total: int) -> bool:
    """Whether a run evaluates after `steps_done` optimizer steps: before the first (0), every `every`, and
    after the last (`total`)."""
    return bool(every) and (steps_done == 0 or steps_done % every == 0 or steps_done == total)


def eval_steps(every: int, total: int) -> frozenset[int]:
    """Every count of optimizer steps after which a run evaluates (`eval_due`), for a run of `total` steps."""
    return frozenset(s for s in range(total + 1) if eval_due(s, every, total))


def eval_samples_for(cfg, device_type: str) -> int | None:
    """Held-out sentences one evaluation uses: cfg.evaluation.samples, or None (all) except full DistilBERT on a CPU
    (CPU_DISTILBERT_EVAL_SAMPLES: a subset, which the run records)."""
    if cfg.evaluation.samples is not None:
        return cfg.evaluation.samples
    if device_type == "cpu" and cfg.model == "distilbert":
        return CPU_DISTILBERT_EVAL_SAMPLES
    return None
