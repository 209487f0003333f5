"""Multi-node jobs on one machine: two `dtlab run --nnodes 2` processes make one run, a node that never
joins is named, a rank that dies on one node is named by both, calibration across nodes records where its
ranks ran; the checks on the fields and the shared run directory need no launch."""

import json
import os
import subprocess
import sys

import pytest

import dtlab
from dtlab.config.calibration import CalibConfig
from dtlab.launching.torchrun import free_port
from dtlab.results.run import load_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


TINY = [
    "--model",
    "tiny",
    "--model-source",
    "random",
    "--data",
    "offline",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--steps",
    "3",
    "--warmup",
    "1",
    "--baseline-steps",
    "0",
    "--bucket-mb",
    "0.05",
    "--timeout-s",
    "300",
]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_two_dtlab_run_processes_make_one_run(tmp_path):
    """The issue's 'done': two `dtlab run --nnodes 2 --nproc 1` processes, one run, ranks on different nodes."""
    out = str(tmp_path / "two")
    args = [
        sys.executable,
        "-m",
        "dtlab",
        "run",
        *TINY,
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--no-progress",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--out",
        out,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)
    ]
    outs = [p.communicate(timeout=400) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    run = load_run(out)
    assert run.status["state"] == "finished" and set(run.status["nodes"]) == {"0", "1"}
    r = run.ranks.set_index("rank")
    assert list(r.index) == [0, 1] and set(r["node"]) == {0, 1} and set(r["slot"]) == {0, 1}
    assert (r["local_rank"] == 0).all() and r["host"].notna().all()
    assert run.resolved["nnodes"] == 2 and run.resolved["world_size"] == 2 and run.resolved["ranks_per_node"] == 1
    # every gradient byte is all-reduced once per step on each rank of each node
    per = run.buckets.groupby(["rank", "step"])["nbytes"].sum()
    assert set(per.index.get_level_values("rank")) == {0, 1} and len(per) == 2 * 3
    assert (per == run.resolved["grad_bytes"]).all()
    assert run.buckets[run.buckets["step"] >= 1].groupby(["rank", "step"]).size().min() >= 2
    for k in (0, 1):  # each node's own agent log and claim
        assert os.path.exists(os.path.join(out, "logs", f"torchrun.node{k}.log"))
        assert json.load(open(os.path.join(out, "nodes", f"node{k}.json")))["slot"] == k
    assert sum("2 ranks on 2 nodes" in o for o, _ in outs) == 2  # both nodes print the merged run
    assert sum("written by node slot 0" in o for o, _ in outs) == 1 and os.path.exists(os.path.join(out, "report.html"))


def test_a_node_that_never_joins_times_out_naming_it(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    h = dtlab.launch(
        dtlab.tiny(out=str(tmp_path / "alone"), nproc=1, nnodes=2, rdzv_endpoint=endpoint, rdzv_timeout_s=2.0)
    )
    with pytest.raises(dtlab.RunFailed) as info:
        h.wait(progress=False)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"rendezvous {endpoint} (id dtlab-") and "timed out after rdzv_timeout_s=2 s" in first
    assert "1 of 2 nodes" in first and "Missing: node slot(s) 1" in first and "--nnodes 2" in first
    assert info.value.state == "failed" and h.rank_pids() == [] and h.proc.poll() is not None
    assert load_run(h.run_dir).status["nodes"]["0"]["state"] == "failed"


def test_a_rank_killed_on_one_node_is_named_by_both_nodes(tmp_path, monkeypatch):
    """Failure detection per node: node 1's rank is SIGKILLed; node 0's rank only loses its peer."""
    import threading

    from dtlab.launching.emulate import Emulation

    monkeypatch.setenv("DTLAB_FAULT", "1:1:kill")  # handed to both agents: only global rank 1 acts on it
    with Emulation(2) as em:
        handles = em.launch(dtlab.tiny(out=str(tmp_path / "kill"), nproc=1, steps=4))
    errors = {}

    def wait(h):  # each node's launcher waits on its own node, as on two machines
        try:
            h.wait(progress=False)
        except dtlab.RunFailed as e:
            errors[h.node.slot] = e

    threads = [threading.Thread(target=wait, args=(h,)) for h in handles]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert set(errors) == {0, 1}
    for e in errors.values():
        assert (e.rank, e.signal) == (1, "SIGKILL"), str(e)
        assert str(e).startswith("rank 1 (node 1, host ") and "died from signal SIGKILL" in str(e)
    pids = handles[0].rank_pids() + handles[1].rank_pids()
    assert len(pids) == 2 and not [p for p in pids if _alive(p)]
    assert load_run(handles[0].run_dir).status["state"] == "failed"


def test_calibration_across_two_nodes_records_where_ranks_ran(tmp_path):
    from dtlab.launching.emulate import Emulation

    with Emulation(2) as em:
        prof = em.calibrate(
            CalibConfig(
                nproc=1,
                out=str(tmp_path / "cal"),
                sizes=(1 << 16, 1 << 18, 1 << 20, 1 << 21),
                iters=2,
                rounds=1,
                warmup=1,
            ),
            progress=False,
        )
    m = prof.meta
    assert m["nnodes"] == 2 and m["world_size"] == 2 and m["ranks_per_node"] == 1
    assert [(r["rank"], r["node"]) for r in m["ranks"]] == [(0, 0), (1, 1)] and len(m["hosts"]) == 1
    assert m["emulation"]["mode"] == "loopback" and "inter-node link" in prof.caveats[0]
    assert set(prof.samples["nproc"]) == {2} and "all_reduce" in prof.fits
