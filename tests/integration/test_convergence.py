"""Does it still learn? Real 2- and 3-rank gloo runs of the tiny model with held-out evaluation and the levers.

Four launches shared by the tests (module fixtures): a learning DDP run with lr scaling and warmup, the session's
tiny run again with an evaluation after every step, local SGD from the command line, and the asynchronous
server from the command line. Nothing here asserts a time: only accuracy above chance, exact byte counts, the
order of events on the wall clock, bit-identical losses and bookkeeping.
"""

import json
import os
import subprocess
import sys

import pytest

import dtlab
from dtlab.config.convergence import default_lr, lr_at
from dtlab.results.convergence import bytes_per_step, staleness_histogram

TINY = [
    "--model",
    "tiny",
    "--model-source",
    "random",
    "--data",
    "offline",
    "--seq-len",
    "32",
    "--bucket-mb",
    "1",
    "--timeout-s",
    "300",
    "--no-progress",
]


@pytest.fixture(scope="module")
def learning(tmp_path_factory):
    """DDP, 40 steps of 2 x 32 sentences, lr 1.5e-3 scaled linearly to the global batch (k = 2), 4 warmup steps."""
    cfg = dtlab.tiny(
        out=str(tmp_path_factory.mktemp("conv") / "ddp"),
        steps=40,
        warmup=1,
        baseline_steps=0,
        batch_size=32,
        lr=1.5e-3,
        lr_scaling="linear",
        warmup_steps=4,
        eval_every=5,
    )
    return dtlab.run(cfg, progress=False)


def _cli(out, *args):
    cp = subprocess.run(
        [sys.executable, "-m", "dtlab", "run", *TINY, "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    return dtlab.load_run(str(out)), cp.stdout


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Local SGD with H = 3 over 6 steps (averages after steps 2 and 5), lr x sqrt(8 / 2) warmed up over 2 steps."""
    return _cli(
        tmp_path_factory.mktemp("conv") / "local",
        "--nproc",
        "2",
        "--steps",
        "6",
        "--warmup",
        "1",
        "--batch-size",
        "8",
        "--baseline-steps",
        "0",
        "--local-sgd",
        "3",
        "--eval-every",
        "3",
        "--lr-scaling",
        "sqrt",
        "--base-batch",
        "2",
        "--warmup-steps",
        "2",
    )


@pytest.fixture(scope="module")
def asynchronous(tmp_path_factory):
    """One server and two workers, 12 steps each, gradients staler than 1 update dropped."""
    return _cli(
        tmp_path_factory.mktemp("conv") / "async",
        "--strategy",
        "async",
        "--nproc",
        "3",
        "--steps",
        "12",
        "--warmup",
        "1",
        "--batch-size",
        "8",
        "--max-staleness",
        "1",
        "--staleness-policy",
        "drop",
        "--eval-every",
        "6",
    )


def test_accuracy_rises_above_chance(learning):
    ev = learning.evals
    assert list(ev["step"]) == list(range(0, 41, 5)) and (ev["n"] == 872).all()
    assert ev["accuracy"].iloc[0] < 0.6  # before training: about the majority class
    assert ev["accuracy"].max() >= 0.75  # the generated sentences are learnable
    assert ev["loss"].iloc[-1] < ev["loss"].iloc[0]
    assert learning.time_to(0.75) is not None and learning.steps_to(0.75) % 5 == 0
    assert "held-out generated sentences" in learning.resolved["eval_set"]["source"]


def test_the_lr_rule_sets_the_lr_it_claims(learning, local):
    for run in (learning, local[0]):
        cfg = run.config
        want = [lr_at(cfg, int(s)) for s in run.steps["step"]]
        assert run.steps["lr"].tolist() == pytest.approx(want, rel=1e-12)
    assert learning.steps.loc[learning.steps["step"] == 10, "lr"].iloc[0] == pytest.approx(3e-3)  # 1.5e-3 x 2
    assert learning.steps.loc[learning.steps["step"] == 0, "lr"].iloc[0] == pytest.approx(3e-3 / 4)
    # local SGD ran without --lr: the default for the random tiny model, scaled by sqrt(8 / 2) on top
    assert local[0].config.lr is None and local[0].lr == default_lr("tiny", pretrained=False)["value"]
    assert local[0].steps.loc[local[0].steps["step"] == 5, "lr"].iloc[0] == pytest.approx(local[0].lr * 2)
    assert "linear" in learning.resolved["lr_rule"] and "warmed up" in learning.resolved["lr_rule"]


def test_evaluation_does_not_change_the_step_timings_definition(learning):
    """Steps keep T_step = forward + backward + optimizer; no rank starts a step while rank 0 evaluates (all meet
    at a barrier); the evaluations' time is left out of the training time t."""
    st = learning.steps
    assert ((st["t_fwd"] + st["t_bwd"] + st["t_opt"] - st["t_step"]).abs() < 1e-9).all()
    ev = learning.evals
    raw = [json.loads(line) for line in open(os.path.join(learning.path, "events", "rank0.jsonl"))]
    evals = {e["step"]: e for e in raw if e["kind"] == "eval"}
    steps = {}
    for r in (0, 1):
        for e in map(json.loads, open(os.path.join(learning.path, "events", f"rank{r}.jsonl"))):
            if e["kind"] == "step":
                steps[(r, e["step"])] = (e["time"] - e["t_step"], e["time"])  # wall-clock start and end
    for k, e in evals.items():
        if k == 0 or k == 40:
            continue
        ended = e["time"]
        started = ended - e["t_eval"]
        for r in (0, 1):
            assert steps[(r, k)][0] >= ended - 0.005, (r, k)  # step k began after the evaluation
        assert steps[(0, k - 1)][1] <= started + 0.005  # rank 0 evaluated after its step
    earlier = ev["t_eval"].cumsum().shift(fill_value=0.0)
    assert (ev["t_wall"] - ev["t"] >= earlier - 1e-6).all()  # t leaves the evaluations out
    assert learning.summary().set_index("quantity").loc["T_step", "how"].startswith("median over 39 steps")


def test_evaluating_changes_nothing_the_ranks_compute(tiny_run, tmp_path):
    """The session's tiny run again with an evaluation after every step: every rank's every loss is equal bit for
    bit (evaluation draws no random numbers and waits outside the steps)."""
    cfg = tiny_run.config.replace(out=str(tmp_path / "eval"), eval_every=1, eval_samples=64)
    run = dtlab.run(cfg, progress=False)
    losses = lambda r: r.steps.sort_values(["rank", "step"])["loss"].tolist()  # noqa: E731
    assert losses(run) == losses(tiny_run) and len(losses(run)) == 8
    assert list(run.evals["step"]) == [0, 1, 2, 3, 4] and (run.evals["n"] == 64).all()
    assert tiny_run.evals.empty


def test_local_sgd_moves_one_in_h_of_the_bytes_and_the_ranks_agree_after_each_average(local, learning):
    run, printed = local
    grad = run.resolved["grad_bytes"]
    assert run.buckets.empty  # no gradient is all-reduced
    avg = run.collectives[run.collectives["phase"] == "average"]
    assert sorted(set(avg["step"])) == [2, 5] and (avg["nbytes"] == grad).all() and len(avg) == 4
    assert bytes_per_step(run) == grad / 3 and bytes_per_step(learning) == grad  # 1/H of DDP's
    digests = {}
    for r in (0, 1):
        for e in map(json.loads, open(os.path.join(run.path, "events", f"rank{r}.jsonl"))):
            if e["kind"] == "params":
                digests[(e["step"], e["averaged"], r)] = e["digest"]
    for s in (2, 5):
        assert digests[(s, True, 0)] == digests[(s, True, 1)], s  # bit-identical right after
        assert digests[(s - 1, False, 0)] != digests[(s - 1, False, 1)], s  # apart the step before
    assert "local SGD H = 3: 2 parameter averages" in printed
    names = [e["name"] for e in run.to_chrome_trace()["traceEvents"] if e.get("cat") == "communication"]
    assert names.count("all_reduce (average)") == 4  # the trace shows the averages
    assert list(run.evals["step"]) == [0, 3, 6]


def test_async_server_applies_every_push_once_and_records_staleness(asynchronous):
    run, printed = asynchronous
    assert run.resolved["lr"] == default_lr("tiny", pretrained=False)  # the server's AdamW, no --lr given
    pushes = run.collectives[run.collectives["op"] == "push"]
    pushed = sorted(zip(pushes["rank"].astype(int), pushes["step"].astype(int)))
    u = run.updates
    taken = sorted(zip(u["rank"].astype(int), u["step"].astype(int)))
    assert pushed == taken and len(taken) == 24 == len(set(taken))  # every push taken exactly once
    applied = u[u["applied"].astype(bool)]
    assert list(applied["version"]) == list(range(1, len(applied) + 1))  # one update each, in order
    assert (applied["staleness"] <= 1).all() and (u[~u["applied"].astype(bool)]["staleness"] > 1).all()
    before = u["version"] - u["applied"].astype(int)
    assert (u["staleness"] == before - u["computed_on"]).all()
    for r in (1, 2):  # each gradient was computed on the version its worker had pulled the step before
        st = run.steps[run.steps["rank"] == r].sort_values("step")
        mine = u[u["rank"] == r].sort_values("step")
        assert list(mine["computed_on"])[1:] == list(st["version"])[:-1]
    summary = [
        json.loads(x)
        for x in open(os.path.join(run.path, "events", "rank0.jsonl"))
        if '"staleness", "rank"' in x or '"kind": "staleness"' in x
    ][0]
    h = staleness_histogram(u)
    assert summary["histogram"] == {str(int(r.staleness)): int(r.applied) for r in h.itertuples() if r.applied}
    assert run.evals["step"].iloc[-1] == len(applied) and run.evals["step"].iloc[0] == 0
    msg = run.resolved["message_bytes"]
    assert (pushes["nbytes"] == msg["push"]).all() and msg["push"] == run.resolved["grad_bytes"] + 16
    assert "staleness of applied updates" in printed
