"""The optimizer of dtlab's own training loops: AdamW at the run's learning rate, scaled with the batch and warmed up
by the rule of dtlab.config.convergence (`lr_scaling`, `base_batch`, `warmup_steps`), through torch's LambdaLR.

The scheduler steps once after each optimizer step (torch's order: `opt.step()` then `sched.step()`), so optimizer
step s uses `dtlab.config.convergence.lr_at(cfg, s)`; each step event records the lr it used (`lr`).
"""

from __future__ import annotations

import torch

from dtlab.config.convergence import peak_lr, warmup_factor


class Optimizer:
    """AdamW with the run's schedule: `step()` steps both, `lr` is what the next optimizer step uses."""

    def __init__(self, cfg, params):
        self.opt = torch.optim.AdamW(params, lr=peak_lr(cfg))
        warm = cfg.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: warmup_factor(s, warm))

    @property
    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])

    def resume_at(self, step: int) -> None:
        """Continue the schedule at optimizer step `step` (a run resumed from a checkpoint): the scheduler's
        state is not in the checkpoint, and the rule gives it back."""
        if step:
            self.sched.last_epoch = step
            for group, base in zip(self.opt.param_groups, self.sched.base_lrs):
                group["lr"] = base * self.sched.lr_lambdas[0](step)

    def step(self) -> None:
        self.opt.step()
        self.sched.step()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)
