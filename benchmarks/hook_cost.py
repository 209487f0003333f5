"""What a DDP comm hook costs the thread that runs backward, per bucket, beside the no-op baseline (CPU, gloo).

    python benchmarks/hook_cost.py [--calls 3000] [--numel 1024]

Times, on the calling thread, one call of each hook on a bucket of `numel` fp32 elements, in one process
(a 1-rank gloo group: the all-reduce is issued and completes on gloo's thread, as in training):

- `recording`: dtlab's BucketRecorder.hook (divide, ready mark, issue the all-reduce, chain the end callback);
- `dtlab baseline`: the same recorder in "noop" mode (everything but the collective; its callback runs inline);
- `torch noop_hook`: DDP's bare no-op hook, the baseline dtlab used before.

T_step - T_comp counts whatever the measured hook costs beyond the baseline hook as exposed communication, so
the difference between the two baseline rows is the bias dtlab removed; what the recording hook costs beyond
dtlab's baseline is the all-reduce's own issue (part of communication). Medians of blocks of 100 calls, in us.
The default bucket is small (4 KiB) so the hook's own work shows; `division` is that bucket's div_ alone, paid
by both of dtlab's rows and not by torch's no-op hook.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Bucket:
    def __init__(self, buf):
        self._buf = buf

    def buffer(self):
        return self._buf

    def index(self):
        return 0

    def parameters(self):
        return [None] * 4


def _per_call_us(fn, calls: int, block: int = 100) -> float:
    out = []
    for _ in range(calls // block):
        t0 = time.perf_counter()
        for _ in range(block):
            fn()
        out.append((time.perf_counter() - t0) / block * 1e6)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--numel", type=int, default=1024, help="bucket elements (default 4 KiB of fp32)")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    from dtlab.rank.marks import Marks
    from dtlab.rank.recorder import BucketRecorder

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    bucket = _Bucket(torch.ones(args.numel))
    rec = BucketRecorder(1, Marks(torch.device("cpu"), "gloo"))
    rec.begin_step(time.perf_counter())

    def recording_issue_only():
        rec.mode = "allreduce"
        return rec.hook(None, bucket)

    def baseline():
        rec.mode = "noop"
        rec.hook(None, bucket)

    def torch_noop():
        noop_hook(None, bucket)

    for f in (baseline, torch_noop):  # warm up
        for _ in range(200):
            f()
    rows = {"division": _per_call_us(lambda: bucket.buffer().div_(1), args.calls)}
    for name, f in (("dtlab baseline", baseline), ("torch noop_hook", torch_noop)):
        rows[name] = _per_call_us(f, args.calls)
        rec.begin_step(time.perf_counter())
    # the recording hook's cost to the caller: the issue (its callback runs on gloo's thread)
    futs = []
    t = []
    for _ in range(args.calls // 100):
        t0 = time.perf_counter()
        for _ in range(100):
            futs.append(recording_issue_only())
        t.append((time.perf_counter() - t0) / 100 * 1e6)
        for fu in futs:
            fu.wait()
        futs.clear()
        rec.begin_step(time.perf_counter())
    rows["recording (issue)"] = statistics.median(t)
    print(f"bucket {args.numel * 4:,} B, median per call on the calling thread ({args.calls} calls):")
    for name, us in rows.items():
        print(f"  {name:20s} {us:8.1f} us")
    bias = rows["dtlab baseline"] - rows["torch noop_hook"]
    print(f"  the bias removed (dtlab baseline - torch noop_hook): {bias:.1f} us per bucket")
    dist.destroy_process_group()
    print(
        f"ZeRO-3: a timed Work.wait() on an already completed collective costs {_timed_wait_us(args.calls):.1f} us "
        "more than the bare wait (CPU: two clock reads and a record)"
    )
    return 0


def _timed_wait_us(calls: int) -> float:
    """Host time dtlab's timed wait (dtlab.rank.strategies.zero3.comm._TimedWork) adds to one wait, on CPU."""
    import torch

    from dtlab.rank.strategies.zero3.comm import CollectiveRecorder, _TimedWork

    class Done:
        def wait(self, *a, **k):
            return True

    rec = CollectiveRecorder(torch.device("cpu"))
    rec.begin(0, "forward", time.perf_counter())
    timed, bare = _TimedWork(Done(), rec, {"op": "all_gather", "method": "x", "seq": 0}), Done()
    extra = _per_call_us(timed.wait, calls) - _per_call_us(bare.wait, calls)
    rec.collect_blocked()
    return extra


if __name__ == "__main__":
    sys.exit(main())
