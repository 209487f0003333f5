"""The optimizer of dtlab's own training loops: AdamW at the run's learning rate, scaled with the batch and warmed up
by the rule of dtlab.config.convergence (`lr_scaling`, `base_batch`, `warmup_steps`), through torch's LambdaLR.

The scheduler steps once after each optimizer step (torch's order: `opt.step()` then `sched.step()`), so optimizer
step s uses `dtlab.config.convergence.lr_at(cfg, s)`; each step event records the lr it used (`lr`).

The rate is settled once the model is built (dtlab.config.convergence.settle_lr): an explicit `cfg.lr`, else the
default for the weights the rank got, scaled and warmed up by the rule (dtlab.config.convergence.lr_plan); every
optimizer is built from that plan (`Optimizer(replica.lr, params, cfg.optimizer_impl)`).
"""

from __future__ import annotations

import torch

from dtlab.config.convergence import LrPlan
from dtlab.rank.compat import adamw_kwargs, param_groups_by_kind


class Optimizer:
    """AdamW with the run's schedule: `step()` steps both, `lr` is what the next optimizer step uses."""

    def __init__(self, plan: LrPlan, params, impl: str = "auto"):
        self.opt = adamw(params, plan.peak, impl)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, plan.factor)

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


def adamw(params, lr: float, impl: str = "auto") -> torch.optim.AdamW:
    """AdamW over `params` at `lr` with the implementation `impl` (RunConfig.optimizer_impl): 'auto' (torch's
    default for the device: multi-tensor on CUDA, for-loop on CPU), 'foreach', 'fused' or 'for-loop'.

    Parameters are grouped by tensor kind (dtlab.rank.compat.param_groups_by_kind), so a tensor-parallel model's
    DTensors and plain tensors never share one multi-tensor or fused kernel call, which torch refuses."""
    return torch.optim.AdamW(param_groups_by_kind(params), lr=lr, **adamw_kwargs(impl))
