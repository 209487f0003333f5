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
from dtlab.launching.nodes import _claim
from dtlab.results.status import merged_status
from dtlab.results.run import load_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "tiny", "--model-source", "random", "--data", "offline", "--batch-size", "4", "--seq-len", "32",
        "--steps", "3", "--warmup", "1", "--baseline-steps", "0", "--bucket-mb", "0.05", "--timeout-s", "300"]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_two_dtlab_run_processes_make_one_run(tmp_path):
    """The issue's 'done': two `dtlab run --nnodes 2 --nproc 1` processes, one run, ranks on different nodes."""
    out = str(tmp_path / "two")
    args = [sys.executable, "-m", "dtlab", "run", *TINY, "--nnodes", "2", "--nproc", "1", "--no-progress",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--out", out]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
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
    h = dtlab.launch(dtlab.tiny(out=str(tmp_path / "alone"), nproc=1, nnodes=2, rdzv_endpoint=endpoint,
                                rdzv_timeout_s=2.0))
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
        prof = em.calibrate(CalibConfig(nproc=1, out=str(tmp_path / "cal"), sizes=(1 << 16, 1 << 18, 1 << 20, 1 << 21),
                                        iters=2, rounds=1, warmup=1), progress=False)
    m = prof.meta
    assert m["nnodes"] == 2 and m["world_size"] == 2 and m["ranks_per_node"] == 1
    assert [(r["rank"], r["node"]) for r in m["ranks"]] == [(0, 0), (1, 1)] and len(m["hosts"]) == 1
    assert m["emulation"]["mode"] == "loopback" and "inter-node link" in prof.caveats[0]
    assert set(prof.samples["nproc"]) == {2} and "all_reduce" in prof.fits


# ---- no launch: fields, the shared directory, merged status -------------------------------------------------
@pytest.mark.parametrize("fields,needle", [
    (dict(nnodes=2), "rdzv_endpoint is needed when nnodes > 1"),
    (dict(nnodes=2, rdzv_endpoint="node1:0"), "not 0: the other nodes cannot learn"),
    (dict(nnodes=2, rdzv_endpoint="node1"), "rdzv_endpoint must be HOST:PORT"),
    (dict(nnodes=0), "nnodes must be an integer >= 1"),
    (dict(nnodes=2, rdzv_endpoint="node1:29500", rdzv_id="a b"), "rdzv_id must be"),
    (dict(rdzv_timeout_s=0), "rdzv_timeout_s must be a finite number > 0"),
])
def test_bad_multinode_fields_are_refused_by_name(tmp_path, fields, needle):
    with pytest.raises(ValueError, match=needle):
        dtlab.tiny(out=str(tmp_path / "x"), **fields).validate()
    with pytest.raises(ValueError, match=needle.split(" ")[0]):
        CalibConfig(out=str(tmp_path / "c"), **fields).validate()
    assert not (tmp_path / "x").exists()


def test_multinode_needs_a_shared_run_directory_and_gets_an_id_from_it():
    with pytest.raises(ValueError, match="out is needed when nnodes > 1"):
        dtlab.tiny(nnodes=2, rdzv_endpoint="node1:29500").validate()
    a = dtlab.tiny(out="/shared/r", nnodes=2, rdzv_endpoint="node1:29500").validate()
    b = dtlab.tiny(out="/shared/r", nnodes=2, rdzv_endpoint="node1:29500").validate()
    c = dtlab.tiny(out="/shared/other", nnodes=2, rdzv_endpoint="node1:29500").validate()
    assert a.rdzv_id == b.rdzv_id != c.rdzv_id
    with pytest.raises(ValueError, match="nproc x nnodes must be >= 2"):
        CalibConfig(nproc=1).validate()


def test_nodes_claim_slots_and_must_agree_on_the_config(tmp_path):
    out = str(tmp_path / "shared")
    doc = {"config": {"steps": 3, "nnodes": 2}, "launch": {"time": 1}}
    assert _claim(out, "config", doc, 2) == (out, 0)
    assert json.load(open(os.path.join(out, "config.json")))["config"] == doc["config"]
    with pytest.raises(ValueError, match=r"steps = 4 here, 3 there"):
        _claim(out, "config", {"config": {"steps": 4, "nnodes": 2}}, 2)
    assert not os.path.exists(os.path.join(out, "nodes", "node1.json"))  # a refused node gives its slot back
    assert _claim(out, "config", doc, 2) == (out, 1)
    with pytest.raises(ValueError, match="all 2 node slots are claimed"):
        _claim(out, "config", doc, 2)


def test_merged_status_waits_for_every_node_and_keeps_the_worst(tmp_path):
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    (nodes / "node0.status.json").write_text(json.dumps({"state": "finished"}))
    assert merged_status(str(tmp_path), 2)["state"] == "running"  # node 1 has not reported
    (nodes / "node1.status.json").write_text(json.dumps({"state": "finished"}))
    assert merged_status(str(tmp_path), 2)["state"] == "finished"
    (nodes / "node1.status.json").write_text(json.dumps({"state": "stalled"}))
    assert merged_status(str(tmp_path), 2) == {"state": "stalled", "nodes": {"0": {"state": "finished"},
                                                                            "1": {"state": "stalled"}}}


def test_a_node_whose_rank_lost_its_peer_names_the_rank_another_node_found_frozen(tmp_path):
    """No launch: node 0's rank failed with a lost connection because node 1's watchdog stopped a frozen rank."""
    from dtlab.launching.failures import run_failure
    from dtlab.launching.nodes import NodeLaunch
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "nodes").mkdir()
    ev = lambda **e: json.dumps(e) + "\n"  # noqa: E731
    (run / "events" / "rank0.jsonl").write_text(
        ev(kind="start", rank=0, node=0, slot=0, host="a") + ev(kind="step", rank=0, step=0, t_step=0.1)
        + ev(kind="error", rank=0, time=5.0, error="RuntimeError: Connection closed by peer [10.0.0.2]:1234"))
    (run / "events" / "rank1.jsonl").write_text(
        ev(kind="start", rank=1, node=1, slot=1, host="b") + ev(kind="step", rank=1, step=0, t_step=0.1))
    (run / "nodes" / "node1.status.json").write_text(json.dumps(
        {"state": "stalled", "stalled_ranks": [1], "frozen_ranks": [1],
         "error": "rank 1 stalled: no event for 4 s (stall_s=4 s); frozen (SIGSTOP); after step 0"}))
    node0 = NodeLaunch(str(run), 1, 2, 0, "10.0.0.1:29500", "job")
    e = run_failure("failed", str(run), None, node=node0)
    assert (e.rank, e.signal) == (1, "SIGSTOP")
    assert str(e).startswith("rank 1 stalled on node slot 1: frozen (SIGSTOP), named by that node's launcher")
    assert "On this node rank 0 only waited on it or lost it: rank 0 (node 0, host a) failed: RuntimeError: " \
           "Connection closed by peer" in str(e)
    assert e.consequences[0]["rank"] == 0
    (run / "nodes" / "node1.status.json").write_text(json.dumps({"state": "failed"}))  # nothing to blame there
    assert run_failure("failed", str(run), None, node=node0).rank == 0
