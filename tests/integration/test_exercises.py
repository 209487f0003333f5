"""Lab 08's "build it yourself" checks (dtlab.course.exercises): the instructor's reference solutions pass;
a hook that sums instead of averaging and a ring that leaves a chunk unreduced fail with feedback that names
the mistake; a ring whose send and recv disagree names the line and gloo's size mismatch; a deadlocked ring is
reported by the stall limit with the line each rank waits at; a hook that returns work.get_future() as it is
says so; a stub reports "not implemented" without launching or raising. Real 2-rank gloo runs (~8 s each).
"""

import importlib.util
import inspect
import pathlib

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from dtlab.course.exercises import check_comm_hook, check_ring_allreduce

MASTER = pathlib.Path(__file__).resolve().parents[2] / "instructor" / "08_build_it_yourself.ipynb"


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    """The instructor's solutions: the # EXERCISE cells of lab 08's master notebook, as a module (the checks
    ship a function's source, so it must live in a file)."""
    import json

    cells = ["".join(c["source"]) for c in json.loads(MASTER.read_text())["cells"]]
    src = "\n\n".join(c for c in cells if c.startswith("# EXERCISE"))
    path = tmp_path_factory.mktemp("sol") / "lab08_solutions.py"
    path.write_text("import torch\nimport torch.distributed as dist\n\n" + src + "\n")
    spec = importlib.util.spec_from_file_location("lab08_solutions", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- broken student code (top level, so the checks can ship its source) ----------------------------------


def summing_hook(state, bucket):
    work = dist.all_reduce(bucket.buffer(), async_op=True)  # forgot to divide by the world size
    return work.get_future().then(lambda fut: fut.value()[0])


def ring_without_all_gather(tensor):
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.tensor_split(p))
    for s in range(p - 1):
        send_i, recv_i = (rank - s) % p, (rank - s - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        req = dist.isend(chunks[send_i], (rank + 1) % p)
        dist.recv(incoming, (rank - 1) % p)
        req.wait()
        chunks[recv_i].add_(incoming)
    return tensor  # the all-gather phase is missing: every other chunk still holds a partial sum


def ring_off_by_one(tensor):
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.tensor_split(p))
    for s in range(p - 1):
        send_i, recv_i = (rank - s) % p, (rank - s) % p  # receives into the chunk it sends: sizes disagree
        incoming = torch.empty_like(chunks[recv_i])
        req = dist.isend(chunks[send_i], (rank + 1) % p)
        dist.recv(incoming, (rank - 1) % p)
        req.wait()
        chunks[recv_i].add_(incoming)
    return tensor


def ring_blocking(tensor):
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.tensor_split(p))
    for s in range(p - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % p])
        dist.send(chunks[(rank - s) % p], (rank + 1) % p)  # every rank sends first: they wait in a circle
        dist.recv(incoming, (rank - 1) % p)
    return tensor


def hook_returning_raw_future(state, bucket):
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future()  # its value is [tensor], not the tensor


def hook_crashing_at_exit(state, bucket):
    import os

    # a correct hook whose process ends badly after every check has finished: its process group's teardown
    # aborts, as gloo's once did in shutdown
    dist.destroy_process_group = lambda *args, **kwargs: os.abort()
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


# ---- tests ----------------------------------------------------------------------------------------------


def test_reference_hook_matches_single_process_after_every_step(sol, tmp_path):
    res = check_comm_hook(sol.my_allreduce_hook, nproc=2, steps=3, out=str(tmp_path / "hook"), verbose=False)
    assert res.status == "passed", res.verdict()
    assert list(res.per_step["step"]) == [0, 1, 2] and res.per_step["allclose"].all()
    assert (res.per_step["max_abs_err"] < 1e-12).all() and (res.per_step["ratio"] - 1).abs().max() < 1e-9
    b = res.buckets  # the student's hook timeline, recorded like dtlab's own
    assert set(b["rank"]) == {0, 1} and b["bucket"].nunique() >= 2 and (b["nbytes"] > 0).all()
    assert ((b["t_ready"] <= b["t_start"]) & (b["t_start"] <= b["t_end"])).all()
    # every step's buckets carry every parameter exactly once (1,732 float64 parameters in the MLP)
    assert (b.groupby(["rank", "step"])["nbytes"].sum() == 1732 * 8).all()
    assert {"step", "bucket", "nbytes", "t_ready", "t_start", "t_end"} <= set(b.columns)  # what lab 8 prints


def test_summing_hook_fails_and_says_so(tmp_path, capsys):
    res = check_comm_hook(summing_hook, nproc=2, steps=2, out=str(tmp_path / "sum"))
    assert res.status == "failed" and not res.passed
    assert "step 0" in res.feedback[0] and "sum instead of average" in res.feedback[0]
    assert abs(res.per_step["ratio"].iloc[0] - 2.0) < 1e-6
    assert "FAILED" in capsys.readouterr().out


def test_reference_ring_matches_all_reduce_and_is_timed_against_the_model(sol, tmp_path):
    # a synthetic profile: alpha 100 us, beta 1 ns/B (ring form); the model column must follow
    # 2(p-1) alpha + 2(p-1)/p n beta
    from dtlab.model.profile import Profile

    sizes = [2**k for k in range(12, 20)]
    samples = pd.DataFrame(
        {"op": "all_reduce", "nbytes": sizes, "nproc": 2, "seconds": [2e-4 + 1e-9 * n for n in sizes]}
    )
    prof = Profile.from_samples(samples)
    res = check_ring_allreduce(
        sol.my_ring_allreduce,
        nproc=2,
        sizes=(2, 3, 1001, 4097),
        timing_sizes=(2**14, 2**18),
        profile=prof,
        out=str(tmp_path / "ring"),
        verbose=False,
        iters=3,
    )
    assert res.status == "passed", res.verdict()
    assert res.per_size["ok"].all() and (res.per_size["sends"] == 2).all()
    t = res.timings
    assert list(t["nbytes"]) == [2**14, 2**18] and (t["ring_ms"] > 0).all() and (t["all_reduce_ms"] > 0).all()
    assert t["model_ms"].iloc[1] == pytest.approx((2e-4 + 1e-9 * 2**18) * 1e3, rel=1e-3)


def test_ring_that_skips_a_chunk_fails_naming_the_chunk(tmp_path):
    res = check_ring_allreduce(
        ring_without_all_gather,
        nproc=2,
        sizes=(4, 1001),
        timing_sizes=(2**12,),
        out=str(tmp_path / "skip"),
        verbose=False,
        iters=1,
        warmup=0,
    )
    assert res.status == "failed"
    # rank 0 reduced chunk 1 and never received chunk 0's sum: it still holds its own input there (chunks
    # numbered from 0, as tensor_split and the formulas count them)
    text = " ".join(res.feedback)
    assert "chunk 0 never reduced" in text and "rank 0" in text and "numbered 0..1" in text, text
    assert "2(p-1) = 2" in text  # one send per call, not 2(p-1)
    assert not res.per_size["ok"].any()


def test_mismatched_send_and_recv_name_the_line_and_the_sizes(tmp_path):
    """gloo aborts the receiving rank (SIGABRT, nothing recorded in Python): the verdict still quotes the
    rank's own log: gloo's message, the bytes on each side, and the line of the function it died at."""
    res = check_ring_allreduce(
        ring_off_by_one,
        nproc=2,
        sizes=(3,),
        timing_sizes=(2**12,),
        out=str(tmp_path / "off"),
        verbose=False,
        iters=1,
        warmup=0,
    )
    assert res.status == "error"
    text = res.feedback[0]
    assert "Received data size doesn't match expected size" in text, text
    assert "sent 8 B" in text and "at most 4 B" in text, text  # 2 elements arrived where 1 was expected
    line = next(i for i, ln in enumerate(inspect.getsource(ring_off_by_one).splitlines(), 1) if "dist.recv" in ln)
    assert f"line {line} of ring_off_by_one" in text and "`dist.recv(incoming, (rank - 1) % p)`" in text, text
    assert "SIGABRT" in text and "checking n=3 elements" in text, text


def test_a_deadlocked_ring_is_caught_by_the_stall_limit_not_the_timeout(tmp_path):
    res = check_ring_allreduce(
        ring_blocking,
        nproc=2,
        sizes=(2**20,),
        timing_sizes=(2**12,),
        out=str(tmp_path / "block"),
        verbose=False,
        timeout_s=600,
        stall_s=5,
    )
    assert res.status == "error"
    text = res.feedback[0]
    # stopped by the 5 s stall limit (the 600 s timeout would say "timeout" and have no stacks to quote)
    assert "after 5 s without progress" in text, text
    assert text.count("`dist.send(chunks[(rank - s) % p], (rank + 1) % p)`") == 2, text  # where each rank waits
    assert "isend" in text


def test_a_hook_returning_the_raw_future_is_told_what_to_return(tmp_path):
    res = check_comm_hook(hook_returning_raw_future, nproc=2, steps=1, out=str(tmp_path / "raw"), verbose=False)
    assert res.status == "error"
    assert "holds a list of 1 tensor(s)" in res.feedback[0] and "fut.value()[0]" in res.feedback[0], res.feedback


def test_a_crash_after_every_check_passed_is_a_note_not_an_error(tmp_path, capsys):
    res = check_comm_hook(hook_crashing_at_exit, nproc=2, steps=1, out=str(tmp_path / "exit"))
    assert res.status == "passed", res.verdict()
    captured = capsys.readouterr()
    assert "dtlab:" not in captured.err  # no red box under a passing check
    assert res.notes and "during shutdown" in res.notes[0] and "note (does not change the verdict)" in captured.out


def test_the_hook_timeline_names_layers_and_the_end_of_backward(sol, tmp_path):
    res = check_comm_hook(sol.my_allreduce_hook, nproc=2, steps=2, out=str(tmp_path / "layers"), verbose=False)
    b = res.buckets.query("step == 1")
    # every Linear layer of the 16-32-32-4 MLP is in exactly one bucket of the step, on each rank
    for _, g in b.groupby("rank"):
        layers = [x for ls in g["layers"] for x in ls]
        assert sorted(layers) == ["linear1 (16->32)", "linear2 (32->32)", "linear3 (32->4)"], layers
    # DDP waits for every bucket's future before backward() returns
    assert (b["t_end"] <= b["t_backward_end"]).all() and (b["t_ready"] < b["t_backward_end"]).all()
