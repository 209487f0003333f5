"""Every strategy's figures follow the device's clock, not the host's: real gloo runs whose ranks take their marks on
a fake CUDA (tests/fake_cuda.py, through dtlab.rank.marks' test-only hook DTLAB_MARKS_HOOK) on the NCCL path.

The fake device's clock moves one whole tick (1 s) with every event it reaches and never with the host, and every
host call returns at once. A figure taken on the rank's marks is a whole number of ticks; one taken with the host's
clock (time.perf_counter: what 'tp', 'pp' and 'fsdp2' used before, which on NCCL measures launch time) is a
fraction of a second, and fails here. The runs are tiny (2 ranks, 2 steps), launched side by side; nothing here
compares times between runs.

Also here, on the same launches: the user's TORCH_NCCL_ASYNC_ERROR_HANDLING reaches the ranks unchanged and the run
records it as the user's (the launcher used to overwrite it with 1), and a plain CPU run (no hook) says "wall
clock" and "training thread" where the hooked ones say "CUDA events" and "compute stream".
"""

import math
import os
import pathlib

import pytest

import dtlab

FAKE = str(pathlib.Path(__file__).resolve().parent.parent / "fake_cuda.py")
BASE = dict(steps=2, warmup=1, batch_size=4, seq_len=16, baseline_steps=0)
RUNS = {
    "ddp": dict(strategy="ddp", baseline_steps=1),
    "zero3": dict(strategy="zero3"),
    "tp": dict(strategy="tp"),
    "pp-gpipe": dict(strategy="pp", microbatches=2, pp_schedule="gpipe"),
    "pp-1f1b": dict(strategy="pp", microbatches=2, pp_schedule="1f1b"),
    "fsdp2": dict(strategy="fsdp2"),
}
#: The plain run (no hook), launched with the user's own error handling mode.
USER_MODE = "2"
#: Every field of the run's frames that is a time on the step's clock.
TIME_FIELDS = {
    "steps": ("t_fwd", "t_bwd", "t_opt", "t_step", "t_blocked", "t_pipe"),
    "buckets": ("t_ready", "t_start", "t_end"),
    "collectives": ("t_start", "t_end"),
    "blocked": ("t_start", "t_end"),
    "microbatches": ("t_start", "t_end"),
}


def _launch(name, kw, root, env):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # launch() hands the environment to torchrun
    try:
        return dtlab.launch(dtlab.tiny(**{**BASE, **kw}, out=str(root / name)))
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: Run}: every strategy under the fake CUDA, and 'plain': tp on CPU with the user's NCCL setting."""
    root = tmp_path_factory.mktemp("fake-cuda")
    hooked = {"DTLAB_MARKS_HOOK": f"{FAKE}:rank_marks"}
    handles = {name: _launch(name, kw, root, hooked) for name, kw in RUNS.items()}
    handles["plain"] = _launch("plain", dict(strategy="tp"), root, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": USER_MODE})
    return {name: h.wait(progress=False) for name, h in handles.items()}


def _times(run):
    frames = {
        "steps": run.steps,
        "buckets": run.buckets,
        "collectives": run.collectives,
        "blocked": run.blocked,
        "microbatches": getattr(run, "microbatches", None),
    }
    for frame, cols in TIME_FIELDS.items():
        df = frames[frame]
        if df is None or df.empty:
            continue
        for col in cols:
            if col in df.columns:
                yield from ((frame, col, float(v)) for v in df[col].dropna())


@pytest.mark.parametrize("name", list(RUNS))
def test_every_figure_is_taken_on_the_device_clock(runs, name):
    run = runs[name]
    assert run.status["state"] == "finished"
    assert run.resolved["timing_method"]["method"] == "cuda_events"
    assert run.resolved["timing_method"]["path"] == "nccl"
    assert run.resolved["timing_method"]["streams_made_in_steps"] == 0  # every owned stream made before step 0
    times = list(_times(run))
    off = [(f, c, v) for f, c, v in times if abs(v - round(v)) > 1e-6]
    assert not off, f"{name}: figures not on the device's clock (host clock?): {off[:5]}"
    assert (run.steps["t_step"] >= 2).all()  # a step spans at least two of the device's ticks
    comm = run.buckets if not run.buckets.empty else run.collectives[run.collectives["step"] >= 0]
    assert not comm.empty and comm["t_end"].notna().all()  # every collective and transfer ended
    assert (comm["t_end"] > comm["t_start"]).any()


@pytest.mark.parametrize("name", ["tp", "pp-1f1b", "fsdp2", "zero3"])
def test_blocked_time_is_the_compute_streams_on_the_device_clock(runs, name):
    run = runs[name]
    assert (run.steps["t_blocked"] >= 1).all()  # whole ticks, never the host's microseconds of launch time
    assert "compute stream" in run.summary().set_index("quantity").loc["exposed", "how"]


@pytest.mark.parametrize("name", list(RUNS) + ["plain"])
def test_the_summary_and_the_breakdown_say_the_recorded_method(runs, name):
    run = runs[name]
    cuda = name != "plain"
    table = run.summary()
    s = table.set_index("quantity")
    words = "CUDA events on the compute stream" if cuda else "wall clock (time.perf_counter) on the training thread"
    assert words in s.loc["T_step", "how"]
    timing = [ln for ln in run.breakdown_table(table).splitlines() if ln.startswith("  timing: ")]
    assert len(timing) == 1 and timing[0].startswith(f"  timing: {words}")
    text = " ".join(s["how"]) + timing[0]
    assert ("CUDA events" in text) == cuda and ("wall clock" in text) != cuda
    if run.measures_blocked:
        assert ("compute stream" in s.loc["exposed", "how"]) == cuda
        assert ("training thread" in s.loc["exposed", "how"]) != cuda


def test_the_users_nccl_error_handling_survives_a_launch(runs):
    plain, hooked = runs["plain"].resolved["environment"], runs["tp"].resolved["environment"]
    assert plain["from_user"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == USER_MODE
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in plain["set_by_dtlab"]
    # where the user left it unset, dtlab sets torch's own default (3, SkipCleanUp) and says it did
    assert hooked["set_by_dtlab"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_ENABLE_TIMING" not in {**plain["set_by_dtlab"], **hooked["set_by_dtlab"]}  # not on gloo
    assert not math.isnan(runs["plain"].summary().set_index("quantity").loc["T_step", "value"])
