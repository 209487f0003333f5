"""Checkpoint and restart fields, checked before launch (the rank side is dtlab.rank.restarts; the timeline a
restarted run leaves is read by dtlab.results.restarts)."""

from __future__ import annotations

from dtlab.config.validate import int_at_least
from dtlab.config.strategies import strategy_spec


def validate_restarts(cfg) -> None:
    """Refuse bad checkpoint / restart settings by name before launch (ValueError)."""
    int_at_least("checkpoint_every", cfg.checkpoint_every, 0)
    int_at_least("max_restarts", cfg.max_restarts, 0)
    if cfg.checkpoint_every > cfg.steps:
        raise ValueError(
            f"checkpoint_every must be <= steps ({cfg.steps}) so that a checkpoint is written "
            f"(0 turns checkpoints off), got {cfg.checkpoint_every}"
        )
    spec = strategy_spec(cfg.strategy)
    if (cfg.checkpoint_every or cfg.max_restarts) and not spec.checkpoints:
        field = "checkpoint_every" if cfg.checkpoint_every else "max_restarts"
        raise spec.refuse(
            field, getattr(cfg, field), "its rank loop does not save or resume torch.distributed.checkpoint state"
        )
    if cfg.max_restarts and getattr(cfg, "nnodes", 1) > 1:
        raise ValueError(
            "max_restarts applies to single-node runs (nnodes 1): a restarted attempt keys its "
            "rendezvous by the restart count, which every node's agent would have to agree on; "
            "use checkpoint_every and relaunch the job instead"
        )
    if cfg.checkpoint_every and cfg.comm_hook == "powersgd":
        raise ValueError(
            "checkpoint_every with comm_hook 'powersgd' is refused: PowerSGD's error-feedback state "
            "is not checkpointed, so a resumed run would not continue the same training; use "
            "comm_hook 'none', 'fp16' or 'bf16'"
        )
