"""Lab 08's "build it yourself" checks (dtlab.course.exercises): the instructor's reference solutions pass;
a hook that sums instead of averaging and a ring that leaves a chunk unreduced fail with feedback that names
the mistake; a ring whose send and recv disagree names the line and gloo's size mismatch; a deadlocked ring is
reported by the stall limit with the line each rank waits at; a hook that returns work.get_future() as it is
says so; a stub reports "not implemented" without launching or raising. Real 2-rank gloo runs (~8 s each).
"""

import math
import pathlib

import pytest
import torch.distributed as dist

from dtlab.course.exercises import check_comm_hook, check_ring_allreduce, ring_timings
from dtlab.course.shipping import not_implemented, ship

# ---- broken student code (top level, so the checks can ship its source) ----------------------------------


def summing_hook(state, bucket):
    work = dist.all_reduce(bucket.buffer(), async_op=True)  # forgot to divide by the world size
    return work.get_future().then(lambda fut: fut.value()[0])


def stub_hook(state, bucket):
    """Average the bucket over all ranks."""
    raise NotImplementedError("write your hook here")


def stub_ring(tensor):
    raise NotImplementedError


def uses_math(x):
    return math.sqrt(x)


def test_stubs_report_not_implemented_without_launching(tmp_path, capsys):
    assert not_implemented(stub_hook) and not_implemented(stub_ring) and not not_implemented(summing_hook)
    for res in (check_comm_hook(stub_hook), check_ring_allreduce(stub_ring), check_comm_hook(None)):
        assert res.status == "not implemented" and res.run_dir is None and not res.passed
    assert capsys.readouterr().out.count("not implemented yet") >= 3


def test_ship_writes_the_source_with_the_modules_it_uses(tmp_path):
    path = ship(uses_math, str(tmp_path))
    ns = {}
    exec(compile(pathlib.Path(path).read_text(), path, "exec"), ns)
    assert ns["uses_math"](9.0) == 3.0 and "import math" in pathlib.Path(path).read_text()


def test_ring_timings_take_the_slowest_rank_then_the_median():
    rows = [
        dict(rank=r, what=w, nbytes=1024, iter=i, seconds=s)
        for i, (a, b) in enumerate([(1e-3, 3e-3), (2e-3, 1e-3), (5e-3, 4e-3)])
        for w in ("ring", "all_reduce")
        for r, s in ((0, a), (1, b))
    ]
    t = ring_timings(rows, 2)
    assert t["ring_ms"].iloc[0] == pytest.approx(3.0) and t["all_reduce_ms"].iloc[0] == pytest.approx(3.0)
