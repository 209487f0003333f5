"""Local SGD (`local_sgd` H): each rank trains its own copy with its own AdamW, and the parameters are averaged
after every H local steps (after steps H-1, 2H-1, ...; Lin et al., "Don't use large mini-batches, use local SGD").
No gradient is all-reduced. torch's `PeriodicModelAverager(period=H, warmup_steps=0)` averages as often, one step
earlier (after steps 0, H, 2H, ...); here a run of k H steps makes exactly k averages, and an evaluation every H
steps sees the averaged model.

The average is torch's `model_averaging.utils.average_parameters` written out, so that its all-reduce is timed
alone: the parameters are flattened into one fp32 buffer and divided by p (compute), the buffer is all-reduced
(`t_start`..`t_end`, recorded as a `collective` event: op 'all_reduce', phase 'average', nbytes = every
parameter's bytes, once), and copied back. It runs inside the step, after the optimizer (as
PostLocalSGDOptimizer.step does), so T_step includes it and t_opt holds it.

`params` events say what a test needs to see that the ranks agree right after each average and drift apart between
averages: a checksum of every parameter's bits (`digest`), taken after the step's clock was read (outside the timed
step) on averaging steps, on the step before each (H >= 2) and after the last step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dtlab.rank.marks import Marks


def average_due(step: int, period: int) -> bool:
    """Average after step `step` (0-based): after every `period` local steps, steps period-1, 2 period-1, ..."""
    return period >= 1 and (step + 1) % period == 0


def digest_due(step: int, period: int, last: int) -> bool:
    """Record the parameters' digest after `step`: averaging steps, the step before each, and the last step."""
    return average_due(step, period) or (period >= 2 and average_due(step + 1, period)) or step == last


def param_digest(params) -> str:
    """A checksum of every parameter's bits (equal bits, equal digest): the int32 words of each tensor summed as
    int64 and weighted by the tensor's position, mod 2^61 - 1, in hex."""
    total, mod = 0, (1 << 61) - 1
    for i, p in enumerate(params):
        words = p.detach().contiguous().view(-1).view(torch.int32).to(torch.int64)
        pos = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
        total = (total + (i + 1) * int((words * (pos % 65521)).sum())) % mod
    return f"{total:016x}"


class LocalSGD:
    """Averages a model's parameters every `period` steps; `after_step` returns the collective it recorded."""

    def __init__(self, model, period: int, world: int, device, marks=None):
        self.params = [p for p in model.parameters()]
        self.period, self.world = period, world
        # the rank's marks (dtlab.rank.marks): the wall clock on CPU, CUDA events on the current stream on GPU
        self.marks = marks if marks is not None else Marks(device, "nccl" if device.type == "cuda" else "gloo")
        self.cuda = self.marks.cuda
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)
        with torch.no_grad():  # the same start everywhere (the seed gives it already; DDP would broadcast too)
            for p in self.params:
                dist.broadcast(p.data, src=0)

    def _mark(self):
        """A mark on the current stream (read after the step's one sync), or the wall clock on CPU."""
        return self.marks.now()

    def seconds(self, rec: dict, step_start) -> dict:
        """A record of `after_step` with its marks turned into seconds from the step start (on GPU: after the
        step's clock was read, which synchronised)."""
        return {
            **rec,
            "t_start": self.marks.seconds(step_start, rec["t_start"]),
            "t_end": self.marks.seconds(step_start, rec["t_end"]),
        }

    def after_step(self, step: int) -> dict | None:
        """Average when `step` is due; the `collective` fields with raw marks (see `seconds`), or None."""
        if not average_due(step, self.period):
            return None
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in self.params])
            flat.div_(self.world)
            t0 = self._mark()
            dist.all_reduce(flat)  # blocking on gloo; on NCCL ordered on its stream, marked by the event after it
            t1 = self._mark()
            offset = 0
            for p in self.params:
                n = p.numel()
                p.copy_(flat[offset : offset + n].view_as(p))
                offset += n
        return {
            "op": "all_reduce",
            "phase": "average",
            "nbytes": int(flat.numel() * flat.element_size()),
            "t_start": t0,
            "t_end": t1,
        }

    def digest_event(self, writer, rank: int, step: int, averaged: bool) -> None:
        writer.write(
            "params", rank=rank, step=step, averaged=averaged, digest=param_digest(self.params), time=time.time()
        )
