"""Time marks for a rank's communication records: which clock, which stream, which device.

Three paths, chosen once per rank from where it runs (`dtlab.config.placement.timing_path`), with the same words in
the docs (docs/gpus.md) and on screen (`dtlab.config.placement.TIMING`):

- `wall` (CPU ranks, gloo): every mark is `time.perf_counter()`. A completion callback runs in gloo's thread
  the moment the collective completes.
- `nccl` (NCCL on CUDA): marks are CUDA events. A mark taken on the issuing thread lands on its current stream
  (the compute stream for DDP's ready mark). An end mark needs a stream that waited for the collective: NCCL's
  futures are CUDA futures, completed as soon as the kernel is queued, whose callbacks run on a torch pool
  stream made to wait on the kernel. DDP takes its end there. ZeRO-3 cannot: DeepSpeed's side streams come
  from the same pool (32 streams per priority), so about 3 collectives in 32 would find DeepSpeed's queued
  work in front of their end event. `after(fut, group)` instead makes a stream dtlab owns wait on the future
  and records the end there (one owned stream per process group: collectives of one group complete in order
  on one NCCL stream, so the owned stream's queue of waits adds nothing).
- `gloo_cuda` (gloo on CUDA tensors): gloo's futures are CPU futures that complete on a gloo worker thread
  which never set a CUDA device or stream, so an event recorded in the callback would land on cuda:0's
  default stream, the compute stream (and, for ranks on cuda:k, on another device than the step's clock).
  The end mark is taken under a device guard for the rank's own GPU, as an event on a stream dtlab owns there.
  That stream holds nothing else, so the event completes as soon as it is queued: it puts the host moment
  gloo finished (the collective is done in host memory; the copy back to the GPU, queued by gloo on its own
  stream, is not included) on the GPU's clock, where the step's and the ready marks are.

An owned stream is made with the CUDA driver (`cuStreamCreate`, non-blocking, in the device's primary
context) and wrapped as `torch.cuda.ExternalStream`; torch's `torch.cuda.Stream()` would hand out a pool
stream that NCCL, gloo and DeepSpeed also use. If the driver call fails, a pool stream is used and
`stream_how` says so (it is recorded with the run). Making one synchronises the device (the driver needs the
primary context current on the calling thread), so `prepare()` makes the streams a rank will use on its main
thread before its first step; one made later (a process group first met inside a step) is counted in
`facts()["streams_made_in_steps"]`.

Every strategy takes its marks here, one `Marks` per rank made by `rank_marks(device, backend)`: the step clock
(dtlab.rank.recorder.StepClock), DDP's buckets, ZeRO-3's collectives, the collectives and waits of 'tp', 'pp' and
'fsdp2' (dtlab.rank.collectives), the pipeline's micro-batches and local SGD's average. A mark taken on the
training thread is a CUDA event on its current stream; where that stream is not the compute stream (FSDP2's
all-gather and reduce-scatter streams) a wait is timed on the compute stream instead (`compute_mark`,
`on_compute_stream`). `facts()` is what a run records about it (`resolved.timing_method`), and the words every
screen uses follow that record (dtlab.config.placement.TIMING_METHODS).

Tests replace the CUDA a rank's marks use with a fake one (tests/fake_cuda.py) through `DTLAB_MARKS_HOOK`, a
test-only hook: "FILE.py:FUNCTION", called as FUNCTION(device, backend) -> Marks instead of building one here.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import time

from dtlab.config.placement import TIMING_METHODS, timing_method, timing_path

#: A test-only hook: "path/to/file.py:function", called as function(device, backend) -> Marks (see the docstring).
HOOK_ENV = "DTLAB_MARKS_HOOK"


def owned_stream(device, torch_mod=None):
    """(stream, how): a CUDA stream on `device` that only dtlab uses, non-blocking with respect to the legacy
    default stream; a torch pool stream, labelled as such, when the driver cannot make one."""
    torch = torch_mod or __import__("torch")
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # the runtime has made the device's primary context current here
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            handle = ctypes.c_void_p()
            rc = lib.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(1))  # 1 = CU_STREAM_NON_BLOCKING
            if rc != 0 or not handle.value:
                raise OSError(f"cuStreamCreate returned CUresult {rc}")
            return (
                torch.cuda.ExternalStream(handle.value, device=device),
                "dtlab's own stream (cuStreamCreate, non-blocking)",
            )
        except (OSError, AttributeError) as e:
            return (
                torch.cuda.Stream(device=device),
                f"a torch pool stream (the driver gave no stream of dtlab's own: {e}); other work may share it",
            )


class Marks:
    """Time marks of one rank on one clock (see the module docstring for the three paths).

    `now()`: a mark on the calling thread's current stream (or the wall clock). `end()`: a mark for a
    completion callback, on whatever thread runs it. `after(fut, group)`: on `nccl`, an end mark that completes
    with the collective behind `fut`, taken at issue on an owned stream; None on the other paths (take `end()`
    in the callback instead). `compute_mark()`: a mark on the compute stream whatever stream is current.
    `seconds(ref, mark)`: seconds from `ref` to `mark`, read after the step's one sync point.

    `torch_mod`, `clock` and `make_stream` are for tests (a fake CUDA, a fake clock); a rank passes nothing."""

    def __init__(
        self,
        device,
        backend: str,
        torch_mod=None,
        clock=time.perf_counter,
        make_stream=owned_stream,
        path: str | None = None,
    ):
        self.device = device
        self.path = path or timing_path(device.type, backend)
        self.cuda = self.path != "wall"
        self._torch = torch_mod if torch_mod is not None else (__import__("torch") if self.cuda else None)
        self._clock = clock
        self._make_stream = make_stream
        self._streams: dict = {}
        self._lock = threading.Lock()
        self.stream_how = None
        self._sealed = False
        self.made_in_steps = 0
        # the training thread's current stream when the rank starts: the compute stream its steps run on
        self.compute_stream = self._torch.cuda.current_stream(device) if self.cuda else None

    def _stream(self, key=None):
        """The owned stream for `key` (a process group; None = the default), made on first use."""
        with self._lock:
            if key not in self._streams:
                s, how = self._make_stream(self.device, self._torch)
                self._streams[key] = s
                self.stream_how = how
                self.made_in_steps += self._sealed
            return self._streams[key]

    def prepare(self, groups=()) -> None:
        """Make the owned streams now, on the rank's main thread before its first step: the default one (gloo on
        CUDA: every end mark; NCCL: the default group's) and one per process group in `groups` (NCCL). Making a
        stream synchronises the device; done here, no step pays for it and no callback makes one on a foreign
        thread. Call again with more groups before the steps start; `seal()` marks where the steps start."""
        if self.path == "wall":
            return
        self._stream()
        if self.path == "nccl":
            for g in groups:
                self._stream(_group_key(g))

    def seal(self) -> None:
        """The steps start: a stream made after this is counted in `facts()` (it synchronised inside a step)."""
        self._sealed = True

    def _event(self):
        return self._torch.cuda.Event(enable_timing=True)

    def now(self):
        """A mark on the current stream of the calling thread (CUDA), or the wall clock (CPU)."""
        if not self.cuda:
            return self._clock()
        ev = self._event()
        ev.record()
        return ev

    def compute_mark(self):
        """A mark on the compute stream (the one current on the training thread when the rank started), whatever
        stream is current now: where a wait on a side stream meets the compute stream. The wall clock on CPU."""
        if not self.cuda:
            return self._clock()
        ev = self._event()
        ev.record(self.compute_stream)
        return ev

    def on_compute_stream(self) -> bool:
        """Whether work issued now runs on the compute stream (always on CPU, where there are no streams)."""
        return (not self.cuda) or self._torch.cuda.current_stream() == self.compute_stream

    def end(self):
        """A completion mark, for a collective's done callback (see the module docstring)."""
        if self.path == "wall":
            return self._clock()
        if self.path == "nccl":  # a CUDA future's callback: its current stream waited for the collective
            return self.now()
        with self._torch.cuda.device(self.device):  # gloo's thread has no device of its own: use the rank's
            ev = self._event()
            ev.record(self._stream())
            return ev

    def after(self, fut, group=None):
        """NCCL: an event on dtlab's own stream for `group` that completes when the collective behind the
        (already completed) CUDA future `fut` does. None on the other paths, or when `fut` is not done."""
        if self.path != "nccl" or not fut.done():
            return None
        s = self._stream(_group_key(group))
        with self._torch.cuda.stream(s):
            fut.wait()  # a completed CUDA future: makes the current (owned) stream wait on its events; no CPU block
            ev = self._event()
            ev.record(s)
        return ev

    def seconds(self, ref, mark):
        """Seconds from `ref` to `mark`; None if either is None. On CUDA this reads events of a finished step."""
        if ref is None or mark is None:
            return None
        if not self.cuda:
            return mark - ref
        mark.synchronize()  # after the step's sync point: already complete, so it stalls nothing
        return ref.elapsed_time(mark) / 1e3

    @property
    def method(self) -> str:
        """'cuda_events' or 'wall_clock': how this rank's figures are taken (dtlab.config.placement)."""
        return timing_method(self.path)

    def facts(self) -> dict:
        """What a run records about its marks (`resolved.timing_method`): the method and its words, the path, the
        owned streams' kind and how many were made inside a step."""
        return {
            "method": self.method,
            "how": TIMING_METHODS[self.method],
            "path": self.path,
            "end_stream": self.stream_how,
            "streams_made_in_steps": self.made_in_steps,
        }


class SyncedMarks(Marks):
    """Marks on the host's wall clock taken after the device finished its queued work (`torch.cuda.synchronize`
    on CUDA): for a strategy whose communication blocks the host anyway (the asynchronous parameter server's
    messages travel through gloo in host memory), where a synchronisation per mark hides nothing."""

    def now(self):
        if self.cuda:
            self._torch.cuda.synchronize(self.device)
        return self._clock()

    compute_mark = end = now

    def prepare(self, groups=()) -> None:
        """Nothing to make: no mark is taken on a stream."""

    def after(self, fut, group=None):
        return None

    def seconds(self, ref, mark):
        return None if ref is None or mark is None else mark - ref

    @property
    def method(self) -> str:
        return "wall_clock_synced" if self.cuda else "wall_clock"


def _group_key(group):
    """One owned stream per process group; the default group, named or not, is None."""
    if group is None:
        return None
    try:
        import torch.distributed as dist

        if group is dist.group.WORLD:
            return None
    except (ImportError, AttributeError):
        pass
    return id(group)


def rank_marks(device, backend: str, synced: bool = False) -> Marks:
    """The one `Marks` of a rank (every clock of its steps and its communication), its streams prepared; a
    `SyncedMarks` when `synced`. A test may replace it through `DTLAB_MARKS_HOOK` (see the module docstring)."""
    hook = os.environ.get(HOOK_ENV)
    if hook:
        path, _, name = hook.rpartition(":")
        spec = importlib.util.spec_from_file_location("_dtlab_marks_hook", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return getattr(mod, name)(device, backend, synced)
    m = (SyncedMarks if synced else Marks)(device, backend)
    m.prepare()
    return m
