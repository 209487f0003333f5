"""The levers that shrink or hide T_comm besides buckets: gradient compression through torch's own
DDP comm hooks, and communicating once per `accumulate` micro-batches. Pure: checked before launch.

- fp16 / bf16 (`default_hooks.fp16_compress_hook`, `bf16_compress_hook`): each bucket is cast to 16 bits and
  divided by p before the all-reduce and cast back after: exactly half the bytes on the wire;
- powersgd (`powerSGD_hook`): each n x m gradient matrix whose rank-r factors are at least 2x smaller
  (torch's min_compression_rate) travels as P (n x r) and Q (m x r); other tensors (biases, LayerNorm) are
  all-reduced uncompressed. Plain all-reduce for the first `powersgd_start_iter` steps;
- accumulate K: K micro-batches per optimizer step, K - 1 of them under `ddp.no_sync()`: one all-reduce round
  per K micro-batches, so T_comm per sample drops by K while the compute per sample stays.

`CompressionConfig` is the options group `RunConfig.compression` (hook, powersgd_rank, powersgd_start_iter; flat
names comm_hook, powersgd_rank, powersgd_start_iter: dtlab.config.options). `accumulate` is read by every synchronous
update's batch size and stays a RunConfig field. `wire_factor(name)` is the model's r for the 16-bit hooks (bytes
on the wire / gradient bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.config.options import label
from dtlab.config.validate import choice, int_at_least

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass(kw_only=True)
class CompressionConfig:
    """Gradient compression through torch's DDP comm hooks (`RunConfig.compression`; strategy 'ddp')."""

    hook: str = "none"
    """How DDP reduces each gradient bucket: 'none' (fp32 all-reduce, averaged), 'fp16' or 'bf16' (torch's
    fp16_compress_hook / bf16_compress_hook: half the bytes on the wire), 'powersgd' (torch's PowerSGD: an n x m
    gradient travels as (n + m) x powersgd_rank numbers). Strategy 'ddp' only; see dtlab.config.compression."""
    powersgd_rank: int = 1
    """PowerSGD's matrix approximation rank r (comm_hook 'powersgd')."""
    powersgd_start_iter: int = 2
    """PowerSGD all-reduces uncompressed for this many steps first (DDP rebuilds its buckets after step 0;
    torch requires at least 2 with error feedback)."""

    def validate(self) -> None:
        """Each field on its own (ValueError naming it); dtlab.config.rules checks them against the run."""
        choice(label("compression", "hook"), self.hook, COMM_HOOKS)
        int_at_least(label("compression", "powersgd_rank"), self.powersgd_rank, 1)
        int_at_least(label("compression", "powersgd_start_iter"), self.powersgd_start_iter, 2)


def wire_factor(comm_hook: str) -> float | None:
    """Bytes on the wire / gradient bytes for a hook whose ratio is fixed (none 1, fp16 and bf16 1/2); None
    for powersgd, whose ratio depends on the shapes and the rank (it is measured per bucket)."""
    return {"none": 1.0, "fp16": 0.5, "bf16": 0.5}.get(comm_hook)
