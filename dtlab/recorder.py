"""What a rank records, and how, without disturbing what it measures.

- `EventWriter` appends one JSON object per line to events/rank{r}.jsonl and flushes each line, so a crash
  loses at most the line being written.
- `StepClock` times forward / backward / optimizer: wall clock on CPU; on GPU, CUDA events on the compute
  stream that are read once per step, after the optimizer (the only CPU-GPU sync point per step).
- `BucketRecorder` is a DDP comm hook. For every gradient bucket it records index, bytes, parameter count,
  when the bucket became ready, when its all-reduce started and when it finished, in seconds from the step
  start. It never synchronises per bucket: that would serialise the very overlap being measured.
"""

from __future__ import annotations

import json
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook


class EventWriter:
    """Append-only JSONL writer, flushed per line. Safe to call from the gloo completion threads."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, kind: str, **fields) -> None:
        line = json.dumps({"kind": kind, **fields}, default=float)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()


class StepClock:
    """Marks named points within a step and returns seconds from the step start for each."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append((name, ev))
        else:
            self._marks.append((name, time.perf_counter()))

    @property
    def start(self):
        return self._marks[0][1]

    def read(self) -> dict[str, float]:
        """Seconds from the first mark to each mark. On GPU this waits for the step's work to finish."""
        if self.cuda:
            self._marks[-1][1].synchronize()  # one sync per step, at its end
            t0 = self._marks[0][1]
            out = {name: t0.elapsed_time(ev) / 1e3 for name, ev in self._marks}
        else:
            t0 = self._marks[0][1]
            out = {name: t - t0 for name, t in self._marks}
        self._marks = []
        return out


class BucketRecorder:
    """DDP comm hook that all-reduces (averages) each bucket like DDP's default hook and records its timing.

    `mode = "noop"` switches to DDP's own no-op hook (no communication at all) for the compute baseline.
    On gloo the start time is when the all-reduce is handed to the process group; the end time is taken in
    the completion callback that gloo runs the moment the collective finishes. On NCCL, CUDA events on a
    side stream bracket the collective: start after the bucket's gradients are ready, end after NCCL's
    stream is done with it (joined with work.wait(), which blocks the stream, not the CPU).
    """

    def __init__(self, world_size: int, device: torch.device):
        self.world = world_size
        self.cuda = device.type == "cuda"
        self.mode = "allreduce"
        self.step_start = None  # perf_counter float (CPU) or CUDA event (GPU)
        self._recs: list[dict] = []
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device=device) if self.cuda else None

    def begin_step(self, step_start) -> None:
        self.step_start = step_start
        self._recs = []

    def hook(self, state, bucket):
        """The comm hook (register the bound method: DDP checks its name and signature)."""
        if self.mode == "noop":
            return noop_hook(state, bucket)
        buf = bucket.buffer()
        rec = {"bucket": bucket.index(), "nbytes": buf.numel() * buf.element_size(),
               "nparams": len(bucket.parameters())}
        if self.cuda:
            return self._hook_cuda(buf, rec)
        rec["t_ready"] = time.perf_counter()
        buf.div_(self.world)
        rec["t_start"] = time.perf_counter()
        fut = dist.all_reduce(buf, async_op=True).get_future()
        with self._lock:
            self._recs.append(rec)

        def done(f):
            rec["t_end"] = time.perf_counter()  # runs in gloo's thread as soon as the collective completes
            return f.value()[0]

        return fut.then(done)

    def _hook_cuda(self, buf, rec):
        ready, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        ready.record()  # compute stream: the gradients in this bucket are done
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            buf.div_(self.world)  # on the side stream, so NCCL (which waits on this stream) sees it done
            start.record(self._stream)
            work = dist.all_reduce(buf, async_op=True)
            work.wait()  # stream-level join with NCCL's stream; the CPU does not block
            end.record(self._stream)
        rec.update(_events=(ready, start, end))
        self._recs.append(rec)
        return work.get_future().then(lambda f: f.value()[0])

    def collect(self) -> list[dict]:
        """The buckets of the finished step, times in seconds from the step start. Call after the step's
        clock was read (on GPU that read was the step's sync point, so every event here has completed)."""
        out = []
        if self.cuda:
            self._stream.synchronize()  # end events live on the side stream; nearly free after the step sync
        with self._lock:
            recs = list(self._recs)
        for rec in recs:
            if self.cuda:
                t0 = self.step_start
                evs = rec.pop("_events")
                rec.update({k: t0.elapsed_time(e) / 1e3 for k, e in zip(("t_ready", "t_start", "t_end"), evs)})
            else:
                for k in ("t_ready", "t_start", "t_end"):
                    rec[k] = rec[k] - self.step_start if k in rec else None
            out.append(rec)
        return out


def tensor_bytes(tensors) -> int:
    """Bytes held by an iterable of tensors (None entries skipped)."""
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor in an optimizer's state (e.g. AdamW's exp_avg and exp_avg_sq)."""
    return tensor_bytes(v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what it is): CUDA max allocated on GPU, the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak_rss"  # ru_maxrss is KiB on Linux
