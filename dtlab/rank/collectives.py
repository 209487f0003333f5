"""The collective recorder of the strategies beyond data parallelism ('tp', 'pp', 'fsdp2'): every collective with
its op, bytes (nccl-tests convention), phase, layer, mesh axis and interval, and every interval the training
thread was blocked waiting for one, written as the `collective` and `blocked` events ZeRO-3 writes.

How collectives reach it:
- `FuncolMode`, a TorchDispatchMode, sees the functional collectives (`_c10d_functional.*`) that DTensor issues
  for tensor parallelism. Their waits come two ways: an explicit `wait_tensor` op, or lazily when an
  AsyncCollectiveTensor is first used by an aten op (the tensor-parallel styles issue with async_op=True). A mode
  runs before the tensor subclass, so it sees that op first: it triggers the wait itself, where the subclass would
  have, and times it. A collective's t_end is when its wait returned (on CPU the collective ran on gloo's thread
  since its issue and the wait returns once it completed: an upper bound of its completion).
- `record_call` times a collective issued by dtlab itself or through an extension point (FSDP2's custom
  all-gather / reduce-scatter, the data-parallel gradient all-reduce): blocking calls, so the whole call is both
  its interval and time blocked.
- The pipeline's sends and receives are recorded by dtlab.rank.strategies.pp from the schedule's p2p helpers.

`LayerTracker` names the transformer block and sublayer ('attention' or 'ffn') a collective belongs to: a forward
pre-hook on each sublayer in forward, and in backward a hook on the gradient that each sublayer's backward starts
from (its collective, the gradient of its input, comes at its end).

Times are the rank's marks (dtlab.rank.marks), in seconds from the step's start, read once per step after the
step's clock: on CPU wall clocks on the training thread; on CUDA events on the current stream, so a collective's
start is when the issuing stream reached it and its end when the stream that waited for it (a blocking call, a
`wait()` or `wait_tensor`: on NCCL each makes the current stream wait, torch's ProcessGroupNCCL.hpp) passed the
wait. Time blocked is time the compute stream stalled: a wait or blocking call on another stream (FSDP2's
all-gather and reduce-scatter streams) does not stall it, and is not counted as blocked where it is issued.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor, _is_view_op
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dtlab.intervals import union_length
from dtlab.rank.marks import Marks

#: ops of the functional-collectives namespace that move no data
_NOT_COLLECTIVES = {"_wrap_tensor_autograd", "wait_tensor"}


def in_backward() -> bool:
    """True while the autograd engine runs a backward graph task on this thread."""
    return torch._C._current_graph_task_id() != -1


def tensor_nbytes(t) -> int:
    """Bytes of a tensor, or of a list of tensors."""
    if isinstance(t, (list, tuple)):
        return sum(tensor_nbytes(x) for x in t)
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


class CommRecorder:
    """Collects one step's collectives and blocked intervals; `flush()` writes them and returns the step's time
    blocked (the union of its blocked intervals). `phase` is the loop's phase ('forward', 'optimizer'): a
    collective issued while autograd runs backward is 'backward' whatever it says.

    Times are the marks of `marks` (the rank's dtlab.rank.marks.Marks; the wall clock when None), kept as marks
    until `flush()`, which must come after the step's clock was read (on CUDA: its one sync point)."""

    def __init__(self, writer, rank: int, marks=None):
        if marks is None:
            marks = Marks(torch.device("cpu"), "gloo")
        self.writer, self.rank, self.marks = writer, rank, marks
        self.step, self.phase, self._ref = -1, "init", marks.now()
        self._recs: list[dict] = []
        self._blocked: list[dict] = []
        self._seq = 0
        self._lock = threading.Lock()

    def begin(self, step: int, ref) -> None:
        """Attribute what follows to `step`, times in seconds from `ref` (a mark of the rank's marks)."""
        self.step, self.phase, self._ref = step, "forward", ref

    def now(self):
        """A mark now, on the calling thread's current stream (CUDA) or the wall clock (CPU)."""
        return self.marks.now()

    def start(self, op: str, nbytes: int, axis: str, group_size: int, layer=None, sub=None, **extra) -> dict:
        """A collective issued now; `finish` ends it."""
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
        rec = {
            "step": self.step,
            "op": op,
            "nbytes": int(nbytes),
            "phase": "backward" if in_backward() else self.phase,
            "axis": axis,
            "group_size": int(group_size),
            "layer": layer,
            "sublayer": sub,
            "seq": seq,
            **extra,
            "_ref": self._ref,
            "_start": self.now(),
            "_end": None,
        }
        with self._lock:
            self._recs.append(rec)
        return rec

    def finish(self, rec: dict, end=None) -> None:
        """`rec` ended at the mark `end` (now when None)."""
        rec["_end"] = self.now() if end is None else end

    @staticmethod
    def ended(rec: dict) -> bool:
        """Whether `finish` was called for `rec`."""
        return rec.get("_end") is not None

    def block(self, rec: dict, a, b, how: str) -> None:
        """The compute stream (CPU: the training thread) waited for `rec` from mark `a` to mark `b`."""
        with self._lock:
            self._blocked.append(
                {
                    "step": rec["step"],
                    "phase": rec["phase"],
                    "op": rec["op"],
                    "seq": rec["seq"],
                    "how": how,
                    "_ref": rec["_ref"],
                    "_a": a,
                    "_b": b,
                }
            )

    def block_here(self, op: str, a, b, how: str) -> None:
        """The compute stream (CPU: the training thread) waited from mark `a` to mark `b` for an `op` that is not
        one of the recorded collectives (a library's own wait), in the current step and phase."""
        self.block(
            {
                "step": self.step,
                "phase": "backward" if in_backward() else self.phase,
                "op": op,
                "seq": None,
                "_ref": self._ref,
            },
            a,
            b,
            how,
        )

    def record_call(self, op: str, nbytes: int, axis: str, group_size: int, call, **extra):
        """Run a blocking collective `call()` and record it: its interval, and time blocked when it was issued on
        the compute stream (a call on a side stream makes only that stream wait)."""
        on_compute = self.marks.on_compute_stream()
        rec = self.start(op, nbytes, axis, group_size, **extra)
        out = call()
        self.finish(rec)
        if on_compute:
            self.block(rec, rec["_start"], rec["_end"], "blocking_call")
        return out

    def _seconds(self, ref, mark):
        return self.marks.seconds(ref, mark)

    def flush(self) -> float:
        """Write the recorded collectives and blocked intervals; return the union of the blocked intervals (s)."""
        with self._lock:
            recs, blocked, self._recs, self._blocked = self._recs, self._blocked, [], []
        for r in recs:
            ref, a, b = r.pop("_ref"), r.pop("_start"), r.pop("_end")
            self.writer.write(
                "collective", rank=self.rank, **r, t_start=self._seconds(ref, a), t_end=self._seconds(ref, b)
            )
        spans = []
        for blk in blocked:
            ref, a, b = blk.pop("_ref"), blk.pop("_a"), blk.pop("_b")
            ta, tb = self._seconds(ref, a), self._seconds(ref, b)
            blk["t_start"], blk["t_end"] = ta, (None if ta is None or tb is None else max(ta, tb))
            self.writer.write("blocked", rank=self.rank, **blk)
            if blk["t_end"] is not None:
                spans.append((blk["t_start"], blk["t_end"]))
        return float(union_length(spans))


def _storage_key(t: torch.Tensor) -> int:
    """A collective's output, keyed by its storage (views share it; c10d keys its work registry the same way)."""
    return t.untyped_storage().data_ptr()


class LayerTracker:
    """Which transformer block and sublayer of `blocks` (DistilBERT's TransformerBlocks, layer index = position +
    `first`) runs now, in forward and in backward (see the module docstring); `where()` -> (layer, sublayer) or
    (None, None) outside them.

    Forward: a pre-hook on each block's `attention` and `ffn`. Backward: a hook on the gradient of the input of the
    LayerNorm that follows each sublayer (`sa_layer_norm` after the attention, `output_layer_norm` after the
    feed-forward): that gradient is what the sublayer's backward starts from. (A hook on the sublayer's own output
    would sit on the AsyncCollectiveTensor a row-parallel layer returns.)"""

    def __init__(self, blocks, first: int = 0):
        self.current = (None, None)
        self._handles = []
        for i, block in enumerate(blocks):
            for sub, norm in (("attention", "sa_layer_norm"), ("ffn", "output_layer_norm")):
                self._handles.append(getattr(block, sub).register_forward_pre_hook(self._enter(first + i, sub)))
                self._handles.append(getattr(block, norm).register_forward_pre_hook(self._on_norm(first + i, sub)))

    def _enter(self, layer, sub):
        def hook(module, args):
            self.current = (layer, sub)

        return hook

    def _on_norm(self, layer, sub):
        def hook(module, args):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda grad: self._set(layer, sub))

        return hook

    def _set(self, layer, sub):
        self.current = (layer, sub)

    def where(self):
        return self.current

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class FuncolMode(TorchDispatchMode):
    """Records DTensor's functional collectives into a CommRecorder (see the module docstring); `tracker` (a
    LayerTracker) names the layer and sublayer of each."""

    def __init__(self, recorder: CommRecorder, axis: str = "tp", tracker: LayerTracker | None = None):
        super().__init__()
        self.recorder, self.axis, self.tracker = recorder, axis, tracker
        self._pending: dict[int, dict] = {}
        self._act, self._is_view = AsyncCollectiveTensor, _is_view_op

    def _where(self):
        return self.tracker.where() if self.tracker is not None else (None, None)

    def _waited(self, key: int, t0, how: str) -> None:
        rec = self._pending.pop(key, None)
        if rec is not None:
            self.recorder.finish(rec)
            self.recorder.block(rec, t0, rec["_end"], how)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional":
            name = func.__name__.split(".")[0]
            if name == "wait_tensor":
                t0 = self.recorder.now()
                out = func(*args, **kwargs)
                self._waited(_storage_key(args[0]), t0, "wait")
                return out
            if name in _NOT_COLLECTIVES:
                return func(*args, **kwargs)
            layer, sub = self._where()
            outs = None
            rec = self.recorder.start(name, 0, self.axis, _group_size(args, kwargs), layer, sub)
            out = func(*args, **kwargs)
            outs = out if isinstance(out, (list, tuple)) else [out]
            # nccl-tests sizes: all-gather its output, every other op its input
            rec["nbytes"] = tensor_nbytes(outs if "all_gather" in name else args[0])
            for o in outs:
                self._pending[_storage_key(o)] = rec
            return out
        if self._pending and not (func is torch.ops.aten.view.default or self._is_view(func)):
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, self._act) and not a.completed:  # its first use: the subclass would wait here
                    t0 = self.recorder.now()
                    a.trigger_wait()
                    self._waited(_storage_key(a.elem), t0, "lazy_wait")
        return func(*args, **kwargs)

    def close(self) -> None:
        """Collectives never waited for keep t_end None (their completion is unknown)."""
        self._pending.clear()


def _group_size(args, kwargs) -> int:
    group = kwargs.get("group_name", args[-1] if args and isinstance(args[-1], str) else None)
    try:
        return dist.get_world_size(_resolve_process_group(group))
    except Exception:  # noqa: BLE001 - a group the resolver does not know: size unknown
        return -1
