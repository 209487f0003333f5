"""Starts, watches, stops and replays processes: the notebook-side half of every job.

- `torchrun`: run directories (unique_dir, prepare_dir, default_out, status.json), starting torchrun (the exits.json
  shim, the environment, c10d rendezvous on port 0), finding and signalling processes; `agent`: what runs in
  torchrun's agent; `warm` and `warmserver`: CPU jobs' agents forked from a server that imported torch once;
- `handle`: Handle (status/wait/stop/result/rank_pids), launch(), run(), the progress bar and the atexit handler
  that stops live runs; `watchdog`: stall detection and stack requests; `failures`: naming the rank that caused a
  failure and building the RunFailed;
- `nodes`: one node of a multi-node job (its slot of the shared run directory, rendezvous); `emulate`: several
  nodes on one machine (loopback or tc-shaped namespaces); `slurm`: sbatch scripts and submitit;
- `calibration`: collective sweeps; `sweeps`: grids of runs; `replay`: grading from recorded runs instead of
  launching.

(Not `dtlab/launch/`: a subpackage of that name would replace the lazily exported `dtlab.launch` function with a
module as soon as it is imported.)
"""
