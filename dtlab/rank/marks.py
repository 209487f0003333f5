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
`stream_how` says so (it is recorded with the run).
"""

from __future__ import annotations

import threading
import time

from dtlab.config.placement import timing_path  # noqa: F401 - the path rule lives with the placement (pure)


def owned_stream(device, torch_mod=None):
    """(stream, how): a CUDA stream on `device` that only dtlab uses, non-blocking with respect to the legacy
    default stream; a torch pool stream, labelled as such, when the driver cannot make one."""
    import ctypes

    torch = torch_mod or __import__("torch")
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # the runtime has made the device's primary context current here
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            handle = ctypes.c_void_p()
            rc = lib.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(1))  # 1 = CU_STREAM_NON_BLOCKING
            if rc != 0 or not handle.value:
                raise OSError(f"cuStreamCreate returned CUresult {rc}")
            return (torch.cuda.ExternalStream(handle.value, device=device),
                    "dtlab's own stream (cuStreamCreate, non-blocking)")
        except (OSError, AttributeError) as e:
            return (torch.cuda.Stream(device=device),
                    f"a torch pool stream (the driver gave no stream of dtlab's own: {e}); other work may share it")


class Marks:
    """Time marks of one rank on one clock (see the module docstring for the three paths).

    `now()`: a mark on the calling thread's current stream (or the wall clock). `end()`: a mark for a
    completion callback, on whatever thread runs it. `after(fut, group)`: on `nccl`, an end mark that completes
    with the collective behind `fut`, taken at issue on an owned stream; None on the other paths (take `end()`
    in the callback instead). `seconds(ref, mark)`: seconds from `ref` to `mark`.

    `torch_mod`, `clock` and `make_stream` are for tests (a fake CUDA, a fake clock); a rank passes nothing."""

    def __init__(self, device, backend: str, torch_mod=None, clock=time.perf_counter, make_stream=owned_stream):
        self.device = device
        self.path = timing_path(device.type, backend)
        self.cuda = self.path != "wall"
        self._torch = torch_mod if torch_mod is not None else (__import__("torch") if self.cuda else None)
        self._clock = clock
        self._make_stream = make_stream
        self._streams: dict = {}
        self._lock = threading.Lock()
        self.stream_how = None

    def _stream(self, key=None):
        """The owned stream for `key` (a process group; None = the default), made on first use."""
        with self._lock:
            if key not in self._streams:
                s, how = self._make_stream(self.device, self._torch)
                self._streams[key] = s
                self.stream_how = how
            return self._streams[key]

    def prepare(self) -> None:
        """Make the default owned stream now (on the rank's main thread, where its device is current), so that
        no completion callback has to create it on a foreign thread."""
        if self.path == "gloo_cuda":
            self._stream()

    def _event(self):
        return self._torch.cuda.Event(enable_timing=True)

    def now(self):
        """A mark on the current stream of the calling thread (CUDA), or the wall clock (CPU)."""
        if not self.cuda:
            return self._clock()
        ev = self._event()
        ev.record()
        return ev

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
        s = self._stream(id(group) if group is not None else None)
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
