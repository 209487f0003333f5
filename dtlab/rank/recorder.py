"""What a rank records, and how, without disturbing what it measures.

- `EventWriter` appends one JSON object per line to events/rank{r}.jsonl, one write per line, so a crash
  loses at most the line being written; a full disk raises DiskFull.
- `StepClock` times forward / backward / optimizer: wall clock on CPU; on GPU, CUDA events on the compute
  stream that are read once per step, after the optimizer (the only CPU-GPU sync point per step).
- `BucketRecorder` is a DDP comm hook. For every gradient bucket it records index, bytes, parameter count,
  when the bucket became ready, when its all-reduce was issued and when it finished, in seconds from the step
  start, plus the backend's own duration where it has one (NCCL). It never synchronises per bucket: that
  would serialise the very overlap being measured.
"""

from __future__ import annotations

import json
import os
import resource
import threading
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtlab.config.placement import TIMING
from dtlab.rank.marks import Marks
from dtlab.runfiles import DiskFull, is_disk_error


class EventWriter:
    """Append-only JSONL writer: one write(2) per line, straight to the file (nothing buffered in the process),
    so a crash loses at most the line being written. Safe to call from the gloo completion threads.

    A restarted rank (torchrun --max-restarts) appends to the file of the attempt before it; with `attempt` set,
    every record carries it. A rank killed in the middle of a line leaves it without its newline: opening ends
    that torn line first, so it stays one unreadable line (skipped by readers) instead of swallowing the first
    new record. A write the disk refuses raises `DiskFull` (dtlab.runfiles) and the writer stays failed: every
    later write raises again, so a write from a thread that swallows errors cannot hide it from the next one."""

    def __init__(self, path: str, attempt: int | None = None):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        self.failed: OSError | None = None
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._extra = {} if attempt is None else {"attempt": attempt}
        self._lock = threading.Lock()
        if os.fstat(self._fd).st_size > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._put(b"\n")

    def _put(self, data: bytes) -> None:
        if self.failed is not None:
            raise (
                DiskFull(self.path, self.failed)
                if is_disk_error(self.failed)
                else OSError(self.failed.errno, f"an earlier write failed: {self.failed.strerror}", self.path)
            )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            self.failed = e
            raise (DiskFull(self.path, e) if is_disk_error(e) else e) from None

    def write(self, kind: str, **fields) -> None:
        """Append one event (`kind` and `fields`, plus `attempt` when set) as one line."""
        line = json.dumps({"kind": kind, **self._extra, **fields}, default=float) + "\n"
        with self._lock:
            self._put(line.encode())

    def close(self) -> None:
        """Close the file (never raises: every line was already written, or its write raised)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Mark(Enum):
    """The points of a step its clock marks (`StepClock.mark`), one meaning each; a micro-batch's forward and
    backward marks carry its index as well. The loop derives a step event's times from them (dtlab.rank.loop)."""

    START = "start"
    """The step's clock starts."""
    FWD = "fwd"
    """Forward ended (a micro-batch's forward, with its index)."""
    BWD = "bwd"
    """Backward ended (a micro-batch's backward, with its index)."""
    OPTIM = "optim"
    """The optimizer itself ended, where more of the optimizer phase follows it (local SGD's average)."""
    OPT = "opt"
    """The optimizer phase ended: the step's end."""
    PIPE = "pipe"
    """A pipeline stage's part of the schedule ended."""
    PUSH_START = "push_start"
    """An asynchronous worker starts sending its gradient."""
    PUSH_END = "push_end"
    """Its gradient is sent."""
    PULL_END = "pull_end"
    """The server's parameters are received."""


class StepClock:
    """Marks points within a step (`Mark`) and returns seconds from the step start for each, on the rank's marks
    (dtlab.rank.marks): wall clock on CPU, CUDA events on the current (compute) stream on GPU, read once per step.
    `marks` is the rank's `Marks` (dtlab.rank.marks.rank_marks), which knows the device and the path."""

    def __init__(self, marks: Marks):
        self.marks = marks
        self.cuda = marks.cuda
        self._marks: list[tuple[Mark | tuple[Mark, int], object]] = []

    def mark(self, mark: Mark, micro: int | None = None) -> None:
        """`mark` (of micro-batch `micro`, when given), now, on the training thread's current stream (or the wall
        clock)."""
        if not isinstance(mark, Mark):
            raise TypeError(f"a step's mark is one of {', '.join(f'Mark.{m.name}' for m in Mark)}, got {mark!r}")
        self._marks.append((mark if micro is None else (mark, micro), self.marks.now()))

    @property
    def start(self):
        return self._marks[0][1]

    def read(self) -> dict[Mark | tuple[Mark, int], float]:
        """Seconds from the first mark to each mark. On GPU this waits for the step's work to finish (the step's
        one sync point: every other mark of the step is read after it)."""
        t0 = self._marks[0][1]
        if self.cuda:
            self._marks[-1][1].synchronize()  # one sync per step, at its end
        out = {name: self.marks.seconds(t0, m) for name, m in self._marks}
        self._marks = []
        return out


class BucketRecorder:
    """DDP comm hook that all-reduces (averages) each bucket like DDP's default hook and records its timing.

    One code path for gloo (CPU or CUDA tensors) and NCCL. Per bucket, in this order:

    1. the bucket is divided by the world size on the caller's stream (the compute stream on GPU; the autograd
       thread on CPU), as torch's own `allreduce_hook` does. Dividing *before* "ready" keeps anything dtlab
       adds off the communication channel: nothing sits between two consecutive all-reduces;
    2. `t_ready`: a mark on that stream (a CUDA event on GPU, the wall clock on CPU): the bucket's gradients
       are computed and averaged;
    3. the all-reduce is issued at once (`async_op=True`), so `t_start`, the issue time, is the same mark as
       `t_ready` on every path (on GPU the backend's stream or copy stream is made to wait on the compute
       stream at exactly this point). t_start means "handed to the backend": the transfer itself may begin
       later when an earlier bucket still occupies the channel (gloo runs its queue on worker threads, NCCL on
       one stream). NCCL's own timing (below) gives the service time; `Run.crosscheck()` compares the two;
    4. `t_end`: a mark taken in the callback of the Work's future, on the path `dtlab.rank.marks` names for
       where the rank runs: CPU, the wall clock in gloo's thread the moment the collective completes; NCCL, a
       CUDA event on the CUDA future's callback stream, which was made to wait on the collective (the
       stream-level join `work.block_current_stream()` would make, without blocking the CPU); gloo on CUDA
       tensors, an event on a stream dtlab owns on the rank's GPU, under a device guard (gloo's thread has
       none), marking the moment gloo finished in host memory (the copy back to the GPU not included).

    Nothing synchronises per bucket. The step's events are read in `collect()`, after the step's one sync.
    With NCCL, `TORCH_NCCL_ENABLE_TIMING=1` (set by dtlab's ranks) also makes NCCL time each collective on
    its own stream; `collect()` adds that as `backend_ms` (None on gloo), a cross-check of t_end - t_start.

    `mode = "noop"` is the compute baseline: the same hook minus the collective (`_baseline`): same division,
    same marks, the same callback chained on an already completed future. DDP's bare `noop_hook` would skip the
    hook's own Python and dispatch work (8-10 us per bucket on this project's CPU machine, benchmarks/hook_cost.py;
    more on a GPU, where the marks are CUDA events), which the measured steps pay, and T_step - T_comp would
    count it as exposed communication.
    Steps 3 and 4 are the `transport`'s (default `AllReduceTransport`, DDP's all-reduce); strategy 'ps' passes
    its reduce + broadcast (dtlab.rank.strategies.ps), which may add marks of its own (`rec["_t_<name>"]` ->
    `t_<name>`).
    """

    def __init__(self, world_size: int, marks: Marks, codec=None, transport=None):
        self.world = world_size
        self.codec = codec  # dtlab.rank.compression.Codec, or None for the plain fp32 all-reduce
        # how a divided bucket is reduced: DDP's all-reduce, or a strategy's own (dtlab.rank.strategies.ps)
        self.transport = transport if transport is not None else AllReduceTransport()
        self.marks = marks
        self.cuda = marks.cuda
        self.mode = "allreduce"
        self.step_start = None  # perf_counter float (CPU) or CUDA event (GPU)
        self._recs: list[dict] = []
        self._lock = threading.Lock()

    def begin_step(self, step_start) -> None:
        self.step_start = step_start
        with self._lock:
            self._recs = []

    def _mark(self):
        """A point in time on the current stream (CUDA event) or the wall clock (CPU)."""
        return self.marks.now()

    def _end_mark(self):
        """A completion mark, taken in a collective's callback (see `dtlab.rank.marks`)."""
        return self.marks.end() if self.marks.path != "wall" else self._mark()

    def hook(self, state, bucket):
        """The comm hook (register the bound method: DDP checks its name and signature)."""
        if self.mode == "noop":
            return self._baseline(bucket)
        if self.codec is not None:
            return self._codec_hook(bucket)
        buf, rec = self._ready(bucket)
        # a transport's own marks are taken where its collectives complete (a callback or its own thread)
        fut, value = self.transport.issue(buf, rec, self._end_mark)  # sets rec["_start"], rec["_work"]
        return self._track(rec, fut, value)

    def _ready(self, bucket):
        buf = bucket.buffer()
        buf.div_(self.world)  # on the compute stream, before "ready": off the communication channel
        rec = {
            "bucket": bucket.index(),
            "nbytes": buf.numel() * buf.element_size(),
            "nparams": len(bucket.parameters()),
        }
        rec["wire_bytes"] = rec["nbytes"]
        rec["_ready"] = self._mark()
        return buf, rec

    def _baseline(self, bucket):
        """The no-communication baseline: everything `hook` does except the collective (see the class doc).
        The bucket keeps this rank's own averaged gradient, as with DDP's no-op hook (nothing is exchanged)."""
        buf, rec = self._ready(bucket)
        rec["_start"], rec["_work"] = rec["_ready"], None
        fut = torch.futures.Future()
        fut.set_result([buf])
        return self._track(rec, fut, lambda f: f.value()[0])

    def _track(self, rec: dict, fut, value):
        with self._lock:
            self._recs.append(rec)

        def done(f):
            if "_end" not in rec:  # a transport may have marked the end itself, where it completed
                rec["_end"] = self._end_mark()
            return value(f)

        return fut.then(done)

    def _codec_hook(self, bucket):
        """A torch compression hook, recorded: t_ready before it runs, t_start when it returned (the bucket was
        encoded, divided by p and its first collective issued: t_start - t_ready is the encode time), t_end when
        its future completed (the last collective and the decode: t_end - t_start is communication plus
        decode), and the bytes it put on the wire."""
        buf = bucket.buffer()
        rec = {
            "bucket": bucket.index(),
            "nbytes": buf.numel() * buf.element_size(),
            "nparams": len(bucket.parameters()),
            "_ready": self._mark(),
            "_work": None,
        }
        fut, rec["wire_bytes"] = self.codec(bucket)
        rec["_start"] = self._mark()
        return self._track(rec, fut, lambda f: f.value())

    def collect(self) -> list[dict]:
        """The buckets of the finished step, times in seconds from the step start. Call after the step's
        clock was read (on GPU that read was the step's sync point: DDP's backward made the compute stream
        wait on every bucket's future, so every event here has completed)."""
        with self._lock:
            recs, self._recs = self._recs, []
        out = []
        for rec in recs:
            ready, start, end, work = rec.pop("_ready"), rec.pop("_start"), rec.pop("_end", None), rec.pop("_work")
            extra = {k[1:]: rec.pop(k) for k in [k for k in rec if k.startswith("_t_")]}  # a transport's own marks
            t = lambda m: self.marks.seconds(self.step_start, m)  # noqa: E731
            rec.update(
                t_ready=t(ready),
                t_start=t(start),
                t_end=t(end),
                backend_ms=backend_duration_ms(work),
                **{k: t(v) for k, v in extra.items()},
            )
            out.append(rec)
        return out


def recorder_facts(recorder: BucketRecorder) -> dict:
    """How this rank's bucket marks were taken, for config.json's resolved facts (see dtlab.rank.marks)."""
    m = recorder.marks
    return {
        "bucket_timing": {
            "path": m.path,
            "how": TIMING[m.path],
            "end_stream": m.stream_how,
            "baseline": "the recording hook minus the collective (same division, marks and "
            "callback), so T_step - T_comp leaves out the hook's own cost",
        },
        "timing_method": m.facts(),
        "ddp_broadcast_buffers": False,
    }


class AllReduceTransport:
    """DDP's own reduction of a bucket: one async all-reduce of the (already divided) buffer, issued at once, so
    t_start is the ready mark. Strategies with another collective pattern pass their own transport."""

    def issue(self, buf, rec: dict, mark):
        """Start reducing `buf`; set rec["_start"] and rec["_work"]; return (future, value of the future)."""
        rec["_start"] = rec["_ready"]
        work = dist.all_reduce(buf, async_op=True)
        rec["_work"] = work
        return work.get_future(), lambda f: f.value()[0]

    def close(self) -> None:
        """Nothing to release."""


def backend_duration_ms(work) -> float | None:
    """The collective's duration as the backend itself measured it (NCCL with TORCH_NCCL_ENABLE_TIMING=1:
    CUDA events around the kernel on NCCL's stream), in milliseconds; None where unavailable (gloo)."""
    try:
        ms = float(work._get_duration())
    except Exception:  # noqa: BLE001 - gloo raises; a private API that may change between torch versions
        return None
    return ms if ms >= 0 else None


def tensor_bytes(tensors) -> int:
    """Bytes held by an iterable of tensors (None entries skipped)."""
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor in an optimizer's state (e.g. AdamW's exp_avg and exp_avg_sq)."""
    return tensor_bytes(v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))


def local_tensor(t):
    """This rank's part of `t`: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard; None skipped)."""
    return int(sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors if t is not None))


def held_bytes(params, opt) -> dict:
    """What this rank holds: its parameters, gradients and optimizer state (local shards)."""
    params = list(params)
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return {
        "params_bytes": local_bytes(params),
        "grads_bytes": local_bytes(p.grad for p in params),
        "opt_bytes": local_bytes(state),
    }


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what it is): CUDA max allocated on GPU, the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak_rss"  # ru_maxrss is KiB on Linux
