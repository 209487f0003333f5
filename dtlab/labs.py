"""Small helpers the lab notebooks share (so no helper is copy-pasted between notebooks)."""

from __future__ import annotations

import os

from dtlab.config import RunConfig, device_count, tiny
from dtlab.course.replay import recorded_machine, replay_root


def quick_mode() -> bool:
    """True when DTLAB_QUICK=1: labs use the tiny model and few steps (tests, Binder, a first look). When
    grading a submission (DTLAB_REPLAY), the mode its runs were recorded in."""
    rec = recorded_machine()
    if rec is not None:
        return rec["quick"]
    return os.environ.get("DTLAB_QUICK", "0") == "1"


def _gpus() -> int:
    """GPUs of this machine, or of the recorded machine when grading a submission (DTLAB_REPLAY)."""
    rec = recorded_machine()
    return rec["gpus"] if rec is not None else device_count()


def lab_config(**overrides) -> RunConfig:
    """The config a lab starts from: DistilBERT on whatever this machine has, or the tiny preset in quick
    mode. Ranks: one per GPU and at least 2 (on a 1-GPU machine the 2 ranks share it, see
    `dtlab.placement`); 2 gloo ranks on a machine without a GPU."""
    if quick_mode():
        return tiny(**{"bucket_mb": 0.05, "steps": 4, "baseline_steps": 2, **overrides})
    ngpu = _gpus()
    base = dict(model="distilbert", nproc=max(2, ngpu), steps=8, warmup=2, baseline_steps=3,
                batch_size=32 if ngpu else 8, seq_len=128 if ngpu else 64, bucket_mb=25.0)
    base.update(overrides)
    cfg = RunConfig(**base)
    if "nproc" not in overrides and cfg.strategy == "zero3" and ngpu:
        placed = cfg.placement()
        if placed.backend == "gloo":  # DeepSpeed's CUDA accelerator needs NCCL: one rank per GPU then
            cfg = cfg.replace(nproc=ngpu, out=cfg.out)
    return cfg


def machine_banner(cfg: RunConfig | None = None) -> str:
    """What this machine offers and where a lab's ranks will run (GPUs or CPU, which backend, what that
    means for the numbers), so every lab states it before it measures anything."""
    cfg = cfg or lab_config()
    rec = recorded_machine()
    if rec is not None:
        return (f"grading from recorded runs ({replay_root()}): recorded on {rec['gpus']} CUDA GPU(s), "
                f"{'quick' if rec['quick'] else 'full'} mode; nothing is run again.")
    placed = cfg.placement()
    timer = "CUDA events" if placed.device == "cuda" else "wall clocks"
    ngpu = device_count()
    head = f"{ngpu} CUDA GPU(s)" if ngpu else f"no GPU, {os.cpu_count()} CPU cores"
    return f"{head}: {placed.label}; timed with {timer}." + (f" Note: {placed.note}." if placed.note else "")
