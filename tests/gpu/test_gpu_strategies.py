"""The GPU suite, every strategy and lever: real runs of the tiny model on CUDA tensors. `python -m pytest -m gpu -rs`.

What a CPU cannot show about them: CUDA's defaults (AdamW's multi-tensor path, which crashed tensor parallelism on
an H200; asynchronous kernels; CUDA RNG states in checkpoints), gloo or NCCL on CUDA tensors, and the CUDA timing
paths. On one GPU the ranks share it (gloo on CUDA tensors before NCCL 2.30); on several, one rank per GPU.

The runs are launched side by side (a GPU machine has the cores; their timings are not compared here) and each
test checks one of them: ddp with fp16 and PowerSGD compression and with accumulation, a straggler, a killed rank
resumed from its checkpoint, ZeRO-3 (test_gpu.py), FSDP2, tensor parallelism alone and as dp x tp, the pipeline
with GPipe and 1F1B, local SGD, evaluation and the asynchronous server (test_gpu.py), calibration (test_gpu.py).
"""

import os

import pytest

import dtlab
from dtlab.config.placement import machine_gpus

NGPU, NCCL = machine_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        NGPU == 0, reason="needs CUDA: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    ),
]

BASE = dict(device="cuda", steps=4, warmup=1, batch_size=8, seq_len=32, baseline_steps=0)
WITH_REFERENCE = dict(reference=True, dropout=0.0)
RUNS = {
    "fp16": dict(comm_hook="fp16", baseline_steps=2, bucket_mb=0.05),
    "powersgd": dict(comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=2, bucket_mb=0.05, steps=5),
    "accumulate": dict(accumulate=4, baseline_steps=2),
    "straggler": dict(straggler="1:+50ms", steps=6, warmup=2, bucket_mb=0.05),  # GPU compute is ms: a fixed delay
    "fsdp2": dict(strategy="fsdp2", **WITH_REFERENCE),
    "tp": dict(strategy="tp", **WITH_REFERENCE),
    "dp-tp": dict(strategy="tp", nproc=4, dp_degree=2, **WITH_REFERENCE),
    # device 'auto': where gloo would carry them (one GPU, NCCL < 2.30) pipelines run on CPU, since gloo cannot send
    # a CUDA tensor point to point (dtlab.config.placement); with NCCL they run on the GPUs
    "pp-gpipe": dict(strategy="pp", microbatches=4, device="auto", **WITH_REFERENCE),
    "pp-1f1b": dict(strategy="pp", microbatches=4, pp_schedule="1f1b", device="auto", **WITH_REFERENCE),
}
KILL = "1:3:kill"  # rank 1 dies at the start of step 3; checkpoints every 2 steps, one restart allowed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: Run or the exception its launch or wait raised}: every config above, and a killed-and-resumed run."""
    root = tmp_path_factory.mktemp("gpu-strategies")
    handles, out = {}, {}
    for name, kw in RUNS.items():
        try:
            handles[name] = dtlab.launch(dtlab.tiny(**{**BASE, **kw}, out=str(root / name)))
        except Exception as e:  # noqa: BLE001 - one refused config must not hide the others
            out[name] = e
    old = os.environ.get("DTLAB_FAULT")
    os.environ["DTLAB_FAULT"] = KILL  # launch() hands the environment to torchrun
    try:
        handles["resumed"] = dtlab.launch(
            dtlab.tiny(**{**BASE, "baseline_steps": 2}, checkpoint_every=2, max_restarts=1, out=str(root / "resumed"))
        )
    finally:
        os.environ.pop("DTLAB_FAULT") if old is None else os.environ.update(DTLAB_FAULT=old)
    for name, h in handles.items():
        try:
            out[name] = h.wait(progress=False)
        except Exception as e:  # noqa: BLE001
            out[name] = e
    return out


def _ok(runs, name):
    run = runs[name]
    if isinstance(run, Exception):
        pytest.fail(f"{name}: {type(run).__name__}: {run}")
    assert run.status["state"] == "finished", name
    if RUNS.get(name, {}).get("strategy") == "pp" and run.resolved["backend"] == "gloo":
        assert run.resolved["device_type"] == "cpu" and "cannot use gloo on CUDA" in run.resolved["placement"]["label"]
        return run
    assert run.resolved["device_type"] == "cuda", name
    assert run.resolved["optimizer"]["runs"] == "foreach"  # CUDA's default AdamW path, the one that broke tp
    return run


def test_fp16_compression_halves_the_bytes_on_the_wire(runs):
    run = _ok(runs, "fp16")
    b = run.buckets[run.buckets["step"] >= 0]
    assert (b["wire_bytes"] * 2 == b["nbytes"]).all()
    assert run.summary().set_index("quantity").loc["T_step", "value"] > 0


def test_powersgd_compresses_after_its_start_iteration(runs):
    run = _ok(runs, "powersgd")
    b = run.buckets
    per = b.groupby("step")[["nbytes", "wire_bytes"]].sum()
    assert (per.loc[per.index >= 2, "wire_bytes"] < per.loc[per.index >= 2, "nbytes"]).all()
    assert (per.loc[per.index < 2, "wire_bytes"] == per.loc[per.index < 2, "nbytes"]).all()


def test_accumulation_all_reduces_once_per_optimizer_step(runs):
    run = _ok(runs, "accumulate")
    per = run.buckets.groupby(["rank", "step"])["nbytes"].sum()
    assert (per == run.resolved["grad_bytes"]).all()  # one all-reduce of every gradient per step, not four


def test_a_straggler_makes_the_others_wait_on_cuda(runs):
    run = _ok(runs, "straggler")
    from dtlab.results.stragglers import run_waits, wait_summary

    s = wait_summary(run_waits(run)).set_index("rank")
    assert s.loc[0, "waited_for"] == 1 and s.loc[0, "wait_s"] > 0.025 > s.loc[1, "wait_s"], s  # of a 50 ms delay
    assert s.loc[1, "straggle_s"] == pytest.approx(0.050, abs=0.01)


def test_a_killed_rank_resumes_from_its_checkpoint_on_cuda(runs):
    run = _ok(runs, "resumed")
    assert run.status["restarts"] == 1
    assert set(run.restarts["resumed_from"]) == {2} and set(run.restarts["checkpoint"]) == {"step-2"}
    for rank in (0, 1):
        assert sorted(run.steps[run.steps["rank"] == rank]["step"]) == list(range(BASE["steps"]))
    ck = run.checkpoints
    assert (ck["nbytes"] > 0).all() and len(ck) >= 2


@pytest.mark.parametrize("name", ["fsdp2", "tp", "dp-tp", "pp-gpipe", "pp-1f1b"])
def test_model_parallel_strategies_train_like_one_process_on_cuda(runs, name):
    run = _ok(runs, name)
    check = run.reference_check()
    assert check.ok, check.why
    s = run.summary().set_index("quantity")
    assert s.loc["T_step", "value"] > 0


def test_pipelines_record_every_send_and_receive_on_cuda(runs):
    for name in ("pp-gpipe", "pp-1f1b"):
        run = _ok(runs, name)
        c = run.collectives[run.collectives["op"].isin(["send", "recv"])]
        assert c["t_end"].notna().all(), name  # none left open, whatever the backend returned
        per = c.groupby(["op"])["nbytes"].sum() / BASE["steps"]
        expected = run.resolved["expected_bytes_per_step"]
        assert per["send"] == expected["send"] and per["recv"] == expected["recv"], (name, per, expected)
