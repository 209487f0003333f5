"""Inside a rank: inject the straggler delay that `RunConfig.stragglers.slow` asks of this rank (see
dtlab.config.stragglers for the spec and the rule). A strategy's step loop calls, per step:

    straggler.begin_step()                    # at the step start
    slept_s = straggler.pause()               # after the (last) forward pass, before its backward
    straggler.observe(step, compute_s)        # after the step: this step's compute without the delay, or None

and writes `straggle_s=slept_s` into its step event. On a rank that is not slowed every call costs nothing.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

import torch

from dtlab.config.stragglers import HISTORY_STEPS, parse_straggler, straggler_plan


class Straggler:
    """One rank's injected delay per step (s): fixed, or (FACTOR - 1) x the rank's own recent compute. `plan` is
    what config.json records of the whole run's stragglers (dtlab.config.stragglers.straggler_plan)."""

    def __init__(self, spec: str | None, rank: int, world: int, device=None):
        self.entry = parse_straggler(spec, world).get(rank) if spec else None
        self.plan = straggler_plan(spec, world)
        self.cuda = device is not None and getattr(device, "type", "cpu") == "cuda"
        self.device = device
        self._history: deque[float] = deque(maxlen=HISTORY_STEPS)
        self._t0 = 0.0

    @property
    def active(self) -> bool:
        """True when this rank is slowed."""
        return self.entry is not None

    def begin_step(self) -> None:
        """Mark the step start (wall clock, s): the FACTOR rule's fallback measures the forward from here."""
        if self.active:
            self._t0 = time.perf_counter()

    def delay_s(self, so_far_s: float) -> float:
        """The delay to inject now (s), given the seconds this step has run so far (its forward)."""
        if self.entry is None:
            return 0.0
        if self.entry.delay_ms is not None:
            return self.entry.delay_ms / 1e3
        compute = statistics.median(self._history) if self._history else 3.0 * so_far_s
        return (self.entry.factor - 1.0) * compute

    def pause(self) -> float:
        """Sleep this step's delay; returns the seconds actually slept (wall clock), 0.0 on other ranks."""
        if self.entry is None:
            return 0.0
        if self.cuda:  # let the queued forward finish first, so the GPU idles for the whole delay
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        d = self.delay_s(t - self._t0)
        if d > 0:
            time.sleep(d)
        return time.perf_counter() - t if d > 0 else 0.0

    def observe(self, step: int, compute_s: float | None) -> None:
        """Remember this step's compute (s, the delay excluded) for the FACTOR rule; step 0 (allocation, DDP's
        first-iteration bucket) and steps without a measurement (None) are skipped."""
        if self.entry is not None and step >= 1 and compute_s is not None and compute_s > 0:
            self._history.append(float(compute_s))


def ddp_compute_s(buckets: list[dict], t_opt: float, straggle_s: float) -> float | None:
    """A DDP step's compute on this rank without the injected delay (s): until its last bucket was ready
    (forward + backward compute, every bucket being issued asynchronously) plus the optimizer, minus the
    delay. None when no bucket was recorded (no-op baseline steps)."""
    ready = [b["t_ready"] for b in buckets if b.get("t_ready") is not None]
    return max(ready) + t_opt - straggle_s if ready else None
