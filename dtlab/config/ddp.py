"""The options only DDP's rank loop reads (`RunConfig.ddp`): its bucket cap, gradient accumulation, the no-op hook
baseline steps that measure T_comp, and the profiler over the measured steps. Pure.

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
    """DDP's own options (`RunConfig.ddp`; flat names bucket_mb, accumulate, baseline_steps, profile)."""

    bucket_mb: float = 25.0
    """DDP gradient bucket cap in MiB (DDP's bucket_cap_mb; 1 MiB = 1,048,576 bytes)."""
    accumulate: int = 1
    """Micro-batches per optimizer step: the first accumulate - 1 run under DDP's no_sync() (no communication),
    the last all-reduces the accumulated gradients. Strategy 'ddp' only."""
    baseline_steps: int | None = None
    """Extra steps with DDP's no-op comm hook that measure T_comp, interleaved with the timed ones: each runs right
    after the measured step it is paired with (dtlab.config.baseline) and leaves the training untouched. None: one
    after each measured step, at least 3 and at most 8 (dtlab.config.baseline.auto_baseline_steps), for strategies
    'ddp' and 'ps'; 0 for every other strategy (none has a no-op baseline)."""
    profile: bool = False
    """Record a PyTorch profiler (Kineto) trace of the measured steps, one file per rank in RUN_DIR/profiler/
    (strategy 'ddp'); `dtlab.load_trace(RUN_DIR)` reads it (dtlab.rank.profiling). The profiler slows the steps."""

    def validate(self) -> None:
        """Each field on its own (ValueError naming it); dtlab.config.rules checks them against the strategy."""
        # 1 TiB: any larger cap is one bucket anyway, and int(bucket_mb * 2**20) must stay a sane integer.
        finite(label("ddp", "bucket_mb"), self.bucket_mb, "(MiB)", low=0.0, high=MAX_BUCKET_MB)
        int_at_least(label("ddp", "accumulate"), self.accumulate, 1)
        if self.baseline_steps is not None:
            int_at_least(label("ddp", "baseline_steps"), self.baseline_steps, 0)
        if not isinstance(self.profile, bool):
            raise ValueError(f"{label('ddp', 'profile')} must be true or false, got {self.profile!r}")
