"""Checkpoint and resume (dtlab.results.restarts, dtlab.rank.restarts): a rank killed with SIGKILL makes torchrun
restart the group, training resumes from the newest checkpoint and finishes with every step once, on one timeline, with
the same losses as a run never interrupted; without restarts left the run fails naming the rank (with max_restarts 0:
the kill drill of tests/test_faults.py, which runs with checkpoints on). Plus the pure parts: checks before launch, the
timeline on hand-made events, torn event lines, attempt-aware fault injection, the watchdog during a restart, and the
Young/Daly intervals.

The three real runs (tiny model, 2 gloo ranks) are launched together, as the fault drills are."""

import json
import os
import subprocess
import sys
import time

import pytest

import dtlab
from dtlab.model.restarts import measured_costs
from dtlab.results.events import read_events

# The uninterrupted reference is conftest's shared `tiny_run` (never checkpointed): the runs here use its config.


REFERENCE = dict(steps=4, baseline_steps=2, bucket_mb=0.05)
EVERY, KILL_AT = 2, 3  # rank 1 dies at the start of step 3: steps 0-2 done, the newest checkpoint is step-2


RUNS = {  # name: (DTLAB_FAULT, max_restarts)
    "resumed": (f"1:{KILL_AT}:kill", 1),
    "exhausted": (f"1:{KILL_AT}:kill:*", 1),  # dies on every attempt: the one restart is used up
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """{name: the Run, or the RunFailed it raised}, and "reference": the same config never interrupted."""
    root = tmp_path_factory.mktemp("ckpt")
    old = os.environ.get("DTLAB_FAULT")
    handles = {}
    try:
        for name, (fault, restarts) in RUNS.items():
            os.environ["DTLAB_FAULT"] = fault  # launch() hands the environment to torchrun
            handles[name] = dtlab.launch(
                dtlab.tiny(out=str(root / name), **REFERENCE, checkpoint_every=EVERY, max_restarts=restarts)
            )
    finally:
        os.environ.pop("DTLAB_FAULT", None) if old is None else os.environ.update(DTLAB_FAULT=old)
    out = {"reference": request.getfixturevalue("tiny_run")}  # runs meanwhile, unless an earlier test made it
    for name, h in handles.items():
        try:
            out[name] = h.wait(progress=False)
        except dtlab.RunFailed as e:
            out[name] = e
    return out


def test_killed_rank_resumes_and_every_step_is_recorded_once(runs):
    run = runs["resumed"]
    assert not isinstance(run, Exception), run
    assert run.status["state"] == "finished" and run.status["restarts"] == 1
    for rank in (0, 1):
        mine = run.steps[run.steps["rank"] == rank]
        assert sorted(mine["step"]) == list(range(REFERENCE["steps"]))  # each step once, after the restart too
        # steps before the checkpoint come from the first attempt, the rest from the restarted one
        assert set(mine[mine["step"] < EVERY]["attempt"]) == {0} and set(mine[mine["step"] >= EVERY]["attempt"]) == {1}
        assert sorted(run.baseline_steps[run.baseline_steps["rank"] == rank]["step"]) == [4, 5]
    assert len(run.per_step()) == REFERENCE["steps"] - run.warmup
    # the restart is marked: both ranks resumed from step-2 (2 steps done), and step 2 was lost work, redone
    assert sorted(run.restarts["rank"]) == [0, 1] and set(run.restarts["resumed_from"]) == {EVERY}
    assert set(run.restarts["checkpoint"]) == {"step-2"} and (run.restarts["down_s"] > 0).all()
    assert sorted(zip(run.lost["rank"], run.lost["step"], run.lost["attempt"])) == [(0, 2, 0), (1, 2, 0)]
    costs = measured_costs(run)
    assert costs["restarts"] == 1 and costs["lost_steps"] == 1 and costs["lost_total_s"] > costs["lost_s"] > 0
    assert "restart: attempt 1 resumed from step 2 (step-2)" in run.breakdown_table()
    names = [e["name"] for e in run.to_chrome_trace()["traceEvents"]]
    assert names.count("restart 1: resumed from step 2") == 2 and names.count("step 2 (lost)") == 2


def test_checkpoints_are_complete_and_measured(runs):
    run = runs["resumed"]
    root = os.path.join(run.path, "checkpoints")
    assert sorted(os.listdir(root)) == ["step-2", "step-4"]  # nothing temporary left; never one in baseline steps
    assert all(os.path.isfile(os.path.join(root, d, ".metadata")) for d in os.listdir(root))
    ck = run.checkpoints
    assert sorted(set(zip(ck["attempt"], ck["step"]))) == [(0, 2), (1, 4)]
    assert (ck.groupby(["attempt", "step"])["rank"].count() == 2).all() and (ck["t_save"] > 0).all()
    # the bytes the ranks report are the checkpoint's data files, byte for byte
    files = sum(
        os.path.getsize(os.path.join(root, "step-4", f))
        for f in os.listdir(os.path.join(root, "step-4"))
        if f.endswith(".distcp")
    )
    assert ck[ck["step"] == 4]["nbytes"].sum() == files
    # more than the model's fp32 weights: AdamW's two moments travel too
    assert files > 3 * run.memory["params_bytes"].iloc[0] * 0.9


def test_resumed_losses_equal_an_uninterrupted_run(runs):
    """Model, optimizer, RNG (dropout) and data position restored: the very same numbers, not merely close ones
    (two gloo ranks sum in a fixed order; the same ops on the same inputs give the same bits)."""
    ref, run = runs["reference"], runs["resumed"]
    assert not isinstance(run, Exception), run
    ref_cfg, run_cfg = ref.config.to_dict(), run.config.to_dict()
    same = {k: v for k, v in ref_cfg.items() if k not in ("out", "restarts")}  # restarts: checkpoint_every, ...
    assert same == {k: run_cfg[k] for k in same}, "conftest's tiny_run no longer matches REFERENCE"
    key = ["rank", "step"]
    for frame in ("steps", "baseline_steps"):
        a = getattr(run, frame).sort_values(key)[key + ["loss"]].reset_index(drop=True)
        b = getattr(ref, frame).sort_values(key)[key + ["loss"]].reset_index(drop=True)
        assert a[key].equals(b[key]) and len(a) == 2 * len(set(a["step"]))
        assert (a["loss"] == b["loss"]).all(), f"{frame}: {a['loss'].tolist()} != {b['loss'].tolist()}"
    # not vacuous: the loss moves from step to step, and dropout makes ranks differ
    assert ref.steps["loss"].nunique() > REFERENCE["steps"]


def test_when_restarts_run_out_the_run_fails_naming_the_rank(runs):
    e = runs["exhausted"]
    assert isinstance(e, dtlab.RunFailed)
    assert (e.state, e.rank, e.signal) == ("failed", 1, "SIGKILL"), str(e)
    assert str(e).startswith("rank 1 died from signal SIGKILL")
    assert set(e.run.restarts["attempt"]) == {1}  # it did restart once before giving up
    assert json.load(open(os.path.join(e.run_dir, "status.json")))["restarts"] == 1


def test_the_watchdog_waits_for_a_restart_but_only_while_restarts_remain(tmp_path):
    from dtlab.launching.watchdog import STARTUP_ALLOWANCE_S, RankFeed, StallWatch

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a rank whose process is gone

    class Watch(StallWatch):
        def __init__(self, max_restarts):
            self.stall_s, self.max_restarts, self.run_dir = 2.0, max_restarts, str(tmp_path)
            self._feeds = [RankFeed(0, str(tmp_path / "rank0.jsonl"), time.monotonic())]
            self._feeds[0].pid, self._feeds[0].progress = dead.pid, 3
            self._feeds[0].last_seen -= 5.0  # silent past stall_s

    w = Watch(max_restarts=1)
    assert w._watch(None) is None  # torchrun is restarting it: not a stall
    assert w._feeds[0].restarting and w.stall_threshold(w._feeds[0].progress > 0) == STARTUP_ALLOWANCE_S
    w = Watch(max_restarts=1)
    w._feeds[0].attempt = 1  # the one restart is used up: no allowance, the usual limit applies
    assert w._watch(None) == w._feeds
    assert Watch(max_restarts=0)._watch(None) is not None
    w = Watch(max_restarts=1)
    w._feeds[0].last, w._feeds[0].ended = {"kind": "done"}, True  # gone because it finished: not restarting
    assert w._watch(None) is None and not w._feeds[0].restarting and w._feeds[0].ended


_ROUND_TRIP = r"""
import json, os, sys, types
import torch, torch.distributed as dist
from dtlab.rank.restarts import Checkpointer
from dtlab.rank.recorder import EventWriter
tmp = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
cfg = types.SimpleNamespace(restarts=types.SimpleNamespace(checkpoint_every=1), steps=4)
writer = EventWriter(f"{tmp}/events.jsonl", attempt=0)


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)

model, opt = build(0)
ck = Checkpointer(cfg.restarts, cfg.steps, tmp, 0, 1, torch.device("cpu"), writer)
for step in range(cfg.steps):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    ck.after_step(step, model, opt)
ck.after_step(cfg.steps, model, opt)  # a baseline step: never checkpointed
after = os.listdir(f"{tmp}/checkpoints")
params = [p.detach().clone() for p in model.parameters()]
moments = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
draw = torch.rand(3)  # what the RNG gives right after the last save
os.makedirs(f"{tmp}/checkpoints/.tmp-step-9-a0")  # a save the killed attempt left half-written
os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
model2, opt2 = build(1)  # other weights, empty optimizer, other RNG state
writer2 = EventWriter(f"{tmp}/events.jsonl", attempt=1)
first = Checkpointer(cfg.restarts, cfg.steps, tmp, 0, 1, torch.device("cpu"), writer2).resume(model2, opt2)
print(json.dumps({"after": sorted(after), "left": sorted(os.listdir(f"{tmp}/checkpoints")), "first": first,
                  "params": all(torch.equal(a, b) for a, b in zip(params, model2.parameters())),
                  "moments": all(torch.equal(a, opt2.state[p]["exp_avg_sq"])
                                 for a, p in zip(moments, model2.parameters())),
                  "adam_step": float(opt2.state[next(model2.parameters())]["step"]),
                  "rng": torch.equal(draw, torch.rand(3))}))
dist.destroy_process_group()
"""


def test_checkpointer_round_trip_in_one_process(tmp_path):
    """The rank side alone (one gloo rank): a save every step keeps the last two, complete; a restarted process
    with other weights and an empty optimizer gets the weights, AdamW's moments and step, and the RNG stream back."""
    cp = subprocess.run(
        [sys.executable, "-c", _ROUND_TRIP, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    got = json.loads(cp.stdout.strip().splitlines()[-1])
    assert got["after"] == ["step-3", "step-4"] and got["left"] == ["step-3", "step-4"]
    assert got["first"] == 4 and got["params"] and got["moments"] and got["adam_step"] == 4.0 and got["rng"]
    events = read_events(str(tmp_path / "events.jsonl"))
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [1, 2, 3, 4]
    restarts = [(e["attempt"], e["resumed_from"], e["checkpoint"]) for e in events if e["kind"] == "restart"]
    assert restarts == [(1, 4, "step-4")]
