"""Lab 12's pieces apart from a run: what each interruption cost read from records, the spot model per
interruption and its band, the claim built from them, the kill plan, the rubric's band rule, and the passages for
each placement."""

import math
import types

import numpy as np
import pandas as pd
import pytest

from dtlab.course.claims import consistent
from dtlab.course.claims import lab12 as L
from dtlab.course.rubric import lab12 as R
from dtlab.model.link import Link


def _run():
    """A timeline: training starts at t = 100 s; a checkpoint of 4 steps ends at 100.6; a kill at 100.9; the group
    has loaded step-4 again at 102.0; killed again before its next checkpoint, back at 103.0 from step-4 again."""
    steps = pd.DataFrame(
        [{"rank": r, "step": s, "attempt": 0, "t_step": 0.1, "time": 100.1 + 0.1 * s} for r in (0, 1) for s in (0,)]
    )
    ck = pd.DataFrame(
        [
            {"rank": 0, "step": 4, "attempt": 0, "t_save": 0.1, "wall_time": 100.55},
            {"rank": 1, "step": 4, "attempt": 0, "t_save": 0.1, "wall_time": 100.6},  # the slowest rank's end
        ]
    )
    rs = pd.DataFrame(
        [
            {"rank": 0, "attempt": 1, "resumed_from": 4, "wall_time": 101.9},
            {"rank": 1, "attempt": 1, "resumed_from": 4, "wall_time": 102.0},
            {"rank": 0, "attempt": 2, "resumed_from": 4, "wall_time": 103.0},
            {"rank": 1, "attempt": 2, "resumed_from": 4, "wall_time": 102.95},
        ]
    )
    lost = pd.DataFrame(columns=["rank", "step", "attempt", "t_step", "loss", "kind", "wall_time"])
    return types.SimpleNamespace(steps=steps, checkpoints=ck, restarts=rs, lost=lost)


def test_each_interruption_costs_from_its_own_resume_point():
    log = [{"attempt": 0, "time": 100.9}, {"attempt": 1, "time": 102.7}]
    got = L.interruption_costs(_run(), log).set_index("attempt")
    # the first: from the end of step-4's save (slowest rank) to the group loaded again (slowest rank)
    assert got.loc[1, "safe_s"] == pytest.approx(100.6) and got.loc[1, "cost_s"] == pytest.approx(1.4)
    assert got.loc[1, "lost_s"] == pytest.approx(0.3) and got.loc[1, "restart_s"] == pytest.approx(1.1)
    # the second: no checkpoint since, so the work lost started when the first restart had loaded step-4
    assert got.loc[2, "safe_s"] == pytest.approx(102.0) and got.loc[2, "cost_s"] == pytest.approx(1.0)
    assert got.loc[2, "lost_s"] == pytest.approx(0.7)


def test_a_restart_from_scratch_counts_from_the_start_of_training():
    run = _run()
    run.checkpoints = run.checkpoints.iloc[0:0]
    run.restarts = run.restarts.assign(resumed_from=0)
    got = L.interruption_costs(run).set_index("attempt")
    assert got.loc[1, "safe_s"] == pytest.approx(100.0)  # step 0 ended at 100.1 after 0.1 s
    assert "lost_s" not in got  # no interrupter log: the split is unknown


def test_the_expected_loss_is_daly_s_and_its_band_holds_the_median():
    tau, c, m = 0.9, 0.1, 2.0
    rng = np.random.default_rng(0)
    u = rng.exponential(m, 400_000)
    u = u[u < tau + c]  # an interruption that lands in the cycle: memoryless, so the cycle restarts its clock
    assert L.expected_lost(tau, c, m) == pytest.approx(u.mean(), rel=0.01)
    assert L.expected_lost(tau, c, 1e9) == pytest.approx((tau + c) / 2, rel=1e-6)  # M >> L: half a cycle
    for n in (1, 3, 4):
        lo, hi = L.median_band(n, tau, c, m)
        meds = np.median(u[: (len(u) // n) * n].reshape(-1, n), axis=1)
        inside = np.mean((meds >= lo) & (meds <= hi))
        assert 0.88 <= inside <= 0.93 if n % 2 else inside >= 0.9, (n, inside)  # exact for odd n, wider for even
    one = L.per_interruption(tau, c, 0.5, m, 3)
    assert one["mean_s"] == pytest.approx(L.expected_lost(tau, c, m) + 0.5)
    assert one["lo_s"] < one["mean_s"] < one["hi_s"] and one["rel_tol"] > 0


def test_the_claim_holds_inside_the_band_and_is_contradicted_outside():
    tau, c, r, m = 0.9, 0.1, 0.5, 2.0
    mean = L.per_interruption(tau, c, r, m, 3)["mean_s"]
    near = pd.DataFrame({"cost_s": [mean * 0.95, mean, mean * 1.05]})
    claim = L.interruption_claim(near, tau, c, r, m, how="three")
    assert claim.outcome == "holds" and not consistent(claim.record())
    far = pd.DataFrame({"cost_s": [mean * 3, mean * 3.2, mean * 2.9], "lost_s": [1, 1, 1], "restart_s": [2, 2, 2]})
    claim = L.interruption_claim(far, tau, c, r, m, how="three")
    assert claim.outcome == "contradicted" and "restarts" in claim.why and not consistent(claim.record())
    two = L.interruption_claim(near.iloc[:2], tau, c, r, m, how="two")
    assert two.outcome == "inconclusive"  # a claim about time needs 3 interruptions


def test_the_kill_plan_is_seeded_and_checked():
    a, b = L.kill_plan(3, 2.0, 2, seed=7), L.kill_plan(3, 2.0, 2, seed=7)
    assert a == b and len(a[0]) == 3 and all(g > 0 for g in a[0]) and set(a[1]) <= {0, 1}
    assert a != L.kill_plan(3, 2.0, 2, seed=8)
    with pytest.raises(ValueError):
        L.kill_plan(0, 2.0, 2, seed=0)
    cfg = types.SimpleNamespace(restarts=types.SimpleNamespace(max_restarts=3, checkpoint_every=2))
    with pytest.raises(ValueError, match="max_restarts > kills"):
        L.interrupted_run(cfg, kills=3, mean_gap_s=1.0)


def _ended(kills_seen: int, trained_s: float):
    """A run of 10 steps whose attempt `kills_seen` began (its restart record) at t = 50 s and recorded step 8, its
    first of the last 2, `trained_s` later."""
    steps = pd.DataFrame(
        [{"rank": 0, "step": s, "attempt": kills_seen, "t_step": 0.1, "time": 50.5 + s * 0.01} for s in range(4, 8)]
        + [
            {"rank": r, "step": s, "attempt": kills_seen, "t_step": 0.1, "time": 50 + trained_s}
            for r in (0, 1)
            for s in (8, 9)
        ]
    )
    rs = pd.DataFrame([{"rank": 0, "attempt": kills_seen, "resumed_from": 4, "wall_time": 50.0}])
    return types.SimpleNamespace(steps=steps, restarts=rs, nproc=2, config=types.SimpleNamespace(steps=10))


def test_the_kill_count_is_explained_from_the_records():
    due = L.kill_plan(3, 2.0, 2, seed=5)[0]
    log = [{"attempt": 0}, {"attempt": 1}]
    assert L.count_line(_ended(2, 9.0), log + [{"attempt": 2}], 3, 2.0, 5).endswith("the most it allows (3)")
    short = L.count_line(_ended(2, due[2] * 0.5), log, 3, 2.0, 5)
    assert f"kill 3 was due after {L.fmt_time(due[2])} of training" in short
    assert f"attempt 2 had trained {L.fmt_time(due[2] * 0.5)}" in short and short.endswith("it reached them first")
    missed = L.count_line(_ended(2, due[2] + 1.0), log, 3, 2.0, 5)  # trained past the due time: a kill missed
    assert missed.endswith("reached them 1 s after the kill was due: the interrupter missed it")
    assert "no records of its last 2 steps" in L.count_line(_ended(1, 1.0), log, 3, 2.0, 5)


def _scaling(lo_hi: bool):
    sc = pd.DataFrame(
        {
            "gpus": [1, 2, 4, 8],
            "steps": [80, 40, 20, 10],
            "t_step_s": [0.05, 0.06, 0.061, 0.09],
            "t_step_lo_s": [0.05, 0.05, 0.05, 0.06] if lo_hi else [math.nan] * 4,
            "t_step_hi_s": [0.05, 0.07, 0.075, 0.12] if lo_hi else [math.nan] * 4,
        }
    )
    sc["wall_s"] = sc["steps"] * sc["t_step_s"]
    sc["gpu_hours"] = sc["gpus"] * sc["wall_s"] / 3600
    return sc


def test_the_rubric_accepts_every_count_the_band_cannot_tell_from_the_best():
    assert R._within_band(_scaling(False), "gpu_hours") == [1] and R._within_band(_scaling(False), "wall_s") == [8]
    # 4 GPUs: 20 x 0.05 = 1.0 s at the band's low end, not above 8 GPUs' 10 x 0.12 = 1.2 s at its high end
    assert R._within_band(_scaling(True), "wall_s") == [4, 8]
    # cheapest: 1 GPU, 80 x 0.05 = 4 GPU-seconds; 2 and 4 GPUs' low ends are 4 too, 8 GPUs' 80 x 0.06 = 4.8
    assert R._within_band(_scaling(True), "gpu_hours") == [1, 2, 4]


@pytest.mark.parametrize("where", ["cpu", "host_staged", "nccl"])
def test_the_passages_fit_the_placement(where):
    placement = {
        "cpu": {"device": "cpu", "backend": "gloo"},
        "host_staged": {"device": "cuda", "backend": "gloo", "ranks_per_gpu": 2},
        "nccl": {"device": "cuda", "backend": "nccl", "ranks_per_gpu": 1},
    }[where]
    for key in ("lab12.figures", "lab12.restart"):  # the lab's passages, kept with every lab's in course.wording
        body = L.text(key, placement)
        assert ("CPU figures" in body or "this CPU machine" in body) == (where == "cpu"), (key, where)
    with pytest.raises(KeyError):
        L.text("lab12.nothing", placement)


def test_a_check_cell_shows_nothing_before_an_answer(capsys):
    from dtlab.course.checks import answered

    assert answered("the bill", None, 0.02) is False
    assert capsys.readouterr().out == "answer first: the bill is shown here once your answers are set above\n"
    assert answered("the plan", ...) is False and "once your answer is set" in capsys.readouterr().out
    assert answered("the table", 2, 8) is True and capsys.readouterr().out == ""


# ---- grades that survive a re-run: the run graded, named; its spread; answers as expressions ----------------

FIXTURE_DDP = "tests/fixtures/run-v1-ddp"


def test_question_1_is_graded_by_the_runs_own_spread_and_names_the_run():
    import dtlab
    from dtlab.course.verdicts import judge, tolerance

    run = dtlab.load_run(FIXTURE_DDP)
    t = run.summary().set_index("quantity").loc["T_step"]
    spread = (t["hi"] - t["lo"]) / 2 / t["value"]
    key = R._gpu_hours(run)
    assert key.rel_tol == pytest.approx(max(spread, R.ROUNDING)) and key.rel_tol != 0.05
    assert tolerance(key)[0] == pytest.approx(key.rel_tol * key.expected)
    assert key.unit == "machine-hours"  # a CPU run: one machine billed, not a GPU
    assert key.graded_on.startswith("the priced run run-v1-ddp (T_step ") and "90% interval" in key.graded_on
    # an answer written as arithmetic on the printed inputs is recomputed from the graded run: right on any re-run
    v = judge(key, "ceil(epoch_samples / samples_per_step) * t_step_s * devices / 3600")
    assert v["ok"] is True and "with this run's values" in v["verdict"]
    # a number typed from a run whose T_step was 9% longer: outside this run's spread when that is narrower
    moved = judge(key, key.expected * 1.09)
    assert moved["ok"] is (0.09 <= tolerance(key)[0] / key.expected)
    # the unit said once, however the answer was written
    assert "machine-hours machine-hours" not in judge(key, f"{key.expected} machine-hours")["verdict"]


def test_the_grader_says_which_run_it_graded(monkeypatch, tmp_path):
    import dtlab
    from dtlab.course import grader

    run = dtlab.load_run(FIXTURE_DDP)
    monkeypatch.setattr(R, "sources", lambda rec: {"run": lambda: run, "profile": lambda: None, "crashed": lambda: run})
    key = R._gpu_hours(run)
    rows = grader.grade_answers(
        R.LAB,
        {"my_gpu_hours_per_epoch": {"value": key.expected}, "my_usd_per_epoch": {"value": 1e9}},
        None,
        str(tmp_path),
    )
    by = {r["question"]: r for r in rows}
    assert (
        by["lab12.q1"]["ok"] is True
        and "graded against the priced run run-v1-ddp (T_step" in by["lab12.q1"]["feedback"]
    )
    assert by["lab12.q2"]["ok"] is False and "graded against the priced run run-v1-ddp" in by["lab12.q2"]["feedback"]


def test_the_cost_ratio_beside_one_over_efficiency_shows_the_rounding():
    sc = _scaling(False)
    sc["steps"] = [50, 25, 13, 7]  # ceil(1,600 / (32 p)): 12.5 and 6.25 steps rounded up at 4 and 8 GPUs
    sc["gpu_hours"] = sc["gpus"] * sc["steps"] * sc["t_step_s"] / 3600
    sc["efficiency"] = sc["t_step_s"].iloc[0] / sc["t_step_s"]
    lines = L.ratio_lines(sc)
    # 2 GPUs: 2 x 25 x 0.06 / (50 x 0.05) = 1.2 = 0.06 / 0.05 exactly; 8 GPUs: 8 x 7 x 0.09 / 2.5 = 2.016 against 1.8
    assert "2 GPU(s): 1.2 against 1.2 " in lines[2] and "8 GPU(s): 2.02 against 1.8 " in lines[4]


def test_the_interruptions_expected_are_counted_on_the_interrupters_clock():
    first, why = L.count_lines(40.0, 5.0, 3)
    # 40 s of training at M = 5 s: a Poisson count of mean 8; P(N >= 3) = 1 - e^-8 (1 + 8 + 32) = 0.986
    assert "expects 8 interruptions" in first and "99% of such runs stop after all 3" in first
    assert "well above R" in why


def test_question_6_prices_the_runs_buckets_on_the_p5_outputs_and_the_table_gives_the_key():
    import dtlab
    from dtlab.course.verdicts import judge

    run = dtlab.load_run(FIXTURE_DDP)
    key, link = R._real(run), R.real_link()
    b = L.real_buckets(run, link, R.REAL_NODES)
    ratio = run.whatif(link, nproc=8, nodes=2).setting["ratio"]  # this recorded run compressed with fp16: 0.5
    assert ratio == 0.5 and b["nbytes"].sum() == pytest.approx(ratio * sum(run.resolved["param_nbytes"]), abs=1)
    pair = Link.from_profile(dtlab.public_nccl_tests(R.REAL_PAIR))
    network = 1e6 * float(np.sum(pair.time("all_reduce", b["nbytes"].to_numpy(dtype=float), 16)))
    p = R.REAL_NODES * link.gpus_per_node
    # the question's formula on the table's values is the key: one flat ring of 16, each step its slower edge
    by_hand = 1e6 * sum(
        2
        * (p - 1)
        * max(
            r.intra_alpha_us * 1e-6 + r.nbytes / p / (r.intra_gbs * 1e9),
            r.inter_alpha_us * 1e-6 + r.nbytes / p / (r.inter_gbs * 1e9),
        )
        for r in b.itertuples()
    )
    assert key.expected == pytest.approx(by_hand, rel=1e-9) and key.unit == "us" and key.points == 2
    assert key.expected >= network * (1 - 1e-12)  # never faster than the 2-node output's own ring at 16 ranks
    assert R.PRINTED <= key.rel_tol <= 0.5
    assert judge(key, by_hand)["ok"] and not judge(key, 2 * by_hand)["ok"]
    half = judge(key, by_hand / 2)
    assert not half["ok"] and "2(p-1) steps" in half["verdict"]
    # each bucket in its own regime: the 2-node output's one line over every size would price it otherwise
    line = R.real_allreduce_s(run, R.real_link().replace(inter=link.inter.replace(alpha=link.inter.alpha)), 2)[0]
    assert line * 1e6 != pytest.approx(key.expected, rel=1e-3)
    assert "milliseconds" in judge(key, by_hand / 1e3)["verdict"]
    text = "\n".join(L.real_lines(run, link, R.REAL_NODES))
    assert "aws-p5-2x8-h100-efa (nccl-tests output, https://" in text and "regime" in text
