"""What differs between the torch versions dtlab runs on (2.11 to 2.14), in one place.

Each shim names the versions that need it and why, so that the strategies call one function instead of testing
for attributes themselves. The CI legs run the suite on torch 2.11, 2.13 and 2.14 (docs/testing.md).
"""

from __future__ import annotations

import os

import torch

# torch.distributed.tensor and torch.distributed.pipelining take seconds to import (10 s on a loaded 2-core
# machine): they are imported inside the functions below, so that a DDP rank, and torchrun's agent warming up its
# strategy module, pay for them only when an optimizer is built or a pipeline recorded.

# ---- torch.distributed.checkpoint ---------------------------------------------------------------------------


def checkpoint_bytes_written(folder: str, rank: int) -> int:
    """Bytes this rank's storage files hold in a checkpoint folder that `dcp.save` has just written.

    Measured from the files, not from `dcp.save`'s return value: torch 2.13 returns the global metadata with a
    `storage_data` map (file and length of every item), but torch 2.11 returns metadata whose `storage_data` is
    None. FileSystemWriter names each rank's files `__{rank}_{n}.distcp` on every version (2.11 to 2.14)."""
    prefix = f"__{rank}_"
    return sum(
        os.path.getsize(os.path.join(folder, n))
        for n in os.listdir(folder)
        if n.startswith(prefix) and n.endswith(".distcp")
    )


# ---- torch.distributed.pipelining ----------------------------------------------------------------------------

#: The module-level p2p helpers every schedule calls (torch 2.11 to 2.14): `_batch_p2p(ops, desc)` issues a
#: batch of sends and receives through `batch_isend_irecv`, `_wait_batch_p2p(works)` waits for them.
P2P_HELPERS = ("_batch_p2p", "_wait_batch_p2p")


def pipelining_p2p_helpers():
    """(schedules module, issue, wait), or None when this torch has no such helpers to wrap."""
    import torch.distributed.pipelining.schedules as sch

    if not all(hasattr(sch, name) for name in P2P_HELPERS):
        return None
    return sch, sch._batch_p2p, sch._wait_batch_p2p


def is_pipeline_transfer(desc) -> bool:
    """Whether a `_batch_p2p` call carries the pipeline's activations or their gradients.

    Every transfer of a micro-batch names its direction in `desc` ("fwd_send", "bwd_recv", 1F1B's fused
    "fwd_send_bwd_recv", ...). The one call without a desc is the communicator warm-up: one float each way
    between neighbouring stages (`PipelineStage._get_init_p2p_neighbors_ops`), made at construction on torch
    2.13 and 2.14 but inside the first `step()` on torch 2.11, where it would otherwise be counted as 4-byte
    traffic of step 0."""
    return bool(desc) and ("fwd" in desc or "bwd" in desc)


# ---- torch.optim.AdamW ---------------------------------------------------------------------------------------


def param_groups_by_kind(params) -> list:
    """`params` as AdamW parameter groups, one per tensor kind (DTensor, plain Tensor), in their order.

    torch's multi-tensor (`foreach`) and fused AdamW refuse a group that mixes DTensors and plain tensors
    ("aten._foreach_mul_.Scalar: got mixed torch.Tensor and DTensor", torch 2.11 to 2.14), and multi-tensor
    is what torch picks by default for CUDA tensors; a tensor-parallel model holds both (its split linear layers
    are DTensors, its embeddings and LayerNorms plain tensors). One group per kind gives the same update: every
    group has the same hyperparameters and AdamW's step is per parameter."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    kinds = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    groups = [{"params": g} for g in kinds if g]
    return groups or [{"params": params}]


def default_adamw_impl(params) -> str:
    """What torch's AdamW runs when neither `foreach` nor `fused` is given: 'foreach' when every parameter is a
    CUDA tensor (torch's `_default_to_fused_or_foreach`, 2.11 to 2.14), else 'for-loop'."""
    params = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    try:  # a private helper of torch's: a torch without it falls back to the rule below
        from torch.optim.optimizer import _default_to_fused_or_foreach

        _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    except (ImportError, TypeError):  # a private helper: fall back to its documented rule
        foreach = bool(params) and all(p.device.type == "cuda" for p in params)
    return "foreach" if foreach else "for-loop"


def adamw_kwargs(impl: str) -> dict:
    """AdamW's keyword arguments for an implementation name ('auto' leaves torch's choice alone)."""
    return {"auto": {}, "foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}[impl]


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)
