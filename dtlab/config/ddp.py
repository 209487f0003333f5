"""The options only DDP's rank loop reads (`RunConfig.ddp`): its bucket cap and gradient accumulation. Pure. (The no-op
hook baseline steps and the profiler, which the one training loop reads, are dtlab.config.measurement's.)

Strategies 'ddp' and 'ps' (and local SGD, which shares DDP's loop) read them; the rules that say which strategy may
set which are dtlab.config.rules, from each strategy's spec (dtlab.config.strategies).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.config.options import label
from dtlab.config.validate import finite, int_at_least

MAX_BUCKET_MB = 1024 * 1024  # 1 TiB


@dataclass(kw_only=True)
class DDPConfig:
    """DDP's own options (`RunConfig.ddp`; flat names bucket_mb, accumulate)."""

    bucket_mb: float = 25.0
    """DDP gradient bucket cap in MiB (DDP's bucket_cap_mb; 1 MiB = 1,048,576 bytes)."""
    accumulate: int = 1
    """Micro-batches per optimizer step: the first accumulate - 1 run under DDP's no_sync() (no communication),
    the last all-reduces the accumulated gradients. Strategy 'ddp' only."""

    def validate(self) -> None:
        """Each field on its own (ValueError naming it); dtlab.config.rules checks them against the strategy."""
        # 1 TiB: any larger cap is one bucket anyway, and int(bucket_mb * 2**20) must stay a sane integer.
        finite(label("ddp", "bucket_mb"), self.bucket_mb, "(MiB)", low=0.0, high=MAX_BUCKET_MB)
        int_at_least(label("ddp", "accumulate"), self.accumulate, 1)
