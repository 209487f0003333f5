"""`dtlab slurm --dry-run` writes a script Slurm would accept; `dtlab emulate` refuses a shaped link it cannot
make, saying why, and (as root) builds and always tears down the namespace pair. No launch here: the shaped
link's calibration is benchmarks/shaped_link.py, the script's run under a fake srun benchmarks/slurm_fake_cluster.py."""

import subprocess

import pytest

from dtlab.launching import emulate
from dtlab.launching.emulate import Emulation, EmulationUnavailable, shaping_unavailable


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


root_only = pytest.mark.skipif(
    shaping_unavailable() is not None, reason=f"no shaped link here: {shaping_unavailable()}"
)


@root_only
def test_a_shaped_namespace_pair_is_built_and_always_torn_down():
    with pytest.raises(KeyError):  # an error inside the block still removes everything
        with Emulation(2, rate="1gbit") as em:
            assert all(ns in _namespaces() for ns in em.namespaces)
            for ns, ifname in zip(em.namespaces, em.ifnames):
                q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", ifname], capture_output=True, text=True)
                assert "tbf" in q.stdout and "rate 1Gbit" in q.stdout
            code = (
                f"import socket; s = socket.socket(); s.settimeout(5)\ntry: s.connect(('{em.addresses[1]}', 9))\n"
                "except ConnectionRefusedError: print('reached')"
            )
            ping = subprocess.run(
                ["ip", "netns", "exec", em.namespaces[0], "python3", "-c", code],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert ping.stdout.strip() == "reached"  # node 0's namespace reaches node 1 over the veth
            raise KeyError("boom")
    assert not any(ns in _namespaces() for ns in em.namespaces)
    assert em.ifnames[0] not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


@root_only
def test_a_failure_while_building_the_link_removes_what_was_made(monkeypatch):
    real = emulate._run

    def tc_fails(cmd):
        if cmd[0] == "tc":
            raise EmulationUnavailable("tc refused (simulated)")
        real(cmd)

    monkeypatch.setattr(emulate, "_run", tc_fails)
    em = Emulation(2, rate="1gbit")
    with pytest.raises(EmulationUnavailable, match="simulated"):
        em.__enter__()
    assert not any(ns in _namespaces() for ns in em.namespaces)
    assert em.ifnames[0] not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def test_submitit_local_executor_runs_a_two_node_tiny_job(tmp_path):
    """dtlab.submit through submitit's LocalExecutor: 2 tasks, each one node of the job (skipped without submitit,
    an optional extra: pip install submitit)."""
    submitit = pytest.importorskip("submitit")
    import dtlab

    ex = submitit.LocalExecutor(folder=str(tmp_path / "submitit"))
    ex.update_parameters(tasks_per_node=2, timeout_min=10)
    out = str(tmp_path / "job")
    job = dtlab.submit(dtlab.tiny(out=out, nproc=1, steps=3, baseline_steps=0, bucket_mb=0.05), nodes=2, executor=ex)
    assert job.results() == [out, out]
    run = dtlab.load_run(out)
    assert run.status["state"] == "finished" and sorted(run.ranks["node"]) == [0, 1]
    per = run.buckets.groupby(["rank", "step"])["nbytes"].sum()
    assert len(per) == 6 and (per == run.resolved["grad_bytes"]).all()
