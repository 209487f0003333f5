"""RunConfig's option groups: flat names mapped in one table, each group validated by its owner, the nested form
written with its config_version, and runs recorded before the groups read through dtlab.results.upgrade."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

import dtlab
from dtlab.config.baseline import run_order
from dtlab.config.compression import CompressionConfig
from dtlab.config.convergence import EvaluationConfig, LrScheduleConfig, SyncConfig
from dtlab.config.options import FLAT, nest
from dtlab.config.parallel import ParallelConfig
from dtlab.config.restarts import RestartsConfig
from dtlab.config.run import CONFIG_VERSION, GROUPS, RunConfig, tiny
from dtlab.results.upgrade import STEPS, option_groups, recorded_version, upgrade, upgrade_event

#: a run recorded by dtlab before the option groups (config version 1): `dtlab run --model tiny` with flat options
OLD_RUN = Path(__file__).parent.parent / "fixtures" / "run-v1-ddp"
OLD_PP_RUN = Path(__file__).parent.parent / "fixtures" / "run-v1-pp"


def test_every_flat_name_names_a_field_of_its_group():
    for flat, (group, field) in FLAT.items():
        assert group in GROUPS, flat
        assert field in {f.name for f in dataclasses.fields(GROUPS[group])}, flat
        assert flat not in {f.name for f in dataclasses.fields(RunConfig)}, f"{flat} is both flat and a field"


def test_flat_keywords_land_in_their_groups():
    cfg = RunConfig(microbatches=4, pp_schedule="1f1b", comm_hook="fp16", eval_every=5, local_sgd=2)
    assert cfg.parallel == ParallelConfig(microbatches=4, schedule="1f1b")
    assert cfg.compression == CompressionConfig(hook="fp16")
    assert cfg.evaluation == EvaluationConfig(every=5)
    assert cfg.sync == SyncConfig(local_sgd=2)
    assert cfg.lr_schedule == LrScheduleConfig() and cfg.restarts == RestartsConfig()
    assert tiny(checkpoint_every=2).restarts.checkpoint_every == 2
    assert RunConfig.from_dict({"max_restarts": 1, "lr_scaling": "sqrt"}).lr_schedule.scaling == "sqrt"


def test_replace_with_a_flat_name_changes_a_copy():
    base = tiny(microbatches=2)
    changed = base.replace(pp_schedule="1f1b", max_staleness=0)
    assert (changed.parallel.microbatches, changed.parallel.schedule, changed.sync.max_staleness) == (2, "1f1b", 0)
    assert base.parallel.schedule == "gpipe" and base.sync.max_staleness == 2
    assert changed.parallel is not base.parallel


def test_an_option_given_twice_or_unknown_is_refused_by_name():
    with pytest.raises(ValueError, match="microbatches is given twice"):
        RunConfig(microbatches=4, parallel={"microbatches": 2})
    with pytest.raises(ValueError, match=r"unknown parallel field\(s\): bogus"):
        RunConfig(parallel={"bogus": 1})
    with pytest.raises(ValueError, match="unknown RunConfig field"):
        RunConfig.from_dict({"bogus": 1})
    assert nest({"steps": 3}) == {"steps": 3}


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            {"strategy": "pp", "pp_schedule": "zigzag"},
            r"parallel.schedule \(pp_schedule\) must be one of 'gpipe', '1f1b'",
        ),
        ({"microbatches": 0}, r"parallel.microbatches must be an integer >= 1"),
        ({"comm_hook": "int8"}, r"compression.hook \(comm_hook\) must be one of 'none', 'fp16'"),
        ({"powersgd_start_iter": 1}, r"compression.powersgd_start_iter must be an integer >= 2"),
        ({"checkpoint_every": -1}, r"restarts.checkpoint_every must be an integer >= 0"),
        ({"eval_samples": 0}, r"evaluation.samples \(eval_samples\) must be an integer >= 1"),
        ({"lr_scaling": "cubic"}, r"lr_schedule.scaling \(lr_scaling\) must be one of 'none', 'linear', 'sqrt'"),
        ({"staleness_policy": "later"}, r"sync.staleness_policy must be one of 'drop', 'wait'"),
        ({"strategy": "zero3", "microbatches": 2}, r"microbatches 2 applies to strategy 'pp' only"),
        ({"strategy": "pp", "comm_hook": "fp16"}, r"comm_hook 'fp16' applies to strategy 'ddp' only"),
    ],
)
def test_each_group_is_validated_by_its_owner_naming_the_option(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw).validate(cuda_device_count=0)


def test_to_dict_is_nested_with_its_version_and_round_trips():
    cfg = tiny(microbatches=2, strategy="pp", comm_hook="none", eval_samples=16)
    d = cfg.to_dict()
    assert d["config_version"] == CONFIG_VERSION == 5
    assert d["parallel"] == {"dp_degree": 1, "microbatches": 2, "schedule": "gpipe"}
    assert not set(FLAT) & set(d), "no flat option in the written form"
    assert RunConfig.from_dict(json.loads(json.dumps(d))) == cfg
    with pytest.raises(ValueError, match="config_version 1 is not this dtlab's"):
        RunConfig.from_dict({**d, "config_version": 1})


def test_the_cli_keeps_its_flat_flags():
    from dtlab.cli.flags import from_args
    from dtlab.cli.main import build_parser

    args = build_parser().parse_args(
        ["run", "--microbatches", "4", "--pp-schedule", "1f1b", "--comm-hook", "fp16", "--eval-every", "3"]
    )
    cfg = from_args(args, RunConfig)
    assert (cfg.parallel.microbatches, cfg.parallel.schedule) == (4, "1f1b")
    assert (cfg.compression.hook, cfg.evaluation.every) == ("fp16", 3)


# ---- runs recorded before: dtlab.results.upgrade ------------------------------------------------------------------


def test_one_step_per_version():
    assert len(STEPS) == CONFIG_VERSION - 1
    assert STEPS[0].name == "option_groups" and STEPS[0].config is option_groups


def test_a_version_1_config_upgrades_to_what_its_flat_options_build_today():
    flat = {"strategy": "pp", "nproc": 2, "microbatches": 4, "pp_schedule": "1f1b", "comm_hook": "none", "lr": 1e-3}
    assert upgrade(flat) == RunConfig.from_dict(flat).to_dict()
    assert upgrade(upgrade(flat)) == upgrade(flat)  # the current form is left as it is


def test_a_field_a_run_predates_takes_its_default():
    old = upgrade({"nproc": 2, "steps": 4})  # recorded before `strategy` and every lever existed
    assert old["strategy"] == "ddp" and old["compression"]["hook"] == "none"
    assert old["restarts"] == {"checkpoint_every": 0, "max_restarts": 0}


def test_a_newer_or_damaged_version_is_refused():
    assert recorded_version({}) == 1
    for v in (CONFIG_VERSION + 1, 0, "2", True):
        with pytest.raises(ValueError, match="config_version must be an integer from 1"):
            upgrade({"config_version": v})


def test_old_event_lines_are_upgraded():
    assert upgrade_event({"kind": "sample", "seconds": 1.0}, 1)["load"] == "idle"
    assert upgrade_event({"kind": "baseline_step", "step": 3}, 1)["paired_step"] is None
    assert upgrade_event({"kind": "memory", "optim_bytes": 8}, 2) == {"kind": "memory", "opt_bytes": 8}
    ev = {"kind": "sample", "seconds": 1.0}
    assert upgrade_event(ev, CONFIG_VERSION) is ev


@pytest.mark.parametrize("fixture", [OLD_RUN, OLD_PP_RUN], ids=["ddp", "pp"])
def test_the_fixtures_were_recorded_before_the_groups(fixture):
    cfg = json.loads((fixture / "config.json").read_text())["config"]
    assert "config_version" not in cfg and "microbatches" in cfg and "parallel" not in cfg


def test_a_run_recorded_before_the_groups_loads(tmp_path):
    path = shutil.copytree(OLD_RUN, tmp_path / "run")
    run = dtlab.load_run(str(path))
    assert run.status["state"] == "finished" and not run.warnings
    assert isinstance(run.config, RunConfig)  # the upgraded form is today's, read as the ranks read it
    doc = run.config.to_dict()
    assert doc["config_version"] == CONFIG_VERSION
    assert doc["compression"] == {"hook": "fp16", "powersgd_rank": 1, "powersgd_start_iter": 2}
    assert run.config.evaluation.every == 1
    assert doc["lr_schedule"] == {"scaling": "sqrt", "base_batch": 8, "warmup_steps": 1}
    assert run.config.restarts.checkpoint_every == 2
    flat = json.loads((OLD_RUN / "config.json").read_text())["config"]  # version 1: every option at the top
    assert run.config.ddp.bucket_mb == flat["bucket_mb"]
    assert run.config.measurement.baseline_steps == flat["baseline_steps"]
    assert run.config.stragglers.slow == flat["straggler"] and run.config.checks.reference is False
    assert not set(FLAT) & set(doc)
    assert run.config.compression.hook == "fp16" and run.config.lr_schedule.warmup_steps == 1
    assert len(run.steps) and len(run.evals)
    assert "opt_bytes" in run.memory and "optim_bytes" not in run.memory  # memory events renamed at version 3
    extra = run.memory["opt_bytes"] - 2 * run.memory["params_bytes"]  # AdamW's two moments and a step per tensor
    assert ((extra > 0) & (extra < 1000)).all()
    assert run.breakdown_table().startswith("run ")


def test_a_pipeline_recorded_before_the_groups_reads_its_microbatches(tmp_path):
    path = shutil.copytree(OLD_PP_RUN, tmp_path / "run")
    run = dtlab.load_run(str(path))
    assert dataclasses.asdict(run.config.parallel) == {"dp_degree": 1, "microbatches": 2, "schedule": "1f1b"}
    b = run.bubble()
    assert (b.microbatches, b.schedule) == (2, "1f1b")


def test_a_run_of_a_newer_dtlab_is_refused_as_damaged(tmp_path):
    from dtlab.runfiles import DamagedRun

    path = shutil.copytree(OLD_RUN, tmp_path / "run")
    doc = json.loads((path / "config.json").read_text())
    doc["config"]["config_version"] = CONFIG_VERSION + 1
    (path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(DamagedRun, match="config_version"):
        dtlab.load_run(str(path))


def test_repr_of_a_run_is_one_short_line(tmp_path):
    path = shutil.copytree(OLD_RUN, tmp_path / ("deep" * 60) / "run")
    run = dtlab.load_run(str(path))
    text = repr(run)
    assert len(text) < 400 and "\n" not in text
    assert text.startswith("Run('...") and text.endswith("strategy='ddp', ranks=2, state='finished')")
    short = dtlab.load_run(str(shutil.copytree(OLD_RUN, tmp_path / "r")))
    assert repr(short) == f"Run({os.path.join(str(tmp_path), 'r')!r}, strategy='ddp', ranks=2, state='finished')"


def test_version_3_moves_ddps_options_the_straggler_and_the_reference_into_their_groups():
    v3 = {"config_version": 3, "strategy": "ddp", "bucket_mb": 5.0, "accumulate": 2, "baseline_steps": 3}
    v3 |= {"profile": True, "straggler": "1:2.0", "reference": False, "parallel": {"microbatches": 1}}
    up = upgrade(v3)
    assert up["ddp"] == {"bucket_mb": 5.0, "accumulate": 2}
    assert up["measurement"] == {"baseline_steps": 3, "profile": True}
    assert up["stragglers"] == {"slow": "1:2.0"} and up["checks"] == {"reference": False}
    assert not {"bucket_mb", "accumulate", "baseline_steps", "profile", "straggler", "reference"} & set(up)
    cfg = RunConfig.from_dict(up)
    assert (cfg.ddp.bucket_mb, cfg.ddp.accumulate, cfg.stragglers.slow) == (5.0, 2, "1:2.0")


#: a tiny DDP run's config as dtlab recorded it at version 4: the baseline steps and the profiler in DDP's group
V4_CONFIG = {
    "config_version": 4,
    **{"strategy": "ddp", "model": "tiny", "nproc": 2, "steps": 6, "warmup": 1, "batch_size": 4, "seq_len": 32},
    **{"model_source": "random", "data": "offline", "device": "cpu"},
    "ddp": {"bucket_mb": 1.0, "accumulate": 1, "baseline_steps": 4, "profile": True},
    "stragglers": {"slow": None},
    "checks": {"reference": False},
}


def test_a_version_4_config_loads_with_its_baseline_and_profiler_in_the_measurement_group():
    up = upgrade(V4_CONFIG)
    assert up["config_version"] == CONFIG_VERSION
    assert up["ddp"] == {"bucket_mb": 1.0, "accumulate": 1}
    assert up["measurement"] == {"baseline_steps": 4, "profile": True}
    cfg = RunConfig.from_dict(up).validate(cuda_device_count=0)
    # it means what it meant: the same run as today's flat spelling of the same options, the same run order
    flat = {k: v for k, v in V4_CONFIG.items() if k not in ("config_version", "ddp", "stragglers", "checks")}
    today = RunConfig.from_dict({**flat, "bucket_mb": 1.0, "baseline_steps": 4, "profile": True})
    assert cfg == today.validate(cuda_device_count=0)
    assert run_order(cfg.steps, cfg.warmup, cfg.measurement.baseline_steps) == run_order(6, 1, 4)
    assert upgrade(up) == up  # the current form is left as it is


def test_a_run_recorded_at_version_4_loads(tmp_path):
    path = shutil.copytree(OLD_RUN, tmp_path / "run")
    doc = json.loads((path / "config.json").read_text())
    flat = doc["config"]
    doc["config"] = {**upgrade(flat), "config_version": 4}  # the same run, written as version 4 wrote it
    doc["config"]["ddp"] = {**doc["config"]["ddp"], **doc["config"].pop("measurement")}
    (path / "config.json").write_text(json.dumps(doc))
    run = dtlab.load_run(str(path))
    assert run.status["state"] == "finished" and not run.warnings
    assert run.config.measurement.baseline_steps == flat["baseline_steps"] and len(run.baseline_steps)
    assert run.config.to_dict() == upgrade(flat)


def test_the_shipped_gpu_runs_load_in_todays_form():
    run = dtlab.recorded_run("h200-ddp").run
    assert run.config.ddp.bucket_mb == 25 and run.config.measurement.baseline_steps == 3
    assert run.config.stragglers.slow is None
