"""A calibration rank (`torchrun ... -m dtlab.rank.calibration RUN_DIR`): the sweep that dtlab.launching.calibration
configures (dtlab.rank.sweep), inside the one rank lifecycle. See dtlab.launching.calibration for how samples are timed
on gloo and CUDA.

Like dtlab.rank.worker, this entry module imports no torch: the lifecycle first ties the rank to torchrun and sends
its output to its log, and only then does the body import the sweep (torch, torch.distributed)."""

from __future__ import annotations

import sys

from dtlab.config.calibration import CalibConfig
from dtlab.config.ncclib import check_preloaded
from dtlab.rank.lifecycle import exit_rank, rank_main, read_config


def _rank_main(run_dir: str) -> int:
    """A calibration rank: the one rank lifecycle (dtlab.rank.lifecycle.rank_main) around the sweep."""

    def body(run_dir, rank, world, writer):
        lib = check_preloaded()  # NCCL ranks given DTLAB_NCCL_LIBRARY: this rank loaded it, or stops here
        if lib is not None:
            print(
                f"rank {rank}: NCCL library {lib.path}: {lib.text} (ncclGetVersion {lib.code}), preloaded", flush=True
            )
        from dtlab.rank.sweep import sweep  # torch: once the lifecycle has set the rank up (see the docstring)

        sweep(CalibConfig(**read_config(run_dir)["calibration"]), run_dir, rank, world, writer)

    return rank_main(run_dir, body)


def entry(argv: list[str]) -> int:
    """A calibration rank for the run directory argv[0]; returns the exit code."""
    return _rank_main(argv[0])


def warm(argv: list[str]) -> None:
    """What a calibration rank imports: the sweep and torch.distributed (torchrun's agent imports them before
    forking CPU ranks)."""
    import dtlab.rank.sweep  # noqa: F401


if __name__ == "__main__":
    exit_rank(entry(sys.argv[1:]))
