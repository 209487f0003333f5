"""How a run measures itself beside training (`RunConfig.measurement`): the no-op hook baseline steps that measure
T_comp, and the profiler over the measured steps. Pure.

The one training loop (dtlab.rank.loop) reads them for every strategy; which strategies can honour them is each
strategy's spec (`compute_baseline`, `profiles`: dtlab.config.strategies), checked by dtlab.config.rules. Where the
baseline steps go in the run order is dtlab.config.baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.config.options import label
from dtlab.config.validate import int_at_least


@dataclass(kw_only=True)
class MeasurementConfig:
    """What a run measures beside its training steps (`RunConfig.measurement`; flat names baseline_steps,
    profile)."""

    baseline_steps: int | None = None
    """Extra steps with a no-op comm hook that measure T_comp, interleaved with the timed ones: each runs right
    after the measured step it is paired with (dtlab.config.baseline) and leaves the training untouched. None: one
    after each measured step, at least 3 and at most 8 (dtlab.config.baseline.auto_baseline_steps), for strategies
    with a no-op baseline ('ddp', 'ps'); 0 for every other strategy."""
    profile: bool = False
    """Record a PyTorch profiler (Kineto) trace of the measured steps, one file per rank in RUN_DIR/profiler/
    (strategy 'ddp'); `dtlab.load_trace(RUN_DIR)` reads it (dtlab.rank.profiling). The profiler slows the steps."""

    def validate(self) -> None:
        """Each field on its own (ValueError naming it); dtlab.config.rules checks them against the strategy."""
        if self.baseline_steps is not None:
            int_at_least(label("measurement", "baseline_steps"), self.baseline_steps, 0)
        if not isinstance(self.profile, bool):
            raise ValueError(f"{label('measurement', 'profile')} must be true or false, got {self.profile!r}")
