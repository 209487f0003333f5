"""Where each run option lives: the one table of flat option names and the groups they belong to. Pure.

Options every run reads are `RunConfig`'s own fields (strategy, nproc, device, steps, batch_size, lr, ...). An
option that one strategy or lever reads lives in a group: a small dataclass, validated by the module that owns the
lever, and read as `cfg.GROUP.FIELD` (`cfg.parallel.microbatches`):

| group         | class              | validated in                | read by (rank side)                           |
| ------------- | ------------------ | --------------------------- | --------------------------------------------- |
| `ddp`         | DDPConfig          | dtlab.config.ddp            | strategies 'ddp', 'ps', local SGD             |
| `measurement` | MeasurementConfig  | dtlab.config.measurement    | the loop (rank.loop), rank.profiling          |
| `stragglers`  | StragglersConfig   | dtlab.config.stragglers     | rank.strategies.bases (Straggler)             |
| `checks`      | ChecksConfig       | dtlab.config.parallel       | strategies.bases, rank.reference              |
| `parallel`    | ParallelConfig     | dtlab.config.parallel       | strategies 'tp' and 'pp', strategies.bases    |
| `compression` | CompressionConfig  | dtlab.config.compression    | strategy 'ddp', rank.compression              |
| `restarts`    | RestartsConfig     | dtlab.config.restarts       | rank.restarts, the launcher (torchrun)        |
| `evaluation`  | EvaluationConfig   | dtlab.config.convergence    | rank.evaluation                               |
| `lr_schedule` | LrScheduleConfig   | dtlab.config.convergence    | rank.optim                                    |
| `sync`        | SyncConfig         | dtlab.config.convergence    | rank.local_sgd, strategy 'async'              |
| `zero`        | ZeroConfig         | dtlab.config.run            | strategy 'zero3'                              |

`FLAT` maps the flat names that every entry point keeps accepting (`RunConfig(microbatches=4)`,
`cfg.replace(comm_hook="fp16")`, `tiny(...)`, `lab_config(...)`, the `dtlab run --microbatches` flags) to their
(group, field); `nest` applies it. It is the only place that knows both spellings.
"""

from __future__ import annotations

import dataclasses

#: flat option name -> (group, field in the group)
FLAT: dict[str, tuple[str, str]] = {
    "bucket_mb": ("ddp", "bucket_mb"),
    "accumulate": ("ddp", "accumulate"),
    "baseline_steps": ("measurement", "baseline_steps"),
    "profile": ("measurement", "profile"),
    "straggler": ("stragglers", "slow"),
    "reference": ("checks", "reference"),
    "dp_degree": ("parallel", "dp_degree"),
    "microbatches": ("parallel", "microbatches"),
    "pp_schedule": ("parallel", "schedule"),
    "comm_hook": ("compression", "hook"),
    "powersgd_rank": ("compression", "powersgd_rank"),
    "powersgd_start_iter": ("compression", "powersgd_start_iter"),
    "checkpoint_every": ("restarts", "checkpoint_every"),
    "max_restarts": ("restarts", "max_restarts"),
    "eval_every": ("evaluation", "every"),
    "eval_samples": ("evaluation", "samples"),
    "lr_scaling": ("lr_schedule", "scaling"),
    "base_batch": ("lr_schedule", "base_batch"),
    "warmup_steps": ("lr_schedule", "warmup_steps"),
    "local_sgd": ("sync", "local_sgd"),
    "max_staleness": ("sync", "max_staleness"),
    "staleness_policy": ("sync", "staleness_policy"),
}
#: (group, field) -> flat name
FLAT_NAME = {where: flat for flat, where in FLAT.items()}


def label(group: str, field: str) -> str:
    """How errors name an option: 'parallel.schedule (pp_schedule)', 'restarts.max_restarts'."""
    flat = FLAT_NAME.get((group, field))
    dotted = f"{group}.{field}"
    return dotted if flat in (None, field) else f"{dotted} ({flat})"


def nest(values: dict) -> dict:
    """`values` (keyword arguments of a RunConfig) with every flat name of `FLAT` moved into its group:
    {"microbatches": 4} -> {"parallel": {"microbatches": 4}}. A group given as a dataclass gets a changed copy (what
    `cfg.replace(comm_hook="fp16")` needs); an option given both flat and in its group's dict is refused by name."""
    out = {k: v for k, v in values.items() if k not in FLAT}
    for flat, (group, field) in FLAT.items():
        if flat not in values:
            continue
        given = out.get(group)
        if given is None:
            out[group] = {field: values[flat]}
        elif dataclasses.is_dataclass(given) and not isinstance(given, type):
            out[group] = dataclasses.replace(given, **{field: values[flat]})
        elif isinstance(given, dict):
            if field in given:
                raise ValueError(f"{flat} is given twice: as {flat}= and as {group}[{field!r}]; give it once")
            out[group] = {**given, field: values[flat]}
        else:
            raise ValueError(f"{group} must be a dict of its fields or its dataclass, got {type(given).__name__}")
    return out
