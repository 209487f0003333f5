"""Run the script `dtlab slurm` writes, on this machine, under a stand-in for Slurm. Not a test (it takes about a
minute on 2 cores): it checks that the generated sbatch script really starts one torchrun agent per node, that
they meet at the c10d endpoint derived from the node list, and that the run directory comes out whole.

Stand-ins on PATH: `scontrol show hostnames A,B` prints one host per line; `srun --nodes=N --output=F CMD...`
starts N copies of CMD with SLURM_NODEID set, output to F (%n, %j expanded), and fails if one fails. The job
gets SLURM_JOB_ID and SLURM_JOB_NODELIST=localhost,localhost: two "nodes" on loopback.

    python benchmarks/slurm_fake_cluster.py
"""

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time

import dtlab
from dtlab.cli.main import main as dtlab_main

SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] || exit 1
for h in ${3//,/ }; do echo "$h"; done
"""
SRUN = """#!/bin/bash
n=1; out=
while [[ "$1" == --* ]]; do case "$1" in --nodes=*) n=${1#--nodes=};; --output=*) out=${1#--output=};; esac; shift; done
pids=()
for ((k=0; k<n; k++)); do f=${out//%n/$k}; f=${f//%j/$SLURM_JOB_ID}
  SLURM_NODEID=$k "$@" > "${f:-/dev/stdout}" 2>&1 & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait $p || rc=$?; done; exit $rc
"""


def main() -> int:
    tmp = tempfile.mkdtemp(prefix="dtlab-fake-slurm-")
    bin_dir, out = os.path.join(tmp, "bin"), os.path.join(tmp, "run")
    os.makedirs(bin_dir)
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        with open(os.path.join(bin_dir, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(bin_dir, name), 0o755)
    with contextlib.redirect_stdout(io.StringIO()):  # --dry-run prints the script: not wanted here
        code = dtlab_main(
            [
                "slurm",
                "--model",
                "tiny",
                "--model-source",
                "random",
                "--data",
                "offline",
                "--steps",
                "3",
                "--warmup",
                "1",
                "--baseline-steps",
                "0",
                "--bucket-mb",
                "0.05",
                "--batch-size",
                "4",
                "--seq-len",
                "32",
                "--nproc",
                "1",
                "--out",
                out,
                "--nodes",
                "2",
                "--dry-run",
            ]
        )
    assert code == 0
    env = dict(
        os.environ,
        PATH=bin_dir + os.pathsep + os.environ["PATH"],
        SLURM_JOB_ID=str(os.getpid()),
        SLURM_JOB_NODELIST="localhost,localhost",
    )
    t0 = time.monotonic()
    cp = subprocess.run(["bash", os.path.join(out, "slurm.sbatch")], env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    run = dtlab.load_run(out)
    per = run.buckets.groupby(["rank", "step"])["nbytes"].sum()
    ok = (
        cp.returncode == 0
        and run.status.get("state") == "finished"
        and sorted(run.ranks["node"]) == [0, 1]
        and (per == run.resolved["grad_bytes"]).all()
        and len(per) == 6
    )
    print(
        f"script exit {cp.returncode}, {wall:.0f} s; status {run.status.get('state')}; ranks on nodes "
        f"{sorted(run.ranks['node'])}; bytes per rank and step {sorted(set(per))} "
        f"(gradients {run.resolved['grad_bytes']}); per-node logs "
        f"{sorted(f for f in os.listdir(os.path.join(out, 'logs')) if f.startswith('slurm-'))}"
    )
    print("OK" if ok else f"FAILED: see {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
