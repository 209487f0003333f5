"""Local SGD (`local_sgd` H, run by strategy 'ddp'): a plain model per rank, no gradient all-reduce, the parameters
averaged after every H local steps (dtlab.rank.local_sgd). Everything else is what every data-parallel replica
shares (dtlab.rank.strategies.data_parallel): data, optimizer, straggler, checkpoints, evaluations, the bucket
recorder's facts, the no-op baseline steps (here the same compute, no hook: nothing communicates in backward).

The average runs inside the step, after the optimizer (as PostLocalSGDOptimizer.step does): the optimizer itself
ends at Mark.OPTIM, the average at Mark.OPT, so t_opt holds the average and a baseline step's t_opt only the
optimizer's time. Each average is a `collective` event; `params` digests, taken outside the timed step, show the
ranks agreeing after each average and drifting apart between averages.
"""

from __future__ import annotations

import contextlib
import time

from dtlab.rank.local_sgd import LocalSGD, digest_due
from dtlab.rank.recorder import Mark
from dtlab.rank.strategies.data_parallel import DataParallel


class LocalSGDStrategy(DataParallel):
    """Local SGD on the shared data-parallel replica (see the module docstring)."""

    nccl_timing = False  # no bucket is communicated: nothing for NCCL to time

    def wrap(self, model, device):
        """The plain model, with the averager that makes every rank start from rank 0's parameters."""
        self.local = LocalSGD(model, self.ctx.cfg.sync.local_sgd, self.ctx.world, device, self.marks)
        self.averaged = None
        return model

    def accumulating(self, no_sync: bool):
        """Nothing to hold back: no micro-batch communicates."""
        return contextlib.nullcontext()

    def optimizer_step(self, step: int) -> None:
        """The optimizer (Mark.OPTIM), then the parameters' average when due (Mark.OPT)."""
        self.optim.step()
        self.opt.zero_grad(set_to_none=False)
        self.clock.mark(Mark.OPTIM)
        self.averaged = self.local.after_step(step)
        self.clock.mark(Mark.OPT)

    def sync_records(self, step: int, baseline: bool) -> None:
        """The average's `collective` event, and the parameters' digest when due (not timed)."""
        cfg, writer, rank = self.ctx.cfg, self.ctx.writer, self.ctx.rank
        averaged = None if baseline else self.averaged
        if averaged:
            writer.write("collective", rank=rank, step=step, **self.local.seconds(averaged, self.step_start))
        if not baseline and digest_due(step, cfg.sync.local_sgd, cfg.steps - 1):  # do the ranks agree?
            t0 = time.perf_counter()
            self.local.digest_event(writer, rank, step, averaged=averaged is not None)
            self.ctx.train_clock.exclude(time.perf_counter() - t0)
