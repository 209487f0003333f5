"""torch's own pipeline p2p helpers under dtlab's recorder (dtlab.rank.strategies.pp_p2p). Here, not in the fast
tier: importing torch.distributed.pipelining costs a test process about 2 CPU-seconds, and the unit tier's other
pipeline tests use stand-ins for the helpers."""

import pytest
import torch.distributed as dist

from dtlab.rank import compat
from dtlab.rank.collectives import CommRecorder
from dtlab.rank.strategies import pp_p2p as pp
from tests.unit.test_timing_marks import OneWork, Op, Writer, _fake_marks


def test_this_torch_has_the_helpers_the_pipeline_recorder_wraps():
    # a torch that renamed them would leave every pipeline run without p2p records: the CI legs say which
    assert compat.pipelining_p2p_helpers() is not None


@pytest.mark.parametrize("desc", ["fwd_send_bwd_recv", "bwd_send_fwd_recv"])
def test_a_batch_coalesced_into_one_work_ends_every_send_and_receive(monkeypatch, desc):
    """torch's own helpers, with batch_isend_irecv returning one Work for the two ops (NCCL coalesces; gloo does
    not, which is why a CPU run never showed it): both records end, with their bytes, on the device's clock, and the
    wait is one blocked interval."""
    from torch.distributed.pipelining import schedules as sch

    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [OneWork()])
    marks, _ = _fake_marks()
    writer = Writer()
    rec = CommRecorder(writer, 0, marks)
    p2p = pp.P2PRecorder(sch._batch_p2p, sch._wait_batch_p2p)
    monkeypatch.setitem(pp.ACTIVE, "recorder", rec)
    rec.begin(0, marks.now())
    works = p2p.batch_p2p([Op(dist.isend, 8), Op(dist.irecv, 16)], desc=desc)
    assert len(works) == 1
    p2p.wait_p2p(works)
    rec.flush()
    done = writer.of("collective")
    assert sorted(f["nbytes"] for f in done) == [32, 64]
    assert all(f["t_end"] is not None and f["t_end"] > f["t_start"] for f in done)
    assert all(float(f["t_end"]).is_integer() for f in done)  # the device's ticks, not the host's clock
    # the one wait blocked for both: one interval, named for each record it ended
    assert len({(b["t_start"], b["t_end"]) for b in writer.of("blocked")}) == 1 and len(writer.of("blocked")) == 2
    assert not p2p.open
