"""A fake of the few torch.cuda calls dtlab.rank.marks makes, for testing GPU timing logic on a CPU machine.

It keeps what real CUDA enforces and what the timing bugs broke: the current device is per thread (a new thread,
like gloo's worker, starts on device 0), an event records on the current stream of the current device unless a
stream is given, and `elapsed_time` between events of two devices raises, as CUDA does. Times come from a
settable clock, so a test states when each mark happens.

In a rank process (`rank_marks`, named by the test-only hook DTLAB_MARKS_HOOK of dtlab.rank.marks) the clock is the
device's own: `TickClock` advances one tick (1 s) with every event the device reaches, whatever the host does, and
every host call (synchronize, a wait) returns at once. A figure taken on the rank's marks is then a whole number of
ticks; one taken with the host's clock (time.perf_counter) is a fraction of a second.
"""

import contextlib
import itertools
import threading


class FakeStream:
    def __init__(self, device: int, name: str):
        self.device, self.name = device, name

    def __repr__(self):
        return f"FakeStream({self.name}@cuda:{self.device})"


class FakeEvent:
    def __init__(self, cuda):
        self.cuda, self.stream, self.t, self.recorded_on_device = cuda, None, None, None

    def record(self, stream=None):
        if stream is not None and not isinstance(stream, FakeStream):  # a library's own stream object (DeepSpeed's)
            stream = FakeStream(self.cuda.current_device(), f"foreign:{type(stream).__name__}")
        self.stream = stream or self.cuda.current_stream()
        self.recorded_on_device = self.cuda.current_device()
        self.t = self.cuda.now()
        self.cuda.log.append(("record", threading.current_thread().name, self.recorded_on_device, self.stream))

    def synchronize(self):
        assert self.t is not None, "synchronize() on an event never recorded"

    def elapsed_time(self, other):
        if self.stream.device != other.stream.device:
            raise RuntimeError("Both events must be recorded on the same device")  # CUDA's own rule
        return (other.t - self.t) * 1e3


class FakeCudaModule:
    """`torch.cuda` as far as dtlab.rank.marks uses it."""

    def __init__(self, clock):
        self.now = clock
        self.log = []
        self._local = threading.local()
        self._defaults = {}
        self.waits = []

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, d: int) -> None:
        self._local.device = d or 0  # a CPU device (index None) stands for device 0

    def synchronize(self, device=None) -> None:
        """The host waits for the device: returns at once (the fake device has no queue)."""
        self.log.append(("synchronize", threading.current_thread().name, self.current_device(), None))

    def current_stream(self, device=None):
        d = self.current_device() if device is None else (getattr(device, "index", device) or 0)
        streams = getattr(self._local, "streams", {})
        return streams.get(d) or self._defaults.setdefault(d, FakeStream(d, "default"))

    @contextlib.contextmanager
    def device(self, d):
        d = getattr(d, "index", d) or 0
        prev = self.current_device()
        self.set_device(d)
        try:
            yield
        finally:
            self.set_device(prev)

    @contextlib.contextmanager
    def stream(self, s):
        if not hasattr(self._local, "streams"):
            self._local.streams = {}
        prev = self._local.streams.get(s.device)
        self._local.streams[s.device] = s
        try:
            yield
        finally:
            self._local.streams[s.device] = prev

    def Event(self, enable_timing=True):  # noqa: N802 - torch's name
        return FakeEvent(self)


class FakeTorch:
    """The `torch_mod` a Marks object is given in tests: only `.cuda`."""

    def __init__(self, clock):
        self.cuda = FakeCudaModule(clock)


class FakeCudaFuture:
    """A completed CUDA future (what NCCL's Work returns): wait() makes the current stream wait on it."""

    def __init__(self, cuda, done=True):
        self.cuda, self._done = cuda, done

    def done(self):
        return self._done

    def wait(self):
        self.cuda.waits.append(self.cuda.current_stream())


class Clock:
    """A settable clock: `clock.t = 2.5`; calling it returns the time."""

    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def make_owned(calls):
    """A stream factory like dtlab.rank.marks.owned_stream that records (device, thread) of each call."""

    def make(device, torch_mod):
        d = getattr(device, "index", device) or 0  # a CPU device (index None) stands for device 0
        calls.append((d, threading.current_thread().name))
        return FakeStream(d, f"owned{len(calls)}"), "fake owned stream"

    return make


class TickClock:
    """The fake device's clock: every reading is the next whole tick (TICK seconds), so time on the device moves
    only as the device reaches events, never with the host."""

    TICK = 1.0

    def __init__(self):
        self._n = itertools.count(1)
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            return next(self._n) * self.TICK


#: The timing path a rank under the hook pretends to be on: 'nccl' (default) or 'gloo_cuda'.
PATH_ENV = "DTLAB_FAKE_CUDA_PATH"


def rank_marks(device, backend, synced=False):
    """DTLAB_MARKS_HOOK's entry point in a rank (a CPU rank on gloo): the rank's Marks take the CUDA path named by
    DTLAB_FAKE_CUDA_PATH on a fake CUDA whose events read the device's TickClock."""
    import os

    from dtlab.rank.marks import Marks, SyncedMarks

    clock = TickClock()
    fake = FakeTorch(clock)
    calls = []
    cls = SyncedMarks if synced else Marks
    m = cls(
        device,
        backend,
        torch_mod=fake,
        clock=clock,
        make_stream=make_owned(calls),
        path=os.environ.get(PATH_ENV, "nccl"),
    )
    m.prepare()
    return m
