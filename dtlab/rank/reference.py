"""The single-process reference a parallel run is checked against: an unparallelised copy of the model, made
before the run split it, trained on each step's global batch (every replica's batch together) with the same
optimizer. After each step a rank compares the gradients it holds with the copy's (`grad_agreement`): a
tensor-parallel or FSDP2 shard through its full tensor, a pipeline stage its own layers.

`grad_agreement` is the check: the ratio <g, r> / <r, r> (1 when the gradients agree; the world size when the
ranks summed instead of averaging, as FSDP2 was reported to do on gloo,
github.com/pytorch/pytorch/issues/162338), the relative error |g - r| / |r| and the largest absolute difference.
dtlab.results.reference reads the records back: how the run agrees with one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def grad_agreement(pairs) -> dict:
    """How gradients `got` agree with `ref`, over (got, ref) tensor pairs: grad_ratio <g, r> / <r, r>,
    grad_rel_err |g - r| / |r| (2-norms over every pair), grad_max_abs_diff, ref_grad_max_abs and
    params_compared. float64 sums, so the check itself adds no rounding worth the name."""
    dot = rr = dd = 0.0
    worst = ref_max = 0.0
    n = 0
    for got, ref in pairs:
        g, r = got.detach().cpu().double().reshape(-1), ref.detach().cpu().double().reshape(-1)
        if g.shape != r.shape:
            raise ValueError(f"a gradient of {tuple(got.shape)} compared with a reference of {tuple(ref.shape)}")
        dot += float(g @ r)
        rr += float(r @ r)
        dd += float((g - r) @ (g - r))
        worst = max(worst, float((g - r).abs().max())) if g.numel() else worst
        ref_max = max(ref_max, float(r.abs().max())) if r.numel() else ref_max
        n += 1
    return {
        "grad_ratio": dot / rr if rr > 0 else float("nan"),
        "grad_rel_err": (dd / rr) ** 0.5 if rr > 0 else float("nan"),
        "grad_max_abs_diff": worst,
        "ref_grad_max_abs": ref_max,
        "params_compared": n,
    }


def full_tensor(t):
    """The whole tensor of a DTensor, or `t` itself, gathered through host memory: each mesh dimension's group
    exchanges its CPU copies (`all_gather_object`), innermost dimension first, and the pieces are joined as the
    placement says (Shard: concatenated along its dimension in rank order, uneven pieces included; Partial: summed
    or averaged; Replicate: kept). Not `DTensor.full_tensor()`: on gloo its all_gather_into_tensor hands a CUDA
    pointer to a host memcpy (github.com/pytorch/pytorch/issues/152645), and it killed FSDP2 and
    tensor-parallel ranks with SIGSEGV after their first step on an H100 (gloo on CUDA tensors, 2 ranks on
    1 GPU). The check is not timed, so the way through host memory costs nothing that is measured, and the same
    code runs on every backend and device."""
    if not isinstance(t, DTensor):
        return t
    mesh, placements = t.device_mesh, t.placements
    whole = t.to_local().detach().cpu()
    for dim in reversed(range(mesh.ndim)):
        p = placements[dim]
        if p.is_replicate():
            continue
        group = mesh.get_group(dim)
        pieces = [None] * dist.get_world_size(group)
        dist.all_gather_object(pieces, whole, group=group)
        if p.is_shard():
            whole = torch.cat(pieces, dim=p.dim)
        elif p.is_partial():
            op = str(getattr(p, "reduce_op", "sum")).lower()
            whole = torch.stack(pieces).sum(0)
            if "avg" in op:
                whole = whole / len(pieces)
            elif "sum" not in op:
                raise ValueError(f"a Partial placement reduced by {op!r}: the reference check sums or averages")
        else:
            raise ValueError(
                f"placement {p!r} on mesh dimension {dim}: the reference check knows Shard, Partial and Replicate"
            )
    return whole


class Reference:
    """An unparallelised copy of the model trained on the global batch: `per_replica[r][i]` is replica r's batch
    of step i; the reference's step i trains on all of them at once."""

    def __init__(self, model, per_replica: list, lr: float, device=None):
        # on the batches' device: the copy is taken before the run's model moves to its GPU, and a CPU copy fed
        # CUDA batches fails at its first embedding lookup (seen on an H200)
        self.model = model.to(device) if device is not None else model
        self.model.train()
        self.per_replica = per_replica
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.params = dict(self.model.named_parameters())

    def batch(self, step: int) -> dict:
        parts = [b[step % len(b)] for b in self.per_replica]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def step_and_compare(self, step: int, named_params) -> dict:
        """One reference step on step `step`'s global batch; compare `named_params` (the run's model, this rank's
        gradients after its step) with the reference's gradients. Returns ref_loss and `grad_agreement`'s dict."""
        self.opt.zero_grad(set_to_none=True)
        out = self.model(**self.batch(step))
        out.loss.backward()
        pairs = []
        for name, p in named_params:
            if p.grad is None:  # a pipeline stage holds gradients only for its own layers
                continue
            pairs.append((full_tensor(p.grad), self.params[name].grad))
        rec = {"ref_loss": float(out.loss.detach()), **grad_agreement(pairs)}
        self.opt.step()
        return rec
