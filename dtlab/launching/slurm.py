"""Slurm: an sbatch script that runs `srun torchrun` across the allocation's nodes, and
`submit()` for notebooks through submitit (an optional extra: pip install submitit; see its docstring).

`dtlab slurm [run flags] --nodes N --gpus-per-node G [--partition P] [--time HH:MM:SS] [--dry-run]`:

- prepares the run directory where the job will write (it must be on a filesystem every node mounts):
  config.json with the validated config (nnodes = N, nproc = G ranks per node when G > 0) and status
  'submitted';
- writes RUN/slurm.sbatch: one task per node, each `torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d
  --rdzv-endpoint $head:$port --rdzv-id $SLURM_JOB_ID -m dtlab.rank.worker RUN`, the head being the first host
  of `scontrol show hostnames $SLURM_JOB_NODELIST` and the port derived from the job id (two jobs sharing a
  head node get different ports); srun logs per node (RUN/logs/slurm-JOB-node{n}.log), the ranks' own logs
  and events in RUN as always, and status.json updated when the job starts and ends;
- submits it with `sbatch` unless --dry-run (then prints it, and leaves the directory unclaimed: the same command
  without --dry-run submits there).

Read the result afterwards with `dtlab show RUN` / `dtlab.load_run(RUN)`. Under plain torchrun there is no dtlab
launcher on the nodes: Slurm's --time bounds the run and srun --kill-on-bad-exit stops every node when one fails;
the ranks' error events still name the culprit.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
import time

from dtlab.config.run import RunConfig
from dtlab.launching.torchrun import prepare_dir
from dtlab.results.status import recorded_status
from dtlab.runfiles import dump_json

PORT_BASE, PORT_SPAN = 20000, 20000  # rendezvous port = PORT_BASE + job id % PORT_SPAN
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the directory that holds dtlab


def slurm_time(seconds: float) -> str:
    """Seconds -> Slurm's D-HH:MM:SS time limit, rounded up to whole minutes."""
    m = max(1, math.ceil(seconds / 60))
    return f"{m // 1440}-{m // 60 % 24:02d}:{m % 60:02d}:00"


def job_config(cfg: RunConfig, nodes: int, gpus_per_node: int) -> RunConfig:
    """The validated config the job runs: N nodes, G ranks per node (cfg.nproc on CPU nodes, G = 0). Checked
    for a node with G GPUs (not the submitting machine, which often has none); the rendezvous is the job's."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 0:
        raise ValueError(f"gpus_per_node must be an integer >= 0, got {gpus_per_node!r}")
    if not cfg.out or any(c.isspace() for c in str(cfg.out)):
        raise ValueError(
            f"out must be a run directory without spaces (#SBATCH lines cannot quote), on a filesystem "
            f"every node of the job mounts, got {cfg.out!r}"
        )
    nproc = gpus_per_node or cfg.nproc  # None: the config's own default (2 ranks on a CPU node)
    # A placeholder endpoint passes validation; the script's c10d endpoint is the allocation's first host.
    job = cfg.replace(
        out=os.path.abspath(cfg.out), nnodes=nodes, nproc=nproc, rdzv_endpoint="slurm-head:1" if nodes > 1 else None
    )
    job.validate(cuda_device_count=gpus_per_node)
    return job.replace(out=job.out, rdzv_endpoint=None, rdzv_id=None)


def sbatch_script(
    cfg: RunConfig,
    *,
    gpus_per_node: int = 0,
    partition: str | None = None,
    time_limit: str | None = None,
    setup: str | None = None,
    sbatch_args: tuple = (),
) -> str:
    """The sbatch script for `cfg` (a `job_config`): #SBATCH lines, the head node from the node list, and
    `srun torchrun` with a c10d rendezvous there. `setup`: shell lines run first (default: put this Python's
    bin directory on PATH, so torchrun and dtlab are the ones that wrote the script)."""
    run, n, g = cfg.out, cfg.nnodes, gpus_per_node
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# Written by `dtlab slurm`: {cfg.strategy} {cfg.model} on {n} node(s) x {cfg.nproc} rank(s).",
        f"# Run directory (must be on a filesystem every node mounts): {run}",
        f"#SBATCH --job-name=dtlab-{cfg.strategy}-{cfg.model}",
        f"#SBATCH --nodes={n}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={time_limit or slurm_time(cfg.timeout_s)}",
        f"#SBATCH --output={run}/logs/slurm-%j.out",
    ]
    if g:
        lines.append(f"#SBATCH --gpus-per-node={g}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [f"#SBATCH {a}" for a in sbatch_args]
    lines += [
        "",
        "set -uo pipefail",
        setup if setup is not None else f'export PATH={q(os.path.dirname(sys.executable))}:"$PATH"',
        f"export PYTHONPATH={q(_PKG_ROOT)}${{PYTHONPATH:+:$PYTHONPATH}}  # the dtlab that wrote this script",
        "export PYTHONUNBUFFERED=1",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))  # per job: two jobs may share a head node",
        f"python -m dtlab.launching.slurm mark {q(run)} running",
        f"srun --nodes={n} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        f"  --output={q(run)}/logs/slurm-%j-node%n.log \\",
        f"  torchrun --nnodes={n} --nproc-per-node={cfg.nproc} --rdzv-backend=c10d \\",
        '  --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" '
        f"--rdzv-conf=join_timeout={math.ceil(cfg.rdzv_timeout_s)} --max-restarts=0 \\",
        f"  -m dtlab.rank.worker {q(run)}",
        "rc=$?",
        f'python -m dtlab.launching.slurm mark {q(run)} "$rc"',
        "exit $rc",
        "",
    ]
    return "\n".join(lines)


def dry_prepared(run_dir: str) -> bool:
    """True when `run_dir` holds only what a dry run prepared: status 'prepared' by a dry run, and not claimed
    (no events/ folder: nothing was submitted or ran there)."""
    status = recorded_status(run_dir)[0] or {}
    return (
        status.get("state") == "prepared"
        and status.get("dry_run") is True
        and not os.path.exists(os.path.join(run_dir, "events"))
    )


def prepare(cfg: RunConfig, nodes: int, gpus_per_node: int = 0, dry_run: bool = False, **script_args) -> str:
    """Validate, create the run directory (config.json, status 'prepared') and write RUN/slurm.sbatch; the
    script's path. Nothing is written when validation fails.

    The run directory is claimed (mkdir of its events/ folder, as every launch claims one) only when `dry_run` is
    False: a dry run writes the same files but leaves the claim to the submission, so the job can be submitted to
    the same directory after its script was inspected (or the dry run repeated with other flags). A directory that
    holds anything else (a submitted job, a run) is refused either way."""
    # the launcher (pandas) only when used: the sbatch script runs this module for its status marks (`mark`)
    from dtlab.launching.handle import launch_facts

    job = job_config(cfg, nodes, gpus_per_node)
    script = sbatch_script(job, gpus_per_node=gpus_per_node, **script_args)
    if dry_prepared(job.out):  # a dry run's files, written again
        if not dry_run:
            try:  # the claim: of two submissions to one dry-run directory, only one creates events/
                os.mkdir(os.path.join(job.out, "events"))
            except FileExistsError:
                raise ValueError(
                    f"out: {job.out!r} already holds a run (or another launch just claimed it); choose "
                    "a new directory (runs are never overwritten)"
                ) from None
    elif dry_run:  # prepare_dir's refusal without its claim, which is the submission's
        if any(os.path.exists(os.path.join(job.out, f)) for f in ("config.json", "events")):
            raise ValueError(
                f"out: {job.out!r} already holds a run; choose a new directory (runs are never overwritten)"
            )
        os.makedirs(job.out, exist_ok=True)
    else:
        prepare_dir(job.out)
    os.makedirs(os.path.join(job.out, "logs"), exist_ok=True)
    dump_json(
        {
            "config": job.to_dict(),
            "launch": {
                "time": time.time(),
                "python": sys.executable,
                "slurm": {
                    "nodes": nodes,
                    "gpus_per_node": gpus_per_node,
                    "rdzv": "c10d on the allocation's first host, port "
                    f"{PORT_BASE} + job id % {PORT_SPAN}, id = the job id",
                },
                **launch_facts(),
            },
        },
        os.path.join(job.out, "config.json"),
    )
    dump_json(
        {"state": "prepared", "prepared_time": time.time(), **({"dry_run": True} if dry_run else {})},
        os.path.join(job.out, "status.json"),
    )  # written whole: a submission drops a dry run's status
    path = os.path.join(job.out, "slurm.sbatch")
    with open(path, "w") as f:
        f.write(script)
    return path


def submit_script(path: str) -> str:
    """`sbatch --parsable SCRIPT`; the job id. RuntimeError when sbatch is missing or refuses."""
    try:
        cp = subprocess.run(["sbatch", "--parsable", path], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise RuntimeError(
            "sbatch not found: this machine is not a Slurm submit host (use --dry-run to see the script)"
        ) from None
    if cp.returncode != 0:
        raise RuntimeError(f"sbatch refused {path}: {cp.stderr.strip()}")
    job_id = cp.stdout.strip().split(";")[0]
    mark(os.path.dirname(path), "submitted", slurm_job_id=job_id)
    return job_id


def mark(run_dir: str, what: str, **extra) -> None:
    """Write status.json for a Slurm job: 'prepared', 'submitted', 'running', or torchrun's exit code as
    text ('0' -> finished, anything else -> failed, with the code)."""
    if what.lstrip("-").isdigit():
        extra["returncode"] = int(what)
        what = "finished" if int(what) == 0 else "failed"
    old = recorded_status(run_dir)[0] or {}
    dump_json({**old, "state": what, f"{what}_time": time.time(), **extra}, os.path.join(run_dir, "status.json"))


# ---- submitit: the same job from a notebook, with dtlab's launcher on every node ------------------------------
def submit(
    cfg: RunConfig,
    nodes: int = 2,
    gpus_per_node: int = 0,
    *,
    partition: str | None = None,
    executor=None,
    port: int | None = None,
):
    """Submit `cfg` as a job of `nodes` nodes through submitit (optional: pip install submitit) and return the
    submitit Job at once; `job.results()` waits (one run directory path per node), then `dtlab.load_run(cfg.out)`.

    Every task runs `dtlab.launch` for its node (claims, watchdog, failure naming, as `dtlab run --nnodes`), the
    rendezvous at the first host of the allocation, port PORT_BASE + job id % PORT_SPAN unless `port` is given.
    Default executor: submitit.AutoExecutor (Slurm) in RUN/logs/submitit, one task per node, `gpus_per_node`
    GPUs each, `partition`, time limit from cfg.timeout_s. A given `executor` is used as configured: a
    submitit.LocalExecutor with tasks_per_node = nodes plays every node on this machine over loopback."""
    try:
        import submitit
    except ImportError:
        raise RuntimeError("dtlab.submit needs submitit: pip install submitit (or dtlab's 'slurm' extra)") from None
    job = job_config(cfg, nodes, gpus_per_node)
    if executor is None:
        executor = submitit.AutoExecutor(folder=os.path.join(job.out, "logs", "submitit"))
        executor.update_parameters(
            nodes=nodes,
            tasks_per_node=1,
            timeout_min=math.ceil(job.timeout_s / 60),
            **({"gpus_per_node": gpus_per_node} if gpus_per_node else {}),
            **({"slurm_partition": partition} if partition else {}),
        )
    return executor.submit(_node_task, job.to_dict(), port)


def _node_task(cfg_dict: dict, port: int | None) -> str:
    """One submitit task = one node: join the job's rendezvous, run this node's ranks, return the run directory."""
    import submitit  # optional (the slurm extra); this runs in a submitit task, which has it

    from dtlab.launching.handle import launch  # not at the top: see prepare()

    env = submitit.JobEnvironment()
    host = env.hostnames[0] if env.num_nodes > 1 else "127.0.0.1"  # one machine (LocalExecutor): loopback
    port = port or PORT_BASE + int(re.sub(r"\D", "", str(env.job_id)) or 0) % PORT_SPAN
    cfg = RunConfig.from_dict(cfg_dict)
    cfg = cfg.replace(out=cfg.out, rdzv_endpoint=f"{host}:{port}", rdzv_id=f"submitit-{env.job_id}".replace("_", "-"))
    return launch(cfg).wait(progress=False).path


if __name__ == "__main__":  # python -m dtlab.launching.slurm mark RUN_DIR STATE (the sbatch script's status updates)
    if len(sys.argv) != 4 or sys.argv[1] != "mark":
        sys.exit("usage: python -m dtlab.launching.slurm mark RUN_DIR STATE|EXIT_CODE")
    mark(sys.argv[2], sys.argv[3])
