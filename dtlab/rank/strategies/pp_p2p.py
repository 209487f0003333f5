"""The pipeline's sends and receives, recorded (strategy 'pp', dtlab.rank.strategies.pp): torch's schedules issue them
through the p2p helpers of torch.distributed.pipelining.schedules (`_batch_p2p` issues, `_wait_batch_p2p` waits),
which `install_p2p_recording` wraps once per process with a `P2PRecorder`; the stage's collective recorder it
reports to is `ACTIVE["recorder"]` (None: nothing recorded). Apart from the strategy so that reading it imports no
pipelining: torch's module is imported where the helpers are wrapped (dtlab.rank.compat.pipelining_p2p_helpers).
"""

from __future__ import annotations

from dtlab.rank.compat import is_pipeline_transfer, pipelining_p2p_helpers

ACTIVE = {"recorder": None}  # the recorder the wrapped p2p helpers report to (one stage per process)


def install_p2p_recording() -> bool:
    """Wrap torch.distributed.pipelining.schedules' p2p helpers once per process; False when absent."""
    found = pipelining_p2p_helpers()
    if found is None:
        return False
    sch, issue, wait = found
    if getattr(sch, "_dtlab_recorded", False):
        return True
    recorder = P2PRecorder(issue, wait)
    sch._batch_p2p, sch._wait_batch_p2p, sch._dtlab_recorded = recorder.batch_p2p, recorder.wait_p2p, True
    return True


class P2PRecorder:
    """Records every send and receive a schedule issues through `_batch_p2p`, and ends each when the Work that
    carries it is waited for.

    A backend may return one Work per op (gloo) or one Work for the whole batch (NCCL coalesces
    `batch_isend_irecv`, and 1F1B fuses a forward send with a backward receive in one batch): each Work ends
    every record it carries, so no send or receive is left open whichever it does. A call made from inside the
    wrapper (a torch whose `_batch_p2p` calls itself through the module) is not recorded twice, and the schedule's
    communicator warm-up (dtlab.rank.compat.is_pipeline_transfer) is not counted as a transfer."""

    def __init__(self, issue, wait):
        self.issue, self.wait = issue, wait
        self.open: dict[int, list] = {}  # id(Work) -> the records it carries
        self.depth = 0

    def batch_p2p(self, p2p_ops, desc=None):
        rec = ACTIVE["recorder"]
        if rec is None or self.depth or not is_pipeline_transfer(desc):
            return self._issue(p2p_ops, desc)
        recs = []
        for op in p2p_ops:
            send = op.op.__name__.endswith("send")
            forward = ("fwd_send" in desc) if send else ("fwd_recv" in desc)
            r = rec.start(
                "send" if send else "recv",
                op.tensor.numel() * op.tensor.element_size(),
                "pp",
                2,
                peer=int(op.peer),
                desc=desc,
            )
            r["phase"] = "forward" if forward else "backward"
            recs.append(r)
        out = self._issue(p2p_ops, desc)
        works = _works(out)
        if len(works) == len(recs):  # one Work per op
            for w, r in zip(works, recs):
                self.open[id(w)] = [r]
        else:  # coalesced: any Work of the batch ends all of its records (the first waited for takes them)
            for w in works:
                self.open[id(w)] = recs
        return out

    def _issue(self, p2p_ops, desc):
        self.depth += 1
        try:
            return self.issue(p2p_ops, desc=desc)
        finally:
            self.depth -= 1

    def wait_p2p(self, work):
        rec = ACTIVE["recorder"]
        t0 = rec.now() if rec is not None else None
        self.wait(work)
        if rec is None:
            return
        t1 = rec.now()
        for w in _works(work):
            for r in self.open.pop(id(w), []):
                if rec.ended(r):  # already ended by an earlier Work of its coalesced batch
                    continue
                rec.finish(r, t1)
                rec.block(r, t0, t1, "wait")


def _works(out) -> list:
    """The Works of a `_batch_p2p` result: a list (torch 2.13, 2.14), or one Work for the whole batch (a torch whose
    helper returns `batch_isend_irecv(ops).pop()`); None for an empty batch."""
    if out is None:
        return []
    if hasattr(out, "wait"):
        return [out]
    return [w for w in out if w is not None]
