"""Setting DeepSpeed up for a ZeRO-3 rank: importing it for the run's backend (`import_deepspeed`) and the
DeepSpeed config built from cfg.zero (`ds_config`), with the "auto" knobs sized from the model's hidden size
(`model_hidden_size`, `zero_auto`, AUTO_RULE).

CPU path (tested): DS_ACCELERATOR=cpu before deepspeed is imported, gloo, and DeepSpeed's shared-memory comm
op build patched out. GPU path: DS_ACCELERATOR=cuda, NCCL or gloo on CUDA tensors, LOCAL_RANK = the GPU index.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

from dtlab.config.run import RunConfig


def import_deepspeed(device_type: str):
    """Import deepspeed for ranks on `device_type` ('cuda' -> its CUDA accelerator, 'cpu' -> its CPU
    accelerator) and return it.

    The accelerator is chosen once, at import, from DS_ACCELERATOR; auto-detection would pick CUDA for a CPU
    run on a GPU machine, whose tensors then live on the wrong device. On CUDA the collectives go through the
    process group dtlab made, NCCL or gloo (gloo takes CUDA tensors and stages them through host memory).
    """
    want = "cuda" if device_type == "cuda" else "cpu"
    if "deepspeed" in sys.modules and os.environ.get("DS_ACCELERATOR") not in (None, want):
        raise RuntimeError(
            f"deepspeed was already imported with DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}, "
            f"ranks on {device_type!r} need {want!r}"
        )
    os.environ["DS_ACCELERATOR"] = want
    # torch 2.13 deprecates the two collectives ZeRO-3 issues for every bucket (in favour of *_single), and
    # the warning otherwise repeats through each rank's log.
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
        r"is deprecated",
    )
    import deepspeed

    # The CPU accelerator JIT-compiles a shared-memory comm op (about 30 s of g++ on first use) that only
    # inference_all_reduce uses; training never needs it on either accelerator. importlib, not
    # `import deepspeed.comm.torch`: deepspeed.comm re-exports the name `torch`, so that statement binds the
    # real torch module and the patch would land there.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    return deepspeed


def remap_local_rank(device) -> int:
    """Give DeepSpeed the rank's GPU index as LOCAL_RANK; returns torchrun's LOCAL_RANK.

    DeepSpeed takes its device from LOCAL_RANK (the engine's set_device, ZeRO-3's partitioning device), so two
    ranks sharing cuda:0 would otherwise ask for cuda:0 and cuda:1. torchrun's value is kept in
    DTLAB_TORCHRUN_LOCAL_RANK. Nothing changes where each rank has a GPU of its own (the index is the local rank).
    """
    local = int(os.environ.get("DTLAB_TORCHRUN_LOCAL_RANK", os.environ.get("LOCAL_RANK", "0")))
    os.environ["DTLAB_TORCHRUN_LOCAL_RANK"] = str(local)
    if getattr(device, "type", None) == "cuda":
        os.environ["LOCAL_RANK"] = str(device.index)
    return local


def model_hidden_size(model) -> int:
    """The hidden size h the "auto" ZeRO knobs are sized from (DistilBERT: config.dim, 768)."""
    conf = getattr(model, "config", None)
    for name in ("hidden_size", "dim", "d_model", "n_embd"):
        h = getattr(conf, name, None)
        if isinstance(h, int) and h > 0:
            return h
    raise ValueError(
        f"cannot read the hidden size of {type(model).__name__} to size the ZeRO knobs; "
        "set zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size and "
        "zero.stage3_param_persistence_threshold explicitly"
    )


AUTO_RULE = (
    "Hugging Face's DeepSpeed 'auto' rule with h = the model's hidden size: reduce_bucket_size = h^2, "
    "stage3_prefetch_bucket_size = int(0.9 h^2), stage3_param_persistence_threshold = 10 h"
)


def zero_auto(cfg: RunConfig, hidden: int) -> dict:
    """Which knobs were left to auto, what they resolved to, and the rule (recorded in run.resolved)."""
    z = cfg.zero
    return {
        "hidden_size": hidden,
        "rule": AUTO_RULE,
        "resolved": z.resolve(hidden),
        "auto_fields": [k for k in z.AUTO_FIELDS if getattr(z, k) is None],
    }


def ds_config(cfg: RunConfig, world: int, hidden: int | None = None) -> dict:
    """The DeepSpeed config for `cfg`: ZeRO stage 3 with cfg.zero's knobs, fp32, no gradient clipping.

    Knobs left None ("auto") are sized from the model's hidden size `hidden` (see AUTO_RULE); `hidden` may
    be omitted only when every sized knob is explicit. The optimizer is passed to `deepspeed.initialize` as a
    client torch.optim.AdamW (same math as the DDP path); DeepSpeed's FusedAdam / CPUAdam would JIT-compile
    C++ ops.
    """
    z = cfg.zero
    if hidden is None:
        missing = [k for k in z.AUTO_FIELDS if getattr(z, k) is None]
        if missing:
            raise ValueError(f"ds_config needs the model's hidden size to resolve auto zero.{missing[0]}")
        hidden = 1
    sized = z.resolve(hidden)
    zero = {
        "stage": 3,
        **sized,
        "stage3_max_reuse_distance": z.stage3_max_reuse_distance,
        "overlap_comm": z.overlap_comm,
    }
    conf = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": cfg.batch_size * world,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
    }
    return conf
