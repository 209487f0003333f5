"""The launcher's parts, split by concern; `dtlab.launcher` re-exports the public API (import from there).

- `dtlab.launching.torchrun`: run directories (unique_dir, prepare_dir, default_out, status.json), starting
  torchrun (the exits.json shim, the environment, c10d rendezvous on port 0), finding and signalling processes.
- `dtlab.launching.failures`: naming the rank that caused a failure from exits.json, the ranks' events and logs,
  and building the RunFailed (consequences, log tails, the stall report).
- `dtlab.launching.watchdog`: following each rank's event file, stall detection, SIGUSR1/SIGCONT stack requests,
  naming the silent rank(s).
- `dtlab.launching.nodes`: one node of a multi-node job: claiming a slot of the shared run directory, its agent's
  rendezvous flags, naming the missing nodes when the rendezvous fails (the fields are dtlab.multinode's).
- `dtlab.launching.handle`: Handle (status/wait/stop/result/rank_pids), launch(), run(), the progress bar and the
  atexit handler that stops live runs.

(Not `dtlab/launch/`: a subpackage of that name would replace the lazily exported `dtlab.launch` function with a
module as soon as it is imported.)
"""
