"""Multi-node jobs on one machine: two `dtlab run --nnodes 2` processes make one run, a node that never
joins is named, a rank that dies on one node is named by both, calibration across nodes records where its
ranks ran; the checks on the fields and the shared run directory need no launch."""

import json
import os

import pytest

import dtlab
from dtlab.config.calibration import CalibConfig
from dtlab.launching.nodes import _claim
from dtlab.results.status import merged_status

# ---- no launch: fields, the shared directory, merged status -------------------------------------------------


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(nnodes=2), "rdzv_endpoint is needed when nnodes > 1"),
        (dict(nnodes=2, rdzv_endpoint="node1:0"), "not 0: the other nodes cannot learn"),
        (dict(nnodes=2, rdzv_endpoint="node1"), "rdzv_endpoint must be HOST:PORT"),
        (dict(nnodes=0), "nnodes must be an integer >= 1"),
        (dict(nnodes=2, rdzv_endpoint="node1:29500", rdzv_id="a b"), "rdzv_id must be"),
        (dict(rdzv_timeout_s=0), "rdzv_timeout_s must be a finite number > 0"),
    ],
)
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
    assert merged_status(str(tmp_path), 2) == {
        "state": "stalled",
        "nodes": {"0": {"state": "finished"}, "1": {"state": "stalled"}},
    }


def test_a_node_whose_rank_lost_its_peer_names_the_rank_another_node_found_frozen(tmp_path):
    """No launch: node 0's rank failed with a lost connection because node 1's watchdog stopped a frozen rank."""
    from dtlab.launching.failures import run_failure
    from dtlab.launching.nodes import NodeLaunch

    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "nodes").mkdir()
    ev = lambda **e: json.dumps(e) + "\n"  # noqa: E731
    (run / "events" / "rank0.jsonl").write_text(
        ev(kind="start", rank=0, node=0, slot=0, host="a")
        + ev(kind="step", rank=0, step=0, t_step=0.1)
        + ev(kind="error", rank=0, time=5.0, error="RuntimeError: Connection closed by peer [10.0.0.2]:1234")
    )
    (run / "events" / "rank1.jsonl").write_text(
        ev(kind="start", rank=1, node=1, slot=1, host="b") + ev(kind="step", rank=1, step=0, t_step=0.1)
    )
    (run / "nodes" / "node1.status.json").write_text(
        json.dumps(
            {
                "state": "stalled",
                "stalled_ranks": [1],
                "frozen_ranks": [1],
                "error": "rank 1 stalled: no event for 4 s (stall_s=4 s); frozen (SIGSTOP); after step 0",
            }
        )
    )
    node0 = NodeLaunch(str(run), 1, 2, 0, "10.0.0.1:29500", "job")
    e = run_failure("failed", str(run), None, node=node0)
    assert (e.rank, e.signal) == (1, "SIGSTOP")
    assert str(e).startswith("rank 1 stalled on node slot 1: frozen (SIGSTOP), named by that node's launcher")
    assert (
        "On this node rank 0 only waited on it or lost it: rank 0 (node 0, host a) failed: RuntimeError: "
        "Connection closed by peer" in str(e)
    )
    assert e.consequences[0]["rank"] == 0
    (run / "nodes" / "node1.status.json").write_text(json.dumps({"state": "failed"}))  # nothing to blame there
    assert run_failure("failed", str(run), None, node=node0).rank == 0
