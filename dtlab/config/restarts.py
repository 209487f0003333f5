"""Checkpoint and restart fields, checked before launch (the rank side is dtlab.rank.restarts; the timeline a
restarted run leaves is read by dtlab.results.restarts)."""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.config.options import label
from dtlab.config.strategies import strategy_spec
from dtlab.config.validate import int_at_least


@dataclass(kw_only=True)
class RestartsConfig:
    """Checkpoints and restarts (`RunConfig.restarts`; flat names checkpoint_every, max_restarts)."""

    checkpoint_every: int = 0
    """Save a torch.distributed.checkpoint every N training steps into RUN/checkpoints/ (0: off); see
    dtlab.results.restarts."""
    max_restarts: int = 0
    """torchrun --max-restarts: restarts of a group whose rank died, each resuming from the newest checkpoint."""

    def validate(self) -> None:
        """Each field on its own (ValueError naming it); `validate_restarts` checks them against the run."""
        int_at_least(label("restarts", "checkpoint_every"), self.checkpoint_every, 0)
        int_at_least(label("restarts", "max_restarts"), self.max_restarts, 0)


def validate_restarts(cfg) -> None:
    """Refuse bad checkpoint / restart settings by name before launch (ValueError)."""
    rs = cfg.restarts
    if not isinstance(rs, RestartsConfig):
        raise ValueError(f"restarts must be a RestartsConfig or a dict of its fields, got {type(rs).__name__}")
    rs.validate()
    if rs.checkpoint_every > cfg.steps:
        raise ValueError(
            f"checkpoint_every must be <= steps ({cfg.steps}) so that a checkpoint is written "
            f"(0 turns checkpoints off), got {rs.checkpoint_every}"
        )
    spec = strategy_spec(cfg.strategy)
    if (rs.checkpoint_every or rs.max_restarts) and not spec.checkpoints:
        field = "checkpoint_every" if rs.checkpoint_every else "max_restarts"
        raise spec.refuse(
            field, getattr(rs, field), "its rank loop does not save or resume torch.distributed.checkpoint state"
        )
    if rs.max_restarts and getattr(cfg, "nnodes", 1) > 1:
        raise ValueError(
            "max_restarts applies to single-node runs (nnodes 1): a restarted attempt keys its "
            "rendezvous by the restart count, which every node's agent would have to agree on; "
            "use checkpoint_every and relaunch the job instead"
        )
    if rs.checkpoint_every and cfg.compression.hook == "powersgd":
        raise ValueError(
            "checkpoint_every with comm_hook 'powersgd' is refused: PowerSGD's error-feedback state "
            "is not checkpointed, so a resumed run would not continue the same training; use "
            "comm_hook 'none', 'fp16' or 'bf16'"
        )
