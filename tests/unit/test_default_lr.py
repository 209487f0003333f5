"""The default learning rate: an explicit `lr` wins; otherwise pretrained weights take the fine-tuning rate and random
weights the model's own rate, settled by the rank once the model is built, recorded in config.json and printed."""

import json

import pytest

import dtlab
from dtlab.config.convergence import (
    FINE_TUNING_LR,
    RANDOM_INIT_LR,
    base_lr,
    default_lr,
    lr_at,
    lr_rule_text,
    peak_lr,
    resolve_lr,
)
from dtlab.results.run import load_run


def test_an_explicit_lr_wins_whatever_the_weights():
    for model in ("tiny", "distilbert"):
        cfg = dtlab.RunConfig(model=model, lr=3e-4)
        for pretrained in (True, False, None):
            rec = resolve_lr(cfg, pretrained)
            assert rec["value"] == 3e-4 and "explicit" in rec["source"], (model, pretrained)


def test_pretrained_weights_take_the_fine_tuning_rate():
    assert FINE_TUNING_LR == 2e-5
    for model in ("tiny", "distilbert"):
        rec = resolve_lr(dtlab.RunConfig(model=model), pretrained=True)
        assert rec["value"] == 2e-5 and "pretrained" in rec["source"]


def test_random_weights_take_a_rate_that_trains_the_model():
    tiny = resolve_lr(dtlab.RunConfig(model="tiny"), pretrained=False)
    assert tiny["value"] == RANDOM_INIT_LR["tiny"][0] == 1e-3
    assert "randomly initialised tiny" in tiny["source"] and "measured" in tiny["source"]
    bert = resolve_lr(dtlab.RunConfig(model="distilbert"), pretrained=False)
    assert bert["value"] == RANDOM_INIT_LR["distilbert"][0] == 1e-4
    assert "randomly initialised distilbert" in bert["source"] and "Devlin et al. 2019" in bert["source"]
    assert "checked on one H200" in bert["source"] and "not measured on a CPU" in bert["source"]
    # never the fine-tuning rate: a random-init tiny run at 2e-5 stays at the majority class for 200 steps
    assert min(v for v, _ in RANDOM_INIT_LR.values()) > FINE_TUNING_LR
    with pytest.raises(ValueError, match="model must be one of"):
        default_lr("gpt2", pretrained=False)


def test_before_the_run_the_config_decides_where_it_can():
    assert base_lr(dtlab.tiny()) == RANDOM_INIT_LR["tiny"][0]  # tiny: always random
    assert base_lr(dtlab.RunConfig(model_source="random")) == RANDOM_INIT_LR["distilbert"][0]
    assert base_lr(dtlab.RunConfig(model_source="hub")) == FINE_TUNING_LR  # loads or fails
    with pytest.raises(ValueError, match=r"lr is None \(auto\) with model_source 'auto'"):  # the rank decides
        base_lr(dtlab.RunConfig())


def test_scaling_and_warmup_apply_on_top_of_the_resolved_rate():
    cfg = dtlab.tiny(batch_size=8, nproc=2, accumulate=2, lr_scaling="linear", warmup_steps=2)
    base = RANDOM_INIT_LR["tiny"][0]
    assert peak_lr(cfg) == pytest.approx(base * 4)  # k = 32 / 8
    assert [lr_at(cfg, s) for s in range(3)] == pytest.approx([base * 2, base * 4, base * 4])
    assert lr_rule_text(cfg).startswith(f"lr {base:g} x 4 (linear")
    explicit = cfg.replace(lr=5e-4)
    assert peak_lr(explicit) == pytest.approx(5e-4 * 4)


def test_lr_is_auto_by_default_and_refused_by_name():
    assert dtlab.RunConfig().lr is None and dtlab.tiny().validate().lr is None
    for bad in ("auto", -1e-3, 0.0, float("nan")):
        with pytest.raises(ValueError, match=r"lr must be a finite number > 0 .*or None \(auto"):
            dtlab.tiny(lr=bad).validate()


def test_the_rank_settles_cfg_lr_before_its_optimizer_exists():
    import torch

    from dtlab.config.convergence import settle_lr
    from dtlab.rank.optim import Optimizer

    cfg = dtlab.tiny(model="distilbert", model_source="auto")
    plan = settle_lr(cfg, pretrained=True, asynchronous=False)
    assert cfg.lr == FINE_TUNING_LR and {"value": plan.value, "source": plan.source} == default_lr("distilbert", True)
    cfg = dtlab.tiny(model="distilbert", model_source="auto")
    plan = settle_lr(cfg, pretrained=False, asynchronous=False)
    assert plan.value == cfg.lr == RANDOM_INIT_LR["distilbert"][0]
    assert plan.peak == lr_at(cfg, plan.warmup_steps) and plan.rule == lr_rule_text(cfg)  # the rule's own numbers
    opt = Optimizer(plan, [torch.nn.Parameter(torch.zeros(2))])
    assert opt.lr == RANDOM_INIT_LR["distilbert"][0]
    cfg = dtlab.tiny(lr=7e-4, lr_scaling="linear", warmup_steps=3)
    plan = settle_lr(cfg, pretrained=True, asynchronous=False)
    assert plan.value == cfg.lr == 7e-4 and plan.peak == lr_at(cfg, 3) == 7e-4 * 2 and plan.rule == lr_rule_text(cfg)
    opt = Optimizer(plan, [torch.nn.Parameter(torch.zeros(2))])
    assert opt.lr == pytest.approx(7e-4 * 2 / 3)  # the first of 3 warmup steps


def _run_dir(tmp_path, resolved_lr, config_lr=None):
    steps = [
        {"kind": "step", "rank": 0, "step": s, "t_fwd": 0.01, "t_bwd": 0.02, "t_opt": 0.01, "t_step": 0.04, "loss": 0.7}
        for s in range(3)
    ]
    resolved = {"world_size": 1, "model_source": "tiny DistilBERT (2 layers, dim 32), random init"}
    if resolved_lr is not None:
        resolved["lr"] = resolved_lr
    (tmp_path / "events").mkdir(parents=True)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "config": {"strategy": "ddp", "nproc": 1, "warmup": 1, "bucket_mb": 25, "lr": config_lr},
                "resolved": resolved,
            }
        )
    )
    (tmp_path / "status.json").write_text(json.dumps({"state": "finished"}))
    (tmp_path / "events" / "rank0.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in steps + [{"kind": "done", "rank": 0}])
    )
    return str(tmp_path)


def test_the_run_reads_and_prints_the_rate_it_trained_at(tmp_path):
    rec = default_lr("tiny", pretrained=False)
    run = load_run(_run_dir(tmp_path / "new", rec))
    assert run.config.lr is None and run.lr == RANDOM_INIT_LR["tiny"][0]
    assert f"  lr:    {RANDOM_INIT_LR['tiny'][0]:g}, {rec['source']}" in run.breakdown_table().splitlines()
    old = load_run(_run_dir(tmp_path / "old", None, config_lr=2e-5))  # recorded before the rank resolved lr
    assert old.lr == 2e-5 and "  lr:" not in old.breakdown_table()


def test_loss_beside_compares_the_rates_the_runs_trained_at(tmp_path):
    from dtlab.model.compression import loss_beside

    default = load_run(_run_dir(tmp_path / "default", default_lr("tiny", pretrained=False)))
    other = load_run(_run_dir(tmp_path / "other", {"value": 3e-3, "source": "set explicitly"}, config_lr=3e-3))
    with pytest.raises(ValueError, match=r"lr \(0.001 vs 0.003\)"):
        loss_beside(default, other)
    same = load_run(_run_dir(tmp_path / "same", {"value": 1e-3, "source": "set explicitly"}, config_lr=1e-3))
    assert list(loss_beside(default, same)["step"]) == [0, 1, 2]  # the default's rate, given explicitly
