"""Start torchrun from the notebook kernel, watch the ranks, and bring results back from disk.

This module is the public face of the launcher; the code lives in dtlab.launching, split by concern:
`torchrun` (run directories, the agent shim, process lookup and signals), `failures` (naming the rank that
caused a failure, RunFailed), `watchdog` (stall detection and stack dumps) and `handle` (Handle, launch, run).

The kernel never initialises CUDA and never forks itself into ranks: it starts `torchrun` as a subprocess
in a new session (so the whole group can be stopped together), follows every rank's event file, and loads
the run directory when the ranks are done.

- Rendezvous: torchrun's c10d rendezvous on 127.0.0.1 port 0. The agent's TCP store binds a port the OS
  picks and the ranks connect to that same store, so two launches can never race for a port (no
  "find a free port, then hope nobody takes it before torchrun binds it"). A multi-node job (nnodes > 1, see
  dtlab.multinode) uses the endpoint every node is given instead; `launch` then starts this node's part.
- Faults: torchrun's agent is wrapped so that, when ranks fail, what it knows about each of them (exit code,
  signal, pid) lands in RUN_DIR/exits.json. RunFailed names the rank that caused the failure from that and
  the ranks' own error events, and reports the ranks that only lost their peer as consequences.
- Watchdog (in `wait()`): a rank that writes no event for `stall_s` seconds is asked for its Python stacks
  (SIGUSR1, faulthandler; a SIGSTOPped rank is continued to answer), the run is stopped and RunFailed names it.
- No leftovers: an interrupt, a timeout, a stall or a failing rank stops every process, and every rank PID
  of the run is gone before `wait()` or `stop()` returns; the ranks also die with torchrun (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

from dtlab.launching.failures import PROGRESS_KINDS
from dtlab.launching.handle import Handle, launch, run
from dtlab.launching.torchrun import (RANK_MODULES, _write_status, default_out, free_port, prepare_dir,
                                      start_torchrun, unique_dir)
from dtlab.launching.watchdog import MIN_STALL_S, STACK_WAIT_S, STALL_STEPS, STARTUP_ALLOWANCE_S

__all__ = ["launch", "run", "Handle", "free_port", "unique_dir", "prepare_dir", "start_torchrun", "default_out",
           "_write_status", "STARTUP_ALLOWANCE_S", "MIN_STALL_S", "STALL_STEPS", "STACK_WAIT_S", "PROGRESS_KINDS",
           "RANK_MODULES"]
