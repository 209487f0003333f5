"""The convergence levers' pure parts: the learning-rate rule, the held-out split, the asynchronous server's
staleness bookkeeping, the time-to-accuracy composition, the config's refusals and the results' readers."""

import json
import math
import random
import re

import pytest

import dtlab
from dtlab.config.convergence import (
    eval_due,
    eval_steps,
    lr_at,
    lr_multiplier,
    lr_plan,
    lr_rule_text,
    peak_lr,
    update_batch,
    warmup_factor,
)
from dtlab.config.strategies import strategy_spec
from dtlab.model import costmodel
from dtlab.model.convergence import Lever, crossover_bandwidth, first_to_target, step_time, time_to_target
from dtlab.model.link import Link, TwoLevelLink
from dtlab.rank.staleness import Book

# ---- the learning-rate rule -------------------------------------------------------------------------------------


def test_lr_scaling_rules_and_warmup_by_hand():
    assert lr_multiplier("none", 4) == 1.0 and lr_multiplier("linear", 4) == 4.0 and lr_multiplier("sqrt", 4) == 2.0
    assert [warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0
    with pytest.raises(ValueError, match="lr_scaling"):
        lr_multiplier("cube", 2)


def test_update_batch_is_what_one_optimizer_update_sees():
    ddp = dtlab.tiny(batch_size=8, nproc=2, accumulate=2, lr=1e-3, lr_scaling="linear")
    assert update_batch(ddp) == 32 and peak_lr(ddp) == pytest.approx(4e-3)  # k = 32 / 8
    assert update_batch(ddp.replace(local_sgd=4, accumulate=1)) == 8  # each rank its own update
    assert update_batch(dtlab.tiny(strategy="async", nproc=3, batch_size=8)) == 8  # one worker's gradient
    sq = ddp.replace(lr_scaling="sqrt", base_batch=2)
    assert peak_lr(sq) == pytest.approx(1e-3 * 4.0)  # sqrt(32 / 2)
    warm = ddp.replace(warmup_steps=2)
    assert [lr_at(warm, s) for s in range(3)] == pytest.approx([2e-3, 4e-3, 4e-3])


def test_the_rank_optimizer_uses_the_lr_the_rule_claims():
    """dtlab.rank.optim builds torch's AdamW + LambdaLR; the lr of each optimizer step is lr_at's."""
    import torch

    from dtlab.rank.optim import Optimizer

    cfg = dtlab.tiny(batch_size=8, nproc=2, lr=1e-3, lr_scaling="sqrt", warmup_steps=3)
    plan = lr_plan(cfg, pretrained=None, asynchronous=False)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = Optimizer(plan, [p])
    seen = []
    for _ in range(5):
        seen.append(opt.lr)
        p.grad = torch.ones(2)
        opt.step()
    assert seen == pytest.approx([lr_at(cfg, s) for s in range(5)])
    assert seen[-1] == pytest.approx(1e-3 * math.sqrt(2))
    again = Optimizer(plan, [torch.nn.Parameter(torch.zeros(2))])
    again.resume_at(1)  # a resumed run continues the schedule
    assert again.lr == pytest.approx(lr_at(cfg, 1))


def test_evaluations_are_due_before_the_first_step_every_n_and_after_the_last():
    assert [s for s in range(12) if eval_due(s, 5, 11)] == [0, 5, 10, 11]
    assert not any(eval_due(s, 0, 11) for s in range(12))
    assert eval_steps(5, 11) == {0, 5, 10, 11} and eval_steps(0, 11) == set()  # what the evaluator holds once


@pytest.mark.parametrize("strategy", ["ddp", "async"])
def test_the_ranks_plan_from_the_specs_flag_is_the_configs_rule(strategy):
    """A rank settles its lr from the spec it was handed (its `asynchronous` flag), not by looking the strategy up:
    the same peak, schedule and words as the config's own rule, for a synchronous and an asynchronous run."""
    cfg = dtlab.tiny(strategy=strategy, nproc=3, batch_size=8, lr=1e-3, lr_scaling="linear", warmup_steps=2)
    plan = lr_plan(cfg, None, strategy_spec(strategy).asynchronous)
    assert plan.peak == pytest.approx(peak_lr(cfg)) and plan.rule == lr_rule_text(cfg)
    assert [plan.peak * plan.factor(s) for s in range(3)] == pytest.approx([lr_at(cfg, s) for s in range(3)])
    assert plan.peak == pytest.approx(1e-3 * (1 if strategy == "async" else 3))  # one worker's batch, or all three


# ---- the generated data -----------------------------------------------------------------------------------------


def _majority(sentence):
    """The label the generator's rule gives, recomputed from the text: the majority of the adjectives' polarity."""
    from dtlab.rank.data import _NEG, _POS

    words = sentence.split()
    pos, adjectives = sum(w in _POS for w in words), sum(w in _POS or w in _NEG for w in words)
    assert adjectives in (1, 3, 5)
    return int(2 * pos > adjectives)


def test_heldout_split_is_deterministic_distinct_clean_and_disjoint_from_training():
    from dtlab.rank.data import heldout_sentences, heldout_side, offline_sentences

    s, labels = heldout_sentences()
    assert (s, labels) == heldout_sentences() and len(s) == 872 == len(set(s))
    assert all(heldout_side(x) for x in s)
    assert labels == [_majority(x) for x in s]  # clean labels
    for seed in (0, 1, 12345):
        train, train_labels = offline_sentences(3000, seed)
        assert not set(train) & set(s)  # disjoint, any seed
        flipped = sum(y != _majority(x) for x, y in zip(train, train_labels)) / len(train)
        assert 0.07 < flipped < 0.13  # 10% label noise
    assert max(len(x.split()) for x in s + train) + 2 <= 32  # [CLS] .. [SEP] in seq_len 32


def test_heldout_goes_with_the_training_source():
    from dtlab.rank.data import OFFLINE_SOURCE, load_heldout, load_sentences

    s, _, src = load_sentences("offline", 10, seed=0)
    assert src == OFFLINE_SOURCE and "not SST-2" in src and "majority" in src
    hs, hl, hsrc = load_heldout(src, 100)
    assert len(hs) == 100 and "held-out" in hsrc and "first 100" in hsrc
    with pytest.raises(ValueError, match="no held-out split"):
        load_heldout("local file /x.csv (10 rows)")


def test_a_run_longer_than_the_generated_set_cycles_through_it_instead_of_generating_more(monkeypatch):
    """A 100,000-step run once generated and tokenised 1.6 million sentences before its first step (about 15 s):
    the generated set stops at SST-2's training size, the source says so, and a shorter request is its prefix."""
    from dtlab.rank import data

    monkeypatch.setattr(data, "OFFLINE_ROWS", 500)
    s, labels, src = data.load_sentences("offline", 1500, seed=4)
    assert len(s) == len(labels) == 500 and src.endswith(", 500 generated, cycled 3 times")
    short, _, short_src = data.load_sentences("offline", 200, seed=4)
    assert short == s[:200] and short_src == data.OFFLINE_SOURCE
    assert data.load_heldout(src, 10)[2].startswith("dtlab's held-out generated sentences")  # still offline's split


# ---- the asynchronous server's bookkeeping ----------------------------------------------------------------------


def test_drop_policy_takes_every_push_once_and_drops_only_stale_ones():
    b = Book(max_staleness=1, policy="drop")
    for w in (1, 2, 3):
        b.started(w)
    t1 = b.push(1, 0, 0)
    t2 = b.push(2, 0, 0)
    t3 = b.push(3, 0, 0)
    assert (t1.staleness, t1.applied, t1.version) == (0, True, 1)
    assert (t2.staleness, t2.applied, t2.version) == (1, True, 2)
    assert (t3.staleness, t3.applied, t3.version) == (2, False, 2)  # beyond the bound: dropped
    assert b.histogram() == {0: 1, 1: 1} and len(b.taken) == 3


def _simulate(workers, s, policy, pushes_each, seed):
    """Event-driven: workers with random compute times push, the server replies or holds them (Book)."""
    rng = random.Random(seed)
    b = Book(max_staleness=s, policy=policy)
    speed = {w: rng.uniform(0.5, 3.0) for w in range(1, workers + 1)}
    now, done, queue = 0.0, {w: 0 for w in speed}, []

    def start(w, t):
        b.started(w)
        queue.append((t + speed[w] * rng.uniform(0.8, 1.2), w, b.version))

    for w in speed:
        if b.may_start(w):
            start(w, 0.0)
        else:
            b.held.append(w)
    active = set(speed)
    while queue:
        queue.sort()
        now, w, ver = queue.pop(0)
        b.push(w, done[w], ver)
        done[w] += 1
        if done[w] == pushes_each:
            active.discard(w)
        elif b.may_start(w):
            start(w, now)
        else:
            b.held.append(w)
        for x in b.release(active):
            queue.append((now + speed[x] * rng.uniform(0.8, 1.2), x, b.version))
    return b, done


@pytest.mark.parametrize("s", [0, 1, 2])
def test_wait_policy_never_exceeds_the_bound_never_drops_and_never_deadlocks(s):
    for seed in range(20):
        b, done = _simulate(workers=4, s=s, policy="wait", pushes_each=15, seed=seed)
        assert all(n == 15 for n in done.values())  # no deadlock
        assert all(t.applied for t in b.taken) and max(t.staleness for t in b.taken) <= s
        assert b.version == 60


def test_drop_policy_in_the_same_simulation_does_drop():
    """The simulation can fail the bound: without holding workers back, staleness goes past it and is dropped."""
    drops = sum(not t.applied for seed in range(5) for t in _simulate(4, 0, "drop", 15, seed)[0].taken)
    assert drops > 0


def test_book_refuses_bad_settings():
    with pytest.raises(ValueError, match="staleness_policy"):
        Book(1, "later")
    with pytest.raises(ValueError, match="max_staleness"):
        Book(-1)


# ---- time to accuracy -------------------------------------------------------------------------------------------

LINK = Link(alpha=1e-4, beta=1e-9)
KW = dict(t_comp=0.1, nbytes=4e8, nproc=2, link=LINK)


def test_step_time_forms_by_hand():
    ar = costmodel.ring_allreduce(1e-4, 1e-9, 4e8, 2)
    assert step_time(Lever("b", "sync", 10), **KW) == pytest.approx(0.1 + ar)
    assert step_time(Lever("l", "local_sgd", 10, period=4), **KW) == pytest.approx(0.1 + ar / 4)
    comp = Lever("c", "compressed", 10, ratio=0.5, encode_s=0.01)
    assert step_time(comp, **KW) == pytest.approx(0.11 + costmodel.ring_allreduce(1e-4, 1e-9, 2e8, 2))
    msg = 1e-4 + 1e-9 * 4e8
    assert step_time(Lever("a", "async", 10), **KW, t_apply=0.02) == pytest.approx(
        max((0.1 + 2 * msg) / 2, 2 * msg + 0.02)
    )


def test_time_to_target_is_steps_times_the_step_and_names_the_first():
    levers = [
        Lever("baseline", "sync", 50),
        Lever("local 4", "local_sgd", 60, period=4),
        Lever("never", "compressed", None, ratio=0.1),
    ]
    t = time_to_target(levers, **KW).set_index("label")
    assert t.loc["baseline", "time"] == pytest.approx(50 * t.loc["baseline", "t_step"])
    assert math.isnan(t.loc["never", "time"])
    assert first_to_target(t.reset_index()) == "local 4"  # 0.4 s of all-reduce per step saved
    fast = time_to_target(levers, **{**KW, "link": LINK.replace(beta=1e-13)})  # a fast link: fewer steps win
    assert first_to_target(fast) == "baseline"


def test_crossover_bandwidth_is_where_the_two_times_meet():
    base, local = Lever("baseline", "sync", 50), Lever("local", "local_sgd", 60, period=4)
    kw = dict(KW)
    gbs = crossover_bandwidth(local, base, **kw)
    assert gbs is not None and 0.01 < gbs < 100
    at = dict(kw, link=LINK.replace(beta=1 / (gbs * 1e9)))
    assert 60 * step_time(local, **at) == pytest.approx(50 * step_time(base, **at), rel=1e-6)
    slower = dict(kw, link=LINK.replace(beta=1 / (gbs / 2 * 1e9)))
    assert 60 * step_time(local, **slower) < 50 * step_time(base, **slower)  # below it, fewer bytes win
    assert crossover_bandwidth(Lever("x", "sync", None), base, **kw) is None
    # the link's form is kept: the textbook all-reduce moves less, so the crossover is at a lower bandwidth
    book = crossover_bandwidth(local, base, **dict(kw, link=LINK.replace(form="textbook")))
    assert book is not None and book < gbs


def test_time_to_target_takes_one_link_and_names_the_field():
    with pytest.raises(ValueError, match=r"^link must be a Link"):
        step_time(Lever("b", "sync", 10), t_comp=0.1, nbytes=4e8, nproc=2, link=(1e-4, 1e-9))
    two = TwoLevelLink(intra=LINK, inter=LINK, gpus_per_node=2)
    with pytest.raises(ValueError, match=r"^link must be one level"):
        time_to_target([Lever("b", "sync", 10)], t_comp=0.1, nbytes=4e8, nproc=2, link=two)


def test_lever_refuses_nonsense():
    with pytest.raises(ValueError, match="kind"):
        Lever("x", "magic", 3)
    with pytest.raises(ValueError, match="period"):
        Lever("x", "local_sgd", 3, period=0)
    with pytest.raises(ValueError, match="steps"):
        Lever("x", "sync", -1)


# ---- config refusals ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(eval_every=-1), "evaluation.every (eval_every) must be an integer >= 0"),
        (dict(eval_samples=0), "evaluation.samples (eval_samples) must be an integer >= 1"),
        (dict(strategy="zero3", eval_every=2), "eval_every 2 applies to strategy"),
        (dict(local_sgd=-2), "local_sgd must be an integer >= 0"),
        (dict(strategy="ps", local_sgd=2), "local_sgd 2 applies to strategy 'ddp' only"),
        (dict(local_sgd=2, comm_hook="powersgd"), "cannot be combined with comm_hook"),
        (dict(local_sgd=2, checkpoint_every=2), "cannot be combined with checkpoint_every"),
        (dict(max_staleness=5), "max_staleness 5 applies to strategy 'async' only"),
        (dict(staleness_policy="wait"), "staleness_policy 'wait' applies to strategy 'async' only"),
        (dict(strategy="async", staleness_policy="later"), "staleness_policy must be one of 'drop', 'wait'"),
        (dict(strategy="async", max_staleness=-1), "max_staleness must be an integer >= 0"),
        (dict(strategy="async", nproc=1), "needs at least 2 ranks"),
        (dict(strategy="async", comm_hook="fp16"), "comm_hook 'fp16' applies to strategy 'ddp' only"),
        (dict(lr_scaling="cube"), "lr_schedule.scaling (lr_scaling) must be one of 'none', 'linear', 'sqrt'"),
        (dict(warmup_steps=-1), "warmup_steps must be an integer >= 0"),
        (dict(base_batch=0), "base_batch must be an integer >= 1"),
        (dict(strategy="zero3", lr_scaling="linear"), "lr_scaling 'linear' applies to strategy"),
    ],
)
def test_convergence_fields_are_refused_by_name(fields, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        dtlab.tiny(**fields).validate(cuda_device_count=0)


def test_eval_needs_a_heldout_split(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("sentence,label\n" + "".join(f"s {i},{i % 2}\n" for i in range(20)))
    with pytest.raises(ValueError, match="eval_every needs a held-out split"):
        dtlab.tiny(data=str(path), eval_every=2).validate(cuda_device_count=0)


def test_the_levers_validate():
    for cfg in (
        dtlab.tiny(eval_every=2, local_sgd=4, lr_scaling="sqrt", warmup_steps=2),
        dtlab.tiny(strategy="async", nproc=3, max_staleness=0, staleness_policy="wait", eval_every=3),
    ):
        assert cfg.validate(cuda_device_count=0) is cfg


# ---- the readers ------------------------------------------------------------------------------------------------


def _write(tmp_path, events, config):
    (tmp_path / "events").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"config": config, "resolved": {"world_size": len(events)}}))
    (tmp_path / "status.json").write_text(json.dumps({"state": "finished"}))
    for r, evs in events.items():
        (tmp_path / "events" / f"rank{r}.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in evs + [{"kind": "done", "rank": r}])
        )
    return str(tmp_path)


def _step(r, s, t=0.1):
    return {
        "kind": "step",
        "rank": r,
        "step": s,
        "t_fwd": t / 4,
        "t_bwd": t / 2,
        "t_opt": t / 4,
        "t_step": t,
        "loss": 0.5,
    }


def test_evals_time_to_and_local_sgd_bytes(tmp_path):
    ev = {0: [], 1: []}
    for r in (0, 1):
        for s in range(4):
            ev[r].append(_step(r, s))
            if s % 2 == 0:
                ev[r].append(
                    {
                        "kind": "collective",
                        "rank": r,
                        "step": s,
                        "op": "all_reduce",
                        "phase": "average",
                        "nbytes": 1000,
                        "t_start": 0.08,
                        "t_end": 0.09,
                    }
                )
    accs = [(0, 0.0, 0.5), (2, 0.3, 0.85), (4, 0.6, 0.93)]
    ev[0] += [
        {
            "kind": "eval",
            "rank": 0,
            "step": s,
            "t": t,
            "accuracy": a,
            "loss": 0.3,
            "t_eval": 0.01,
            "t_wall": t,
            "n": 872,
        }
        for s, t, a in accs
    ]
    run = dtlab.load_run(_write(tmp_path, ev, {"strategy": "ddp", "nproc": 2, "warmup": 1, "local_sgd": 2}))
    assert list(run.evals["step"]) == [0, 2, 4]
    assert run.time_to(0.9) == pytest.approx(0.6) and run.steps_to(0.9) == 4 and run.steps_to(0.8) == 2
    assert run.time_to(0.95) is None
    from dtlab.results.convergence import bytes_per_step

    assert bytes_per_step(run) == pytest.approx(1000 / 2)  # one average of 1000 B per 2 steps
    with pytest.raises(ValueError, match="target"):
        run.time_to(90)


def test_updates_and_the_staleness_histogram(tmp_path):
    ups = [(1, 0, 0, True), (2, 0, 1, True), (1, 1, 1, True), (2, 1, 3, False)]
    ev = {
        0: [
            {
                "kind": "update",
                "rank": 0,
                "worker": w,
                "step": s,
                "staleness": st,
                "applied": ap,
                "version": i + 1,
                "computed_on": 0,
                "t": 0.1 * i,
                "lr": 1e-3,
                "loss": 0.6,
            }
            for i, (w, s, st, ap) in enumerate(ups)
        ],
        1: [_step(1, 0), _step(1, 1)],
        2: [_step(2, 0), _step(2, 1)],
    }
    run = dtlab.load_run(_write(tmp_path, ev, {"strategy": "async", "nproc": 3, "warmup": 0}))
    assert list(run.updates["rank"]) == [1, 2, 1, 2] and list(run.updates["staleness"]) == [0, 1, 1, 3]
    from dtlab.results.convergence import staleness_histogram

    h = staleness_histogram(run.updates).set_index("staleness")
    assert h.loc[1, "applied"] == 2 and h.loc[3, "dropped"] == 1 and h.loc[0, "applied"] == 1


# ---- the figure and the explorer ----------------------------------------------------------------------------------


def _curve(steps, accs, dt=0.05):
    import pandas as pd

    return pd.DataFrame({"step": steps, "t": [s * dt for s in steps], "accuracy": accs})


def test_convergence_figure_draws_each_lever_against_steps_and_time_with_the_models_time():
    from dtlab.viz.convergence import convergence_figure

    curves = {"baseline": _curve([0, 5, 10], [0.5, 0.8, 0.95]), "local": _curve([0, 5, 10], [0.5, 0.7, 0.85])}
    levers = [Lever("baseline", "sync", 10), Lever("local", "local_sgd", None, period=5)]
    pred = time_to_target(levers, **KW)
    fig = convergence_figure(curves, 0.9, pred)
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert len(lines) == 4 and {t.xaxis for t in lines} == {"x", "x2"}  # each lever in both panels
    diamonds = [t for t in fig.data if t.mode == "markers"]
    assert len(diamonds) == 1 and diamonds[0].x[0] == pytest.approx(pred.set_index("label").loc["baseline", "time"])
    assert "0.9" in fig.layout.title.text


def test_explorer_moves_redraw_the_bars_and_name_the_crossover():
    from dtlab.viz.convergence import convergence_explorer

    levers = [
        Lever("baseline", "sync", 50),
        Lever("local", "local_sgd", 60, period=4),
        Lever("never", "compressed", None, ratio=0.1),
    ]
    ex = convergence_explorer(levers, t_comp=0.1, nbytes=4e8, nproc=2, link=LINK, target=0.9, source="synthetic")
    before_label, before_y = ex.label.value, list(ex.figure.data[0].y)
    assert "local (60 steps against 50): beats baseline below" in before_label and "synthetic" in before_label
    ex.sliders["bandwidth_gbs"].value = 1000.0  # a fast link: the fewest steps win
    assert list(ex.figure.data[0].y) != before_y and ex.label.value != before_label
    assert "<b>baseline</b>" in ex.label.value
    ex.sliders["nproc"].value = 16
    assert "p = 16" in ex.figure.layout.title.text and "never reached" in ex.figure.data[0].x[2]
