"""The GPU suite: real NCCL / CUDA runs of the tiny model. `python -m pytest -m gpu -rs`.

Every test is marked `gpu` and skips, with a reason naming CUDA, on a machine without a CUDA GPU (the CPU suite
and CI). On a GPU machine (`tools/gpu_runbook.py suite` runs it) each test checks what only a GPU can show: the
DDP hook's CUDA events, NCCL's own timing against them (with 2 or more NCCL ranks: one rank launches no
kernel), gloo ranks sharing a GPU or spread over two with their end marks on their own GPU, ZeRO-3 on one NCCL
rank and on 2 ranks of one GPU, calibration on CUDA, lab 01 on the GPU, and the convergence levers (evaluation,
local SGD, the asynchronous server) on CUDA tensors.
"""

import os
import pathlib

import pytest

import dtlab
from dtlab.config.placement import device_count, machine_gpus, nccl_allows_shared_gpu

NGPU, NCCL = machine_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        NGPU == 0, reason="needs CUDA: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    ),
]


def _ddp_checks(run):
    """What must hold for any DDP run: every gradient byte all-reduced once per rank and step, events
    ordered, the placement recorded as CUDA."""
    assert run.status["state"] == "finished"
    assert run.resolved["device_type"] == "cuda" and run.resolved["placement"]["device"] == "cuda"
    grad = run.resolved["grad_bytes"]
    per = run.buckets.groupby(["rank", "step"])["nbytes"].sum()
    assert len(per) == run.nproc * run.config.steps and (per == grad).all()
    b = run.buckets
    assert (b["t_ready"] <= b["t_start"]).all() and (b["t_start"] <= b["t_end"]).all()
    assert (b["t_ready"] >= 0).all()
    st = run.steps.set_index(["rank", "step"])["t_step"]
    assert all(r.t_end <= st[(r.rank, r.step)] + 1e-4 for r in b.itertuples())  # within the step (+0.1 ms)


def test_ddp_one_nccl_rank_records_buckets(tmp_path):
    """One NCCL rank: the hook, its CUDA events and NCCL's timer work; durations are not compared (a 1-rank
    in-place sum launches no kernel, so NCCL's own duration is about 0)."""
    run = dtlab.run(
        dtlab.tiny(nproc=1, backend="nccl", out=str(tmp_path / "r"), steps=5, baseline_steps=2, bucket_mb=0.05),
        progress=False,
    )
    _ddp_checks(run)
    assert run.resolved["backend"] == "nccl" and run.resolved["bucket_timing"]["path"] == "nccl"
    measured = run.buckets[run.buckets["step"] >= run.warmup]
    assert measured["backend_ms"].notna().all(), "TORCH_NCCL_ENABLE_TIMING did not give NCCL durations"
    row = run.crosscheck().set_index("quantity").loc["bucket all-reduce duration vs NCCL"]
    assert row["pairs"] == 0 and "one rank" in row["what"]


@pytest.mark.skipif(
    NGPU < 2 and not nccl_allows_shared_gpu(NCCL),
    reason=f"needs CUDA with 2 NCCL ranks: 2 GPUs, or NCCL >= 2.30 on one (GPUs: {NGPU}, NCCL: {NCCL})",
)
def test_ddp_two_nccl_ranks_agree_with_nccl(tmp_path):
    run = dtlab.run(
        dtlab.tiny(nproc=2, backend="nccl", out=str(tmp_path / "r"), steps=5, baseline_steps=2, bucket_mb=0.05),
        progress=False,
    )
    _ddp_checks(run)
    measured = run.buckets[run.buckets["step"] >= run.warmup]
    row = run.crosscheck().set_index("quantity").loc["bucket all-reduce duration vs NCCL"]
    assert row["pairs"] == len(measured)
    # dtlab's interval brackets NCCL's kernel (ready event before it, end event after it): never much shorter,
    # and not wildly longer either
    assert -0.10 <= row["median_rel_diff"] <= 1.0, row


@pytest.mark.skipif(NGPU < 2, reason="needs at least 2 CUDA GPUs for one NCCL rank per GPU")
def test_ddp_nccl_one_rank_per_gpu(tmp_path):
    run = dtlab.run(
        dtlab.tiny(nproc=NGPU, backend="nccl", out=str(tmp_path / "r"), baseline_steps=2, bucket_mb=0.05),
        progress=False,
    )
    _ddp_checks(run)
    assert run.resolved["placement"]["ranks_per_gpu"] == 1


def test_two_gloo_ranks_share_one_gpu(tmp_path):
    run = dtlab.run(
        dtlab.tiny(nproc=2, backend="gloo", device="cuda", out=str(tmp_path / "r"), baseline_steps=2, bucket_mb=0.05),
        progress=False,
    )
    _ddp_checks(run)
    assert run.resolved["backend"] == "gloo"
    assert "gloo on CUDA tensors" in run.resolved["placement"]["label"]
    assert "host memory" in run.breakdown_table()  # the banner says what it means for the numbers
    timing = run.resolved["bucket_timing"]
    assert timing["path"] == "gloo_cuda" and timing["end_stream"].startswith("dtlab's own stream"), timing


@pytest.mark.skipif(NGPU < 2, reason="needs at least 2 CUDA GPUs for gloo ranks on cuda:0 and cuda:1")
def test_gloo_ranks_on_two_gpus_time_on_their_own_gpu(tmp_path):
    """Rank 1 on cuda:1: its end marks come from gloo's thread, which has no device; recorded on cuda:0 they
    could not be compared with its step clock (elapsed_time across devices raises)."""
    run = dtlab.run(
        dtlab.tiny(nproc=2, backend="gloo", out=str(tmp_path / "r"), baseline_steps=2, bucket_mb=0.05), progress=False
    )
    _ddp_checks(run)
    assert run.resolved["placement"]["ranks_per_gpu"] == 1 and run.resolved["bucket_timing"]["path"] == "gloo_cuda"


@pytest.mark.skipif(
    not nccl_allows_shared_gpu(NCCL),
    reason=f"needs CUDA with NCCL >= 2.30 for two ranks on one GPU (NCCL here: {NCCL})",
)
def test_two_nccl_ranks_share_one_gpu(tmp_path):
    run = dtlab.run(
        dtlab.tiny(nproc=2 * NGPU, backend="nccl", out=str(tmp_path / "r"), baseline_steps=2, bucket_mb=0.05),
        progress=False,
    )
    _ddp_checks(run)
    assert run.resolved["placement"]["env"] == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}


def _zero3_checks(run):
    assert run.status["state"] == "finished" and run.resolved["device_type"] == "cuda"
    c = run.collectives[run.collectives["step"] >= 0]
    assert set(c["phase"]) >= {"forward", "backward"}
    assert c["t_end"].notna().all() and (c["t_start"] <= c["t_end"]).all()
    rs = c[c["op"] == "reduce_scatter"].groupby(["rank", "step"])["nbytes"].sum()
    assert (rs == run.resolved["expected_reduce_scatter_bytes_per_step"]).all()
    assert (run.memory["peak_kind"] == "cuda_max_allocated").all()
    s = run.summary().set_index("quantity")
    assert s.loc["T_step", "value"] > 0 and s.loc["T_comm", "value"] >= 0
    assert run.resolved["collective_timing"]["path"] == ("nccl" if run.resolved["backend"] == "nccl" else "gloo_cuda")


def test_zero3_one_nccl_rank(tmp_path):
    pytest.importorskip("deepspeed")
    run = dtlab.run(
        dtlab.tiny(strategy="zero3", nproc=1, backend="nccl", out=str(tmp_path / "z"), baseline_steps=0), progress=False
    )
    _zero3_checks(run)
    assert "partitions nothing" in run.resolved["placement"]["note"]


def test_zero3_two_ranks_on_cuda(tmp_path):
    """One GPU: what lab 4 runs there, 2 ranks on cuda:0 (gloo on CUDA tensors before NCCL 2.30, NCCL's
    multi-rank mode from it), DeepSpeed given LOCAL_RANK 0 on both. Several GPUs: ZeRO-3 over gloo on CUDA
    tensors, one rank per GPU. Every gradient sharded either way."""
    pytest.importorskip("deepspeed")
    run = dtlab.run(
        dtlab.tiny(
            strategy="zero3",
            nproc=2,
            out=str(tmp_path / "z"),
            baseline_steps=0,
            backend="auto" if NGPU == 1 else "gloo",
        ),
        progress=False,
    )
    _zero3_checks(run)
    assert run.resolved["world_size"] == 2
    m = run.memory[run.memory["peak_bytes"].notna()].set_index("rank")
    assert (m["grads_bytes"] < run.resolved["grad_bytes"] * 0.6).all()  # each rank holds about half
    if NGPU == 1:
        assert run.resolved["placement"]["ranks_per_gpu"] == 2


def test_calibration_on_cuda(tmp_path):
    """NCCL when the GPUs can host 2 ranks (else gloo on CUDA tensors): the CUDA timing path, with devices
    aligned by an all-reduce and K calls per event pair."""
    prof = dtlab.calibrate(
        nproc=2,
        ops=("all_reduce", "reduce_scatter", "all_gather"),
        sizes=[2**k for k in range(12, 25, 2)],
        iters=4,
        rounds=2,
        warmup=2,
        out=str(tmp_path / "p"),
        progress=False,
    )
    assert "CUDA events" in prof.meta["timing"] and prof.meta["calls_per_sample"] == 20
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        f = prof.fits[op]
        assert f.alpha >= 0 and f.beta > 0
    if prof.meta["backend"] == "nccl":
        assert prof.meta.get("nccl")


def test_doctor_names_the_gpus():
    from dtlab.cli.doctor import facts, report

    f = facts(check_hub=False)
    assert len(f["gpus"]) == device_count() and all(g["name"] for g in f["gpus"])
    assert "GPU 0:" in report(f)


def test_lab01_quick_mode_on_gpu(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("DTLAB_QUICK", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lab = pathlib.Path(__file__).resolve().parents[2] / "labs" / "01_ddp_breakdown.ipynb"
    nb = nbformat.read(lab, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "CUDA GPU" in text and "CUDA events" in text
    runs = list((tmp_path / "runs").iterdir())
    assert runs and dtlab.load_run(str(runs[0])).resolved["device_type"] == "cuda"
    assert os.path.exists(runs[0] / "config.json")


def test_convergence_levers_on_cuda(tmp_path):
    """Held-out evaluation on the GPU, local SGD's averages timed with CUDA events, and the asynchronous server with
    its messages through host memory (a gloo group of their own when the run's backend is NCCL)."""
    base = dtlab.tiny(steps=6, warmup=1, baseline_steps=0, batch_size=16, eval_every=3, device="cuda")
    local = dtlab.run(base.replace(out=str(tmp_path / "local"), local_sgd=3), progress=False)
    assert local.resolved["device_type"] == "cuda" and list(local.evals["step"]) == [0, 3, 6]
    avg = local.collectives[local.collectives["phase"] == "average"]
    assert sorted(set(avg["step"])) == [2, 5] and (avg["t_end"] >= avg["t_start"]).all()
    server = dtlab.run(base.replace(out=str(tmp_path / "async"), strategy="async", nproc=3), progress=False)
    u = server.updates
    assert len(u) == 12 and (u[u["applied"].astype(bool)]["staleness"] <= 2).all()
    assert server.evals["step"].iloc[-1] == int(u["applied"].sum())
