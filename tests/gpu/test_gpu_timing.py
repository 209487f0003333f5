"""tp, pp (GPipe and 1F1B) and fsdp2 on CUDA take their figures on the device: each step's CUDA-event figures are
checked against the host's time between the same two points with the device synchronised there (the ranks' marks
are bracketed by torch.cuda.synchronize() through the test-only hook DTLAB_MARKS_HOOK, tests/gpu/bracketed_marks.py).

A strategy that timed its steps with the host's clock alone would write figures that no bracket pair matches; one
whose events sat on the wrong stream or device would disagree with its bracket. The pipelines need NCCL for two
ranks (gloo cannot send a CUDA tensor point to point): one GPU per rank, or NCCL >= 2.30 on one GPU.
"""

import json
import os
import pathlib

import pytest

import dtlab
from dtlab.config.placement import machine_gpus, nccl_allows_shared_gpu

NGPU, NCCL = machine_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        NGPU == 0, reason="needs CUDA: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    ),
]
HOOK = f"{pathlib.Path(__file__).resolve().parent / 'bracketed_marks.py'}:rank_marks"
BASE = dict(device="cuda", steps=3, warmup=1, batch_size=8, seq_len=32, baseline_steps=0)
RUNS = {
    "tp": dict(strategy="tp"),
    "fsdp2": dict(strategy="fsdp2"),
    "pp-gpipe": dict(strategy="pp", microbatches=4),
    "pp-1f1b": dict(strategy="pp", microbatches=4, pp_schedule="1f1b"),
}
NCCL_TWO = NGPU >= 2 or nccl_allows_shared_gpu(NCCL)
#: How far a figure may lie from its bracket: the launch of the event after each synchronize, and clock reads.
ABS_S, REL = 1e-3, 0.10


def _run(tmp_path, name):
    out = tmp_path / "brackets"
    out.mkdir()
    old = {k: os.environ.get(k) for k in ("DTLAB_MARKS_HOOK", "DTLAB_BRACKETS")}
    os.environ.update(DTLAB_MARKS_HOOK=HOOK, DTLAB_BRACKETS=str(out))
    try:
        run = dtlab.run(dtlab.tiny(**{**BASE, **RUNS[name]}, out=str(tmp_path / name)), progress=False)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    pairs = [json.loads(ln) for f in sorted(out.glob("rank*.jsonl")) for ln in f.read_text().splitlines()]
    return run, pairs


@pytest.mark.parametrize(
    "name",
    [
        "tp",
        "fsdp2",
        pytest.param(
            "pp-gpipe",
            marks=pytest.mark.skipif(
                not NCCL_TWO, reason="needs CUDA and NCCL for two ranks: 2 GPUs, or NCCL >= 2.30 on one"
            ),
        ),
        pytest.param(
            "pp-1f1b",
            marks=pytest.mark.skipif(
                not NCCL_TWO, reason="needs CUDA and NCCL for two ranks: 2 GPUs, or NCCL >= 2.30 on one"
            ),
        ),
    ],
)
def test_step_figures_match_synchronize_bracketed_steps(tmp_path, name):
    run, pairs = _run(tmp_path, name)
    assert run.status["state"] == "finished" and run.resolved["device_type"] == "cuda"
    assert run.resolved["timing_method"]["method"] == "cuda_events"
    assert pairs, "no figure was read from two bracketed marks"
    bad = [p for p in pairs if abs(p["events_s"] - p["host_s"]) > ABS_S + REL * p["host_s"]]
    assert not bad, f"{name}: CUDA-event figures disagree with their synchronize brackets: {bad[:5]}"
    read = [p["events_s"] for p in pairs]
    for t in run.steps["t_step"]:  # every step's T_step is one of the bracketed figures
        assert any(abs(t - r) < 1e-9 for r in read), t
    assert (run.steps["t_step"] > 0).all()
    c = run.collectives[run.collectives["step"] >= 0].merge(run.steps[["rank", "step", "t_step"]], on=["rank", "step"])
    assert not c.empty and c["t_end"].notna().any()
    assert ((c["t_end"] <= c["t_step"] + ABS_S) | c["t_end"].isna()).all()  # ends within its step, on its clock
