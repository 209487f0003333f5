"""Records made by an earlier dtlab, brought to the current form: the one place that knows the old forms. Pure.

Every reader of a run directory goes through dtlab.results.status.read_run_dir, which passes config.json's config
through `upgrade` and every event line through `upgrade_event`; past that point readers read only the current form
(a `Run`'s `config` is today's nested dict with every field).

A run's config records its form as `config_version` (dtlab.config.run.CONFIG_VERSION). A config without one is
version 1: everything recorded before the option groups. `upgrade` runs one step per version, each named by what
changed, then gives every field the record predates its default (an option a run predates was off: no
compression, no restarts, no evaluation, strategy 'ddp', the only strategy before the field existed).

Each step (`Step`) is named by what changed and takes the config and the event lines of one version to the next:

- 1 -> 2, `option_groups`: the options one strategy or lever reads moved from RunConfig's top level into its groups
  (`microbatches` -> `parallel.microbatches`, `pp_schedule` -> `parallel.schedule`, `comm_hook` ->
  `compression.hook`, ...). `OPTION_GROUPS_V2` is that move as version 2 made it; dtlab.config.options.FLAT, the
  flat names every entry point accepts, equals it today but is free to grow, and a later version that moves an
  option again adds its own step after this one. Its event lines (`fields_before_groups`): a calibration `sample`
  without `load` was taken idle (sweeps recorded before loaded calibration); a `baseline_step` without
  `paired_step` is unpaired (runs recorded before the baseline steps were interleaved).

- 2 -> 3, `opt_bytes`: a memory event's optimizer-state bytes are named `opt_bytes` (they were `optim_bytes`), one
  name beside the steps' `t_opt`; the config itself did not change.

- 3 -> 4, `ddp_groups`: the options only DDP's loop reads (`bucket_mb`, `accumulate`, `baseline_steps`, `profile`)
  moved into `ddp`, the straggler rule (`straggler`) into `stragglers.slow`, the reference check (`reference`)
  into `checks.reference` (`DDP_GROUPS_V4`); the events did not change.

- 4 -> 5, `measurement_group`: what the one training loop measures beside training for every strategy
  (`ddp.baseline_steps`, `ddp.profile`) moved out of DDP's group into `measurement` (`MEASUREMENT_V5`); the values
  and the events did not change.

A calibration's config carries no version: its events are read as version 1's, which changes nothing in a sweep
that recorded `load`.

A finished run's columnar copy (dtlab.results.columns) holds frames in the current form, built from the upgraded
lines: it records `COLUMNS_VERSION` (the copy's own layout) and the CONFIG_VERSION it was built at, and a copy of
another version is rebuilt from the lines, which stay the record of truth; nothing upgrades a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dtlab.config.run import CONFIG_VERSION, RunConfig

#: the layout of a run's columnar copy (dtlab.results.columns): one Arrow file per frame and an index
COLUMNS_VERSION = 1

#: what version 2 moved: flat name -> (group, field). The same pairs as dtlab.config.options.FLAT today, kept as
#: their own copy on purpose: an upgrade step is a record of one past change, and must not move when FLAT gains an
#: option a later version groups (that version gets a step of its own)
OPTION_GROUPS_V2 = {
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


def _into_groups(config: dict, moved: dict) -> dict:
    """`config` with each flat option of `moved` (flat name -> (group, field)) moved into its group."""
    out = {k: v for k, v in config.items() if k not in moved}
    for flat, (group, field) in moved.items():
        if flat in config:
            out[group] = {**out.get(group, {}), field: config[flat]}
    return out


def option_groups(config: dict) -> dict:
    """Version 1 -> 2 of a config: each flat option of `OPTION_GROUPS_V2` moved into its group."""
    return _into_groups(config, OPTION_GROUPS_V2)


def fields_before_groups(ev: dict) -> dict:
    """Version 1 -> 2 of an event line: what lines recorded before it may lack, filled in."""
    kind = ev.get("kind")
    if kind == "sample" and "load" not in ev:
        return {**ev, "load": "idle"}
    if kind == "baseline_step" and "paired_step" not in ev:
        return {**ev, "paired_step": None}
    return ev


def _same(d: dict) -> dict:
    return d


@dataclass(frozen=True)
class Step:
    """What one version changed, named: how a config of the version before becomes this one's, and an event line."""

    name: str
    config: Callable[[dict], dict] = _same
    event: Callable[[dict], dict] = _same


def opt_bytes(ev: dict) -> dict:
    """Version 2 -> 3 of an event line: a memory record's optimizer-state bytes are `opt_bytes` (were `optim_bytes`)."""
    if ev.get("kind") == "memory" and "optim_bytes" in ev:
        ev = dict(ev)
        ev["opt_bytes"] = ev.pop("optim_bytes")
    return ev


#: what version 4 moved, as it moved it: flat name -> (group, field); like OPTION_GROUPS_V2, a record of one past
#: change, kept apart from dtlab.config.options.FLAT on purpose
DDP_GROUPS_V4 = {
    "bucket_mb": ("ddp", "bucket_mb"),
    "accumulate": ("ddp", "accumulate"),
    "baseline_steps": ("ddp", "baseline_steps"),
    "profile": ("ddp", "profile"),
    "straggler": ("stragglers", "slow"),
    "reference": ("checks", "reference"),
}


def ddp_groups(config: dict) -> dict:
    """Version 3 -> 4 of a config: DDP's own options, the straggler rule and the reference check moved into their
    groups (`ddp`, `stragglers`, `checks`)."""
    return _into_groups(config, DDP_GROUPS_V4)


#: what version 5 moved, as it moved it: field of `ddp` -> field of `measurement`
MEASUREMENT_V5 = {"baseline_steps": "baseline_steps", "profile": "profile"}


def measurement_group(config: dict) -> dict:
    """Version 4 -> 5 of a config: the loop's baseline steps and profiler moved from `ddp` into `measurement`."""
    ddp = config.get("ddp")
    if not isinstance(ddp, dict) or not set(MEASUREMENT_V5) & set(ddp):
        return config
    moved = {new: ddp[old] for old, new in MEASUREMENT_V5.items() if old in ddp}
    out = dict(config)
    out["ddp"] = {k: v for k, v in ddp.items() if k not in MEASUREMENT_V5}
    out["measurement"] = {**out.get("measurement", {}), **moved}
    return out


#: STEPS[v - 1] takes a record of version v to version v + 1
STEPS = (
    Step("option_groups", config=option_groups, event=fields_before_groups),
    Step("opt_bytes", event=opt_bytes),
    Step("ddp_groups", config=ddp_groups),
    Step("measurement_group", config=measurement_group),
)


def recorded_version(config: dict) -> int:
    """The form a recorded config is in: its `config_version`, 1 without one. ValueError for a version that is not
    an integer from 1 to this dtlab's CONFIG_VERSION (a record written by a newer dtlab)."""
    v = config.get("config_version", 1)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= CONFIG_VERSION:
        raise ValueError(
            f"config_version must be an integer from 1 to {CONFIG_VERSION} (this dtlab's), got {v!r}: "
            "a record written by a newer dtlab, or a damaged one"
        )
    return v


def upgrade(config: dict) -> dict:
    """A run's recorded config (config.json's "config", any version) in the current form: every step from its
    version on, then every field it predates at its default; `config_version` is CONFIG_VERSION."""
    version = recorded_version(config)
    out = {k: v for k, v in config.items() if k != "config_version"}
    for step in STEPS[version - 1 :]:
        out = step.config(out)
    return {"config_version": CONFIG_VERSION, **_complete(out, RunConfig().to_dict())}


def _complete(config: dict, defaults: dict) -> dict:
    out = dict(config)
    for k, d in defaults.items():
        if k == "config_version":
            continue
        if k not in out:
            out[k] = d
        elif isinstance(d, dict) and isinstance(out[k], dict):
            out[k] = {**d, **out[k]}
    return out


def upgrade_doc(doc: dict, key: str = "config") -> tuple[dict, int]:
    """(config.json's document with its `key` object in the current form, the version it was recorded in). Only
    training runs ('config') have versions; a calibration ('calibration') is returned as it is, as version 1."""
    if key != "config":
        return doc, 1
    return {**doc, "config": upgrade(doc["config"])}, recorded_version(doc["config"])


def upgrade_event(ev: dict, version: int) -> dict:
    """One event line of a record of `version`, in the current form (the same dict when nothing changes)."""
    for step in STEPS[version - 1 :]:
        ev = step.event(ev)
    return ev
