"""`profile=True`: record a PyTorch profiler (Kineto) trace of the measured steps, one file per rank.

The profiler runs with a schedule: it waits through the warm-up steps, warms itself up on the last of them and
records every later step (training steps and the no-op-hook baseline steps interleaved with them), one
ProfilerStep per step. Each rank writes RUN_DIR/profiler/rank{r}.json.gz when the steps are over; rank 0 also
writes profiler/steps.json, which maps each ProfilerStep number to the run's step (and the training step a
baseline step is paired with), so `dtlab.load_trace(RUN_DIR)` answers in the run's own step numbers.

Shapes are recorded (record_shapes) because gloo's collectives carry their sizes only as "Input Dims". The
profiler costs time on every recorded step: a profiled run's T_step is not the unprofiled run's.
"""

from __future__ import annotations

import json
import os

import torch.profiler as tp


class StepProfiler:
    """Wraps torch.profiler for a rank's step loop: `begin(step, paired)` at the top of every iteration,
    `finish()` after the loop. Does nothing when `profile` is False."""

    def __init__(self, profile: bool, warmup: int, run_dir: str, rank: int, device, order):
        """`profile`: record at all (the run's `profile`); `warmup`: the run's warm-up steps, which are not
        recorded; `order`: the loop's (step, paired) iterations (dtlab.config.baseline.run_order)."""
        self.active = bool(profile)
        self.i = 0
        if not self.active:
            return
        order = list(order)
        measured = [i for i, (step, paired) in enumerate(order) if paired is None and step >= warmup]
        first = measured[0] if measured else 0
        self.folder = os.path.join(run_dir, "profiler")
        os.makedirs(self.folder, exist_ok=True)
        self.path = os.path.join(self.folder, f"rank{rank}.json.gz")
        if rank == 0:
            with open(os.path.join(self.folder, "steps.json"), "w") as f:
                json.dump({str(i): [int(s), p] for i, (s, p) in enumerate(order)}, f)
        acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sched = tp.schedule(
            wait=max(0, first - 1), warmup=1 if first else 0, active=max(1, len(order) - first), repeat=1
        )
        self.prof = tp.profile(
            activities=acts,
            schedule=sched,
            record_shapes=True,
            on_trace_ready=lambda p: p.export_chrome_trace(self.path),
        )

    def begin(self, step: int, paired) -> None:
        """Start the profiler's next step (ProfilerStep#i is the i-th iteration of the loop); the profiler itself
        starts with the first."""
        if self.active:
            if self.i:
                self.prof.step()
            else:
                self.prof.start()
            self.i += 1

    def finish(self) -> None:
        """Stop the profiler; the trace is written now (the schedule's last active step has ended)."""
        if self.active:
            self.prof.stop()
            self.active = False
