"""What dtlab sets in the environment of torchrun and its ranks, and what a run records of it. Pure.

dtlab sets a variable only where the user left it unset (`set_default`): a user's own NCCL settings always win.
The names dtlab set travel with the environment in `DTLAB_ENV_SET`, so that rank 0 can record, in the run's
config.json (`resolved.environment`), which NCCL variables were the user's and which dtlab's (`env_record`).

- `TORCH_NCCL_ASYNC_ERROR_HANDLING`: torch's default is 3, SkipCleanUp (ProcessGroupNCCL.hpp, `ErrorHandlingMode`:
  the watchdog tears the process down on an error or a timeout without aborting the communicators); 1 also
  aborts them, and `ncclCommAbort` can hang. dtlab sets 3 where it is unset, so every torch version behaves alike.
- `TORCH_NCCL_ENABLE_TIMING`: NCCL's own per-collective timing, only for runs that read it (DDP's buckets and the
  parameter server's: `work._get_duration()`); torch's docs warn that it raises the chance of a watchdog hang.
"""

from __future__ import annotations

#: Names of the variables dtlab set (comma-separated), carried in the environment from the launcher to the ranks.
ENV_SET = "DTLAB_ENV_SET"
#: What torchrun's environment gets where the user left it unset.
LAUNCH_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
#: The prefixes of the variables a run records (NCCL's and torch's NCCL settings).
RECORDED_PREFIXES = ("NCCL_", "TORCH_NCCL_")


def set_default(environ, name: str, value: str) -> bool:
    """Set `name` to `value` in `environ` (a dict or os.environ) only when it is unset, and note that dtlab set it
    (`ENV_SET`). Returns whether it was set."""
    if name in environ:
        return False
    environ[name] = value
    names = [n for n in environ.get(ENV_SET, "").split(",") if n]
    environ[ENV_SET] = ",".join(names + [name])
    return True


def env_record(environ) -> dict:
    """The NCCL variables of `environ` (and any other dtlab set), split into those dtlab set where they were unset
    and those the user set: {"set_by_dtlab": {name: value}, "from_user": {name: value}}."""
    ours = {n for n in environ.get(ENV_SET, "").split(",") if n}
    names = sorted(n for n in environ if n.startswith(RECORDED_PREFIXES) or n in ours)
    return {
        "set_by_dtlab": {n: environ[n] for n in names if n in ours},
        "from_user": {n: environ[n] for n in names if n not in ours},
    }
