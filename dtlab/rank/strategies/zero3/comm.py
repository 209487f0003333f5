"""How ZeRO-3's collectives are recorded: `CollectiveRecorder` wraps DeepSpeed's comm backend and times each
collective in flight and each wait on one (see dtlab.rank.strategies.zero3.blocked for how blocked time is summed and
described).

Every ZeRO-3 collective goes through `deepspeed.comm`, and each of its public functions ends in exactly one
method of the live backend object `deepspeed.comm.comm.cdb`. Those methods are wrapped on the instance (an
instance attribute shadows the class method, and DeepSpeed looks the method up at call time). Module-level
patches would miss calls: `deepspeed.comm.X` is a star-import copy, and the backend caches
`torch.distributed.all_gather_into_tensor` / `reduce_scatter_tensor` when it is built. Start is taken when the
collective is issued, end when it completes (or when a blocking call returns); nothing waits, so the overlap
being measured is left alone. Which clock and stream each end mark uses is dtlab.rank.marks': on NCCL an event
on a stream dtlab owns, made to wait on the collective at issue (DeepSpeed's side streams share torch's pool
with the streams CUDA futures hand their callbacks); on gloo with CUDA tensors an event on dtlab's own stream,
under the rank's device guard, in the completion callback (gloo's thread has no device). On gloo the start of
an async op is its enqueue time, and queued ops can show overlapping intervals.

Byte counts follow the nccl-tests convention: all_gather = output (gathered) bytes, reduce_scatter = input
(unreduced) bytes, all_reduce / broadcast = tensor bytes.
"""

from __future__ import annotations

import os
import sys
import threading

from dtlab.rank.marks import Marks

COLLECTIVE_RECORDING = (
    "wrapped deepspeed.comm backend methods; start = issue time, end = completion (NCCL: an "
    "event on dtlab's own stream made to wait on the collective; gloo: its completion callback); "
    "no added synchronisation; blocked = timed Work.wait() of async collectives + the whole of "
    "blocking calls (+ GPU: reduce_and_partition_stream.synchronize)"
)

# DeepSpeed backend method -> (plain op name, (index, name) of the tensor(s) that give nccl-tests bytes,
# (index, name) of async_op). Indices are positional, after self, as in deepspeed/comm/torch.py (0.19.8).
_METHODS = {
    "all_gather_into_tensor": ("all_gather", (0, "output_tensor"), (3, "async_op")),
    "all_gather_base": ("all_gather", (0, "output_tensor"), (3, "async_op")),
    "all_gather": ("all_gather", (0, "tensor_list"), (3, "async_op")),
    "all_gather_coalesced": ("all_gather", (0, "output_tensors"), (3, "async_op")),
    "reduce_scatter_tensor": ("reduce_scatter", (1, "input_tensor"), (4, "async_op")),
    "reduce_scatter": ("reduce_scatter", (1, "input_list"), (4, "async_op")),
    "all_reduce": ("all_reduce", (0, "tensor"), (3, "async_op")),
    "all_reduce_coalesced": ("all_reduce", (0, "tensors"), (3, "async_op")),
    "inference_all_reduce": ("all_reduce", (0, "tensor"), None),
    "broadcast": ("broadcast", (0, "tensor"), (3, "async_op")),
    # Not used by ZeRO-3 training; wrapped so an unexpected one shows up under its own plain name.
    "reduce": ("reduce", (0, "tensor"), (4, "async_op")),
    "all_to_all_single": ("all_to_all", (1, "input"), (5, "async_op")),
    "all_to_all": ("all_to_all", (1, "input_tensor_list"), (3, "async_op")),
}

# Frames skipped when naming the DeepSpeed function that asked for a collective: the comm layers, and this
# module (the recorder's wrappers), named by its dotted path so the match holds wherever the package is installed.
_COMM_LAYERS = tuple(
    s.replace("/", os.sep)
    for s in (
        "deepspeed/comm/",
        "deepspeed/runtime/comm/",
        "deepspeed/utils/nvtx.py",
        "torch/distributed/",
        "torch/_dynamo/",
        "torch/utils/_contextlib.py",
        "torch/compiler/",
    )
) + (__name__.replace(".", os.sep) + ".py",)


class _TimedWork:
    """Stands in for the Work a wrapped async collective returned: everything is forwarded to the real Work,
    and `wait()` is timed (how long the training thread, or on GPU the compute stream, was blocked on it)."""

    __slots__ = ("_work", "_recorder", "_rec")

    def __init__(self, work, recorder: CollectiveRecorder, rec: dict):
        self._work, self._recorder, self._rec = work, recorder, rec

    def wait(self, *args, **kwargs):
        r = self._recorder
        a = r.compute_mark()
        err = None
        try:
            return self._work.wait(*args, **kwargs)
        except BaseException as e:
            err = repr(e)
            raise
        finally:
            r._add_blocked(self._rec, "wait", a, r.now(), err)

    def __getattr__(self, name):  # get_future, is_completed, result, ... go to the real Work
        return getattr(self._work, name)

    def __repr__(self) -> str:
        return f"_TimedWork({self._work!r})"


class CollectiveRecorder:
    """Wraps the DeepSpeed comm backend's methods and records each collective it issues, and how long the
    rank was blocked waiting for collectives.

    The training loop sets `step`, `phase` and the step's time reference with `begin()` / `phase`; records
    are buffered (completion callbacks run on the backend's threads, hence the lock) and handed out by
    `collect()` / `collect_blocked()` after the step.

    In flight (T_comm): start when issued, end when it completed (or when a blocking call returns). On GPU both
    ends are CUDA events: start on the issuing stream, end on a stream dtlab owns (`dtlab.rank.marks`), so no
    host sync is added and no other work queued on a shared stream delays the end.

    Blocked (exposed communication): intervals during which the rank could not compute because it waited for
    a collective, recorded as `wait` (`_TimedWork.wait()`), `blocking_call` (async_op=False) and, on GPU,
    `stream_sync` (`watch_stream`); dtlab.rank.strategies.zero3.blocked says how each is timed.
    """

    def __init__(self, device, backend: str | None = None, marks=None):
        if marks is None:
            marks = Marks(device, backend or ("nccl" if device.type == "cuda" else "gloo"))
            marks.prepare()
        self.marks, self.cuda = marks, marks.cuda
        self._torch = marks._torch  # torch itself on a GPU; a fake CUDA in tests
        self.step, self.phase, self._ref = -1, "init", None
        self.compute_stream = marks.compute_stream
        self._recs: list[dict] = []
        self._blocked: list[dict] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._last_seq: dict[str, int] = {}
        self.wrapped: list[str] = []
        self.watched: list[str] = []

    def install(self, backend=None) -> list[str]:
        """Wrap `backend`'s collective methods on the instance; returns the names wrapped.

        `backend` defaults to DeepSpeed's live backend object `deepspeed.comm.comm.cdb` (after
        deepspeed.init_distributed); any object with TorchBackend's method signatures works (tests use a fake).
        """
        if backend is None:
            import deepspeed.comm.comm as dscomm  # imported by now (engine.import_deepspeed); tests pass a fake

            backend = dscomm.cdb
            if backend is None:
                raise RuntimeError("deepspeed.init_distributed() must run before the recorder is installed")
        for name, spec in _METHODS.items():
            fn = getattr(backend, name, None)
            if fn is None or getattr(fn, "_dtlab_wrapped", False):
                continue
            setattr(backend, name, self._wrap(name, fn, spec))
            self.wrapped.append(name)
        return self.wrapped

    def watch_stream(self, stream, name: str, op: str = "reduce_scatter") -> bool:
        """GPU: time the compute stream's stall each time the host calls `stream.synchronize()` (DeepSpeed's
        reduce_and_partition_stream, which runs the gradient reduce-scatters). Returns whether it is watched."""
        if not self.cuda or stream is None or getattr(stream.synchronize, "_dtlab_wrapped", False):
            return False
        real = stream.synchronize

        def synchronize():
            a = self.compute_mark()
            b = self._torch.cuda.Event(enable_timing=True)
            b.record(stream)  # completes when everything queued on `stream` so far has run
            try:
                return real()
            finally:
                seq = self._last_seq.get(op)
                self._add_blocked({"op": op, "method": f"{name}.synchronize", "seq": seq}, "stream_sync", a, b)

        synchronize._dtlab_wrapped = True
        try:
            stream.synchronize = synchronize
        except (AttributeError, TypeError):
            return False
        self.watched.append(name)
        return True

    def begin(self, step: int, phase: str, ref) -> None:
        """Start attributing to `step`; `ref` is the time zero (perf_counter float, or a CUDA event)."""
        self.step, self.phase, self._ref = step, phase, ref

    def now(self):
        """A time mark on this recorder's clock (CUDA event on the current stream on GPU)."""
        return self.marks.now()

    def compute_mark(self):
        """A time mark on the compute stream (GPU) or the wall clock (CPU)."""
        return self.marks.compute_mark()

    def _on_compute_stream(self) -> bool:
        return self.marks.on_compute_stream()

    def _add_blocked(self, rec: dict, how: str, a, b, error=None) -> None:
        blk = {
            "step": self.step,
            "phase": self.phase,
            "op": rec["op"],
            "method": rec["method"],
            "seq": rec.get("seq"),
            "how": how,
            "error": error,
            "_ref": self._ref,
            "_a": a,
            "_b": b,
        }
        with self._lock:
            self._blocked.append(blk)

    def _wrap(self, method: str, fn, spec):
        op, (b_idx, b_name), async_spec = spec

        def wrapper(*args, **kwargs):
            async_op = bool(_arg(args, kwargs, *async_spec, default=False)) if async_spec else False
            with self._lock:
                seq, self._seq = self._seq, self._seq + 1
                self._last_seq[op] = seq
            rec = {
                "step": self.step,
                "op": op,
                "method": method,
                "phase": self.phase,
                "seq": seq,
                "nbytes": _nbytes(_arg(args, kwargs, b_idx, b_name)),
                "async_op": async_op,
                "fn": _caller(),
                "error": None,
                "_ref": self._ref,
                "_end": None,
                "_done": threading.Event(),
            }
            on_compute = self._on_compute_stream()
            rec["_start"] = self.now()
            with self._lock:
                self._recs.append(rec)
            try:
                work = fn(*args, **kwargs)
            except BaseException as e:
                rec["error"] = repr(e)  # t_end stays None: the collective never completed
                if not async_op and on_compute:
                    self._add_blocked(rec, "blocking_call", rec["_start"], self.now(), rec["error"])
                rec["_done"].set()
                raise
            fut = None
            if async_op and work is not None and hasattr(work, "get_future"):
                try:
                    fut = work.get_future()
                except Exception:  # noqa: BLE001 - e.g. a coalesced Work without a future
                    fut = None
            end = self.marks.after(fut, _arg(args, kwargs, async_spec[0] - 1, "group")) if fut is not None else None
            if end is not None:  # NCCL: an owned stream waits on the collective; its event is the end
                rec["_end"] = end
                rec["_done"].set()
            elif fut is not None:

                def done(_f, rec=rec):
                    rec["_end"] = self.marks.end()
                    rec["_done"].set()

                fut.add_done_callback(done)
            elif async_op:  # async but no future to tell when it ends: leave the end unknown, never guess
                rec["_end"] = None
                rec["_done"].set()
            else:  # blocking call (gloo waits inside; NCCL makes the current stream wait)
                rec["_end"] = self.now()
                rec["_done"].set()
                if on_compute:
                    self._add_blocked(rec, "blocking_call", rec["_start"], rec["_end"])
            if async_op and work is not None and hasattr(work, "wait"):
                return _TimedWork(work, self, rec)
            return work

        wrapper._dtlab_wrapped = True
        wrapper.__wrapped__ = fn
        return wrapper

    def collect(self, wait_s: float = 10.0) -> list[dict]:
        """Every collective issued since the last call, times in seconds from its step's reference.

        Called after the step's clock was read: DeepSpeed has waited on every collective of the step by
        then, so completion callbacks are due at once; `wait_s` only guards against a lost callback
        (its t_end is then None).
        """
        with self._lock:
            recs, self._recs = self._recs, []
        out = []
        for r in recs:
            r["_done"].wait(wait_s)
            ref, start, end = r.pop("_ref"), r.pop("_start"), r.pop("_end")
            r.pop("_done")
            r["t_start"], r["t_end"] = self.marks.seconds(ref, start), self.marks.seconds(ref, end)
            out.append(r)
        return out

    def collect_blocked(self) -> list[dict]:
        """Every blocked interval recorded since the last call: t_start, t_end in seconds from its step's
        reference (t_end >= t_start; on GPU t_end = max(t_start, release), see the class docstring)."""
        with self._lock:
            recs, self._blocked = self._blocked, []
        out = []
        for r in recs:
            ref, a, b = r.pop("_ref"), r.pop("_a"), r.pop("_b")
            ta, tb = self.marks.seconds(ref, a), self.marks.seconds(ref, b)
            r["t_start"] = ta
            r["t_end"] = None if ta is None or tb is None else max(ta, tb)
            out.append(r)
        return out


def _arg(args, kwargs, idx, name, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[idx] if len(args) > idx else default


def _nbytes(t) -> int:
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return int(t.numel() * t.element_size())


def _caller() -> str:
    """'path/in/site-packages.py:line:function' of the first frame outside the comm layers."""
    f = sys._getframe(2)
    while f is not None and any(s in f.f_code.co_filename for s in _COMM_LAYERS):
        f = f.f_back
    if f is None:
        return "?"
    path = f.f_code.co_filename.split("site-packages" + os.sep)[-1]
    return f"{path}:{f.f_lineno}:{f.f_code.co_name}"
