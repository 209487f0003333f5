"""The fields every job launched through torchrun shares (a training run, a calibration sweep): backend, where
it writes, how long it may take, and how its nodes meet. RunConfig and CalibConfig extend it."""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.config.nodes import validate_nodes
from dtlab.config.placement import BACKENDS
from dtlab.config.validate import choice, finite


@dataclass(kw_only=True)
class JobConfig:
    """A job's launch: backend, output folder, time limit, nodes and rendezvous (times in seconds)."""

    backend: str = "auto"
    """'auto', 'nccl' or 'gloo'. 'auto' picks NCCL when the GPUs can host the ranks (one GPU each, or two ranks
    per GPU on NCCL >= 2.30), gloo otherwise; see dtlab.config.placement for the full rule."""
    out: str | None = None
    """Directory the job writes (None: a new folder under runs/ for a run, profiles/ for a calibration)."""
    timeout_s: float = 1800.0
    """Wall-clock limit for the whole job in seconds; past it every live rank's Python stack is dumped into its log
    and every rank is stopped (RunFailed names each rank's innermost frame)."""
    nnodes: int = 1
    """Nodes (machines, one torchrun agent each) in the job, nproc ranks on each; see dtlab.config.nodes."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the c10d rendezvous, the same on every node (needed when nnodes > 1; None: local, any port)."""
    rdzv_id: str | None = None
    """Job id that every node of one job gives (None: derived from the output directory `out`)."""
    rdzv_timeout_s: float = 600.0
    """Seconds to wait for all nnodes nodes to join; past it the job fails naming the missing ones."""

    def validate_job(self) -> None:
        """Check the shared fields; ValueError naming the field and what is allowed."""
        choice("backend", self.backend, BACKENDS)
        if self.out is not None and not isinstance(self.out, str):
            raise ValueError(f"out must be a path (string) or None, got {self.out!r}")
        finite("timeout_s", self.timeout_s, "(seconds)", low=0.0)
        validate_nodes(self)
