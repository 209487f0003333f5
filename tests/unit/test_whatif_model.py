"""The what-if's compute on shared CPU cores and its measured readiness curve (dtlab.model.whatif,
dtlab.model.buckets): hand-computed cases."""

import numpy as np
import pandas as pd
import pytest

from dtlab.config.run import RunConfig
from dtlab.model import buckets as bk
from dtlab.model import whatif as wi
from dtlab.model.link import Link

CPU2 = {"cores": 2, "nproc": 2, "threads_per_rank": 1, "other_cores": 0.0}
MIB = 2**20


def test_cpu_share_scale_fair_share_of_the_cores():
    # 2 cores, 1 thread per rank, measured at 2 ranks: demand p cores, slowdown max(1, p / 2), relative to p = 2
    assert wi.cpu_share_scale(3, CPU2) == pytest.approx(1.5)
    assert wi.cpu_share_scale(4, CPU2) == pytest.approx(2.0)
    assert wi.cpu_share_scale(1, CPU2) == pytest.approx(1.0)  # a lone rank still has one thread
    assert wi.cpu_share_scale(64, None) == 1.0  # a device per rank
    # other processes took 1 core: demand p + 1; at 2 ranks 3/2 = 1.5, at 1 rank 1, at 3 ranks 2
    busy = dict(CPU2, other_cores=1.0)
    assert wi.cpu_share_scale(1, busy) == pytest.approx(1 / 1.5)
    assert wi.cpu_share_scale(3, busy) == pytest.approx(2 / 1.5)
    # 2 threads per rank measured at 1 rank: demand 2, no slowdown; 2 ranks demand 4: twice as slow
    assert wi.cpu_share_scale(2, {"cores": 2, "nproc": 1, "threads_per_rank": 2}) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="cores"):
        wi.cpu_share_scale(2, dict(CPU2, cores=0))


def test_whatif_scales_compute_with_the_ranks_on_the_cores():
    # one 4-byte tensor, free communication: T_step = T_comp = (1 + 2 + 0.5) s x 1.5 at 3 ranks on 2 cores
    args = (1.0, 2.0, 0.5, [4], 25, 3, Link(alpha=0.0, beta=1e-12))
    assert wi.whatif(*args)["t_step"] == pytest.approx(3.5)  # compute independent of p
    got = wi.whatif(*args, cpu=CPU2)
    assert got["t_step"] == pytest.approx(5.25) and got["t_comp"] == pytest.approx(5.25)
    assert got["cpu_share"] == pytest.approx(1.5) and got["t_fwd"] == pytest.approx(1.5)
    sweep = wi.whatif_sweep(1.0, 2.0, 0.5, [4], [(2, 25), (3, 25)], Link(alpha=0.0, beta=1e-12), cpu=CPU2)
    assert sweep["t_step"].tolist() == pytest.approx([3.5, 5.25])


def test_ready_times_along_a_measured_curve():
    # bytes 1, 1, 2 of 4: fractions 0.25, 0.5, 1; curve (0,0) (0.5,0.9) (1,1): 0.45, 0.9, 1 of 4 s after 1 s
    got = bk.whatif_ready_times(1.0, 4.0, [1, 1, 2], curve=([0, 0.5, 1], [0, 0.9, 1]))
    assert np.allclose(got, [2.8, 4.6, 5.0])
    assert np.allclose(bk.whatif_ready_times(1.0, 4.0, [1, 1, 2]), [2.0, 3.0, 5.0])  # by bytes, as before
    with pytest.raises(ValueError, match="rising"):
        bk.whatif_ready_times(1.0, 4.0, [1, 1], curve=([0, 0.6, 0.5, 1], [0, 0.1, 0.2, 1]))
    with pytest.raises(ValueError, match=r"\(0, 0\) to \(1, 1\)"):
        bk.whatif_ready_times(1.0, 4.0, [1, 1], curve=([0, 1], [0, 0.5]))


def test_ready_curve_of_measured_steps():
    # step A: backward from 1.0, buckets ready at 1.5, 2.0, 3.0 -> 0.25, 0.5, 1 of 2 s; step B: from 0.0, ready
    # 0.5, 1.5, 2.0 -> 0.25, 0.75, 1; bytes 1, 1, 2 -> 0.25, 0.5, 1. Median per bucket: 0.25, 0.625, 1.
    xs, ys = bk.ready_curve([(1.0, [1.5, 2.0, 3.0], [1, 1, 2]), (0.0, [0.5, 1.5, 2.0], [1, 1, 2])])
    assert np.allclose(xs, [0, 0.25, 0.5, 1]) and np.allclose(ys, [0, 0.25, 0.625, 1])
    with pytest.raises(ValueError, match="at least one step"):
        bk.ready_curve([(1.0, [0.5], [1])])  # ready before backward began: no step to take


def test_whatif_with_the_curve_queues_later_buckets_into_the_tail():
    # two 1 MiB buckets, each all-reduce 0.4 s (ring, p = 2: n beta), backward 1 s from 0. By bytes: ready 0.5 and
    # 1.0, ends 0.9 and 1.4 -> T_step 1.4 s. Measured curve (half the bytes ready after 90% of backward): ready 0.9
    # and 1.0, the second waits for the first: ends 1.3 and 1.7 -> T_step 1.7 s, exposed 0.7 s.
    args = (0.0, 1.0, 0.0, [MIB, MIB], 1, 2, Link(alpha=0.0, beta=0.4 / MIB))
    assert wi.whatif(*args)["t_step"] == pytest.approx(1.4)
    got = wi.whatif(*args, ready_curve=([0, 0.5, 1], [0, 0.9, 1]))
    assert got["t_step"] == pytest.approx(1.7) and got["exposed"] == pytest.approx(0.7)


def test_wait_lengthens_the_last_all_reduce():
    # the two 1 MiB buckets above, by bytes: the last ends at 1.4 s; 0.3 s of waiting there ends it at 1.7 s
    args = (0.0, 1.0, 0.0, [MIB, MIB], 1, 2, Link(alpha=0.0, beta=0.4 / MIB))
    got = wi.whatif(*args, wait=0.3)
    assert got["t_step"] == pytest.approx(1.7) and got["exposed"] == pytest.approx(0.7) and got["wait"] == 0.3
    assert wi.whatif(0.0, 1.0, 0.0, [MIB, MIB], 1, 1, args[-1], wait=0.3)["t_step"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="wait"):
        wi.whatif(*args, wait=-1.0)


def test_measured_wait_is_the_exposed_time_the_queue_does_not_reproduce():
    # paired steps: training 4.6 s (slowest rank), its no-op hook step 4.0 s -> measured exposed 0.6 s. The what-if
    # at the run's cap (25 MiB: one 2 MiB bucket, ready at the end of backward) prices it at n beta = 0.1 s (ring,
    # p = 2), so 0.5 s of waiting is left.
    run = _fake_run({"param_nbytes": [MIB, MIB], "world_size": 2}, baseline_t_step=4.0)
    got = wi.measured_wait(run, Link(alpha=0.0, beta=0.1 / (2 * MIB)))
    assert got["measured_exposed"] == pytest.approx(0.6) and got["predicted_exposed"] == pytest.approx(0.1)
    assert got["wait"] == pytest.approx(0.5) and got["pairs"] == 2
    run.baseline_steps = run.baseline_steps.drop(columns="paired_step")
    assert (
        wi.measured_wait(run, Link(alpha=0.0, beta=0.1 / (2 * MIB)))["wait"] == 0.0
    )  # nothing paired: nothing measured


def test_measured_wait_leaves_out_what_the_stretch_explains():
    # paired steps: training 4.6 s, no-op hook 4.0 s: 0.6 s exposed
    run = _fake_run({"param_nbytes": [MIB, MIB], "world_size": 2}, baseline_t_step=4.0)
    run.config = RunConfig(warmup=1, bucket_mb=1.0)
    # two 1 MiB buckets of 0.05 s each (n beta); the run's readiness curve (0.75 of the bytes at 0.9 of backward)
    # has the first ready at 0.6 of its 3 s backward, in service 0.05 s inside it: stretch 0.5 adds 0.025 s to
    # backward, and the last bucket, ready as backward ends, is exposed 0.05 s either way
    link = Link(alpha=0.0, beta=0.1 / (2 * MIB))
    plain = wi.measured_wait(run, link)
    stretched = wi.measured_wait(run, link.replace(stretch=0.5))
    assert plain["predicted_exposed"] == pytest.approx(0.05) and plain["wait"] == pytest.approx(0.55)
    assert stretched["predicted_exposed"] == pytest.approx(0.075) and stretched["wait"] == pytest.approx(0.525)


def _fake_run(resolved: dict, baseline_t_step: float = 4.5):
    from dtlab.results.run import BUCKET_COLUMNS, STEP_COLUMNS, Run

    steps = pd.DataFrame(
        [[r, s, 1.0, 3.0, 0.5, 4.5 + r * 0.1, 1.0] for s in range(3) for r in range(2)], columns=STEP_COLUMNS
    )
    # buckets of 3 and 1 bytes (3/4 of the bytes ready first), ready 1.0 + 2.7 and 1.0 + 3.0: curve 0.75 -> 0.9
    buckets = pd.DataFrame(
        [
            {"rank": r, "step": s, "bucket": b, "nbytes": (3, 1)[b], "nparams": 1, "t_ready": (3.7, 4.0)[b]}
            for s in range(3)
            for r in range(2)
            for b in range(2)
        ],
        columns=BUCKET_COLUMNS,
    )
    ranks = pd.DataFrame({"rank": [0, 1], "host": ["vm", "vm"]})
    return Run(
        path="fake",
        config=RunConfig(warmup=1),
        resolved=resolved,
        status={},
        steps=steps,
        baseline_steps=steps.assign(step=steps["step"] + 10, t_step=baseline_t_step, paired_step=steps["step"]),
        buckets=buckets,
        collectives=pd.DataFrame(),
        memory=pd.DataFrame(),
        ranks=ranks,
    )


def test_compute_from_run_gives_its_cores_and_readiness():
    res = {"device_type": "cpu", "cpu_cores": 2, "torch_threads_per_rank": 1, "ranks_per_node": 2}
    c = wi.compute_from_run(_fake_run(res))
    assert c["cpu"] == {"cores": 2, "nproc": 2, "threads_per_rank": 1, "other_cores": 0.0}
    xs, ys = c["ready_curve"]
    assert np.allclose(xs, [0, 0.75, 1]) and np.allclose(ys, [0, 0.9, 1])
    assert "cpu" not in wi.compute_from_run(_fake_run({"device_type": "cuda"}))  # a GPU per rank: no sharing
