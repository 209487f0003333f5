"""The training rank's entry point, started by torchrun: `python -m dtlab.rank.worker RUN_DIR`.

Thin on purpose: the lifecycle (logs, events, errors, teardown) is dtlab.rank.lifecycle's, shared with calibration;
this module only builds the strategy class named by its spec (dtlab.config.strategies: adding a strategy means one
module with a dtlab.rank.loop.Strategy subclass and one spec there) and hands it to the one training loop.
"""

from __future__ import annotations

import importlib
import sys

from dtlab.config.ncclib import check_preloaded
from dtlab.config.placement import Placement
from dtlab.config.run import RunConfig
from dtlab.config.strategies import strategy_spec
from dtlab.rank.lifecycle import exit_rank, rank_main, read_config
from dtlab.rank.loop import RankContext, run


def _train(run_dir: str, rank: int, world: int, writer) -> None:
    cfg = RunConfig.from_dict(read_config(run_dir)["config"])
    lib = check_preloaded()  # NCCL ranks given DTLAB_NCCL_LIBRARY: this rank loaded it, or stops here
    if lib is not None:
        print(f"rank {rank}: NCCL library {lib.path}: {lib.text} (ncclGetVersion {lib.code}), preloaded", flush=True)
    train(cfg, cfg.placement(), run_dir, rank, world, writer)


def train(cfg: RunConfig, placed: Placement, run_dir: str, rank: int, world: int, writer) -> None:
    """One rank of the run `cfg`, placed as `placed` (resolved once, at the rank's entry, and handed down): the
    strategy class its spec names, on the one training loop."""
    spec = strategy_spec(cfg.strategy)
    strategy = getattr(importlib.import_module(spec.module), spec.rank_class)
    run(strategy.for_rank(RankContext(cfg, run_dir, rank, world, writer, placed, spec)))


def entry(argv: list[str]) -> int:
    """A training rank for the run directory argv[0]; returns the exit code."""
    return rank_main(argv[0], _train)


def warm(argv: list[str]) -> None:
    """Import what a rank of the run directory argv[0] will import (torch.distributed, the strategy's module,
    the model and tokenizer classes): torchrun's agent does this once before forking CPU ranks."""
    import torch.distributed  # noqa: F401

    cfg = RunConfig.from_dict(read_config(argv[0])["config"])
    importlib.import_module(strategy_spec(cfg.strategy).module)
    from dtlab.rank.data import warm_model

    warm_model()


def main(argv: list[str] | None = None) -> int:
    return entry(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    exit_rank(main())
