"""Small helpers the lab notebooks share (so no helper is copy-pasted between notebooks)."""

from __future__ import annotations

import os

from .config import RunConfig, device_count, tiny


def quick_mode() -> bool:
    """True when DTLAB_QUICK=1: labs use the tiny model and few steps (tests, Binder, a first look)."""
    return os.environ.get("DTLAB_QUICK", "0") == "1"


def lab_config(**overrides) -> RunConfig:
    """The config a lab starts from: DistilBERT on whatever this machine has, or the tiny preset in quick
    mode. On CPU it uses 2 gloo ranks; on GPUs one rank per GPU (NCCL)."""
    if quick_mode():
        return tiny(**{"bucket_mb": 0.05, "steps": 4, "baseline_steps": 2, **overrides})
    gpus = device_count() >= 2  # NCCL needs a GPU per rank; with fewer, 'auto' runs 2 ranks on gloo (CPU)
    base = dict(model="distilbert", nproc=device_count() if gpus else 2, steps=8, warmup=2, baseline_steps=3,
                batch_size=32 if gpus else 8, seq_len=128 if gpus else 64, bucket_mb=25.0)
    base.update(overrides)
    return RunConfig(**base)


def machine_banner() -> str:
    """One line saying what this machine offers, so every lab states whether it ran on GPUs or CPU."""
    ngpu = device_count()
    if ngpu:
        return f"{ngpu} CUDA GPU(s): runs use NCCL, timed with CUDA events."
    return (f"No GPU: runs use gloo on {os.cpu_count()} CPU cores, timed with wall clocks. Compute and "
            "communication share the cores, so expect less overlap than on GPUs.")
