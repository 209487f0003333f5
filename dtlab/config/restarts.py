"""Checkpoint and restart fields, checked before launch (the rank side is dtlab.rank.restarts; the timeline a
restarted run leaves is read by dtlab.results.restarts)."""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.config.options import label
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
        """Each field on its own (ValueError naming it); dtlab.config.rules checks them against the run."""
        int_at_least(label("restarts", "checkpoint_every"), self.checkpoint_every, 0)
        int_at_least(label("restarts", "max_restarts"), self.max_restarts, 0)
