"""Strategy 'zero3': DeepSpeed ZeRO stage 3, one rank per process, every collective recorded.

What a rank writes (times in seconds from the step's start, on the step's clock; sizes in bytes):

- `ready`, then per step a `step` event (forward = `engine(**batch)`, backward = `engine.backward(loss)`,
  optimizer = `engine.step()`), followed by the step's `collective` events; collectives issued inside
  `deepspeed.initialize` are written once with step -1 and phase "init" (times from the start of initialize).
  Step events also carry `allgather_expected_{fwd,bwd,opt}_bytes`: what the engine had to gather in that
  phase, read from the parameters' ZeRO status when the phase began (no communication, no sync), so the
  recorded all-gather bytes can be checked whatever the ZeRO settings.
- `memory` after step 0 (no peak) and after the last step, from the tensors the rank holds.
- `blocked`: each interval during which the rank waited for a collective (`how`: wait, blocking_call,
  stream_sync; `seq` names the collective waited for, matching the collective record's `seq`). Step events
  carry their union, `t_blocked` (and per phase `t_blocked_{fwd,bwd,opt}`): the measured exposed
  communication. See `CollectiveRecorder` for how each kind is timed on CPU and on GPU.

Definitions (ZeRO-3 has no no-op-hook baseline, and DeepSpeed overlaps its collectives with compute on side
streams, so T_step - T_comm is not compute time):
- T_comm: the union of the step's [t_start, t_end] in-flight intervals (a union, not a sum: prefetched
  all-gathers overlap each other and compute).
- exposed: t_blocked, the time the training thread (CPU) or the compute stream (GPU) was blocked waiting for
  collectives. Measured, not inferred.
- T_comp: T_step - t_blocked ("measured: T_step - time blocked on collectives").
- overlap: 1 - exposed / T_comm.

How collectives are recorded: every ZeRO-3 collective goes through `deepspeed.comm`, and each of its public
functions ends in exactly one method of the live backend object `deepspeed.comm.comm.cdb`. Those methods
are wrapped on the instance (an instance attribute shadows the class method, and DeepSpeed looks the method
up at call time). Module-level patches would miss calls: `deepspeed.comm.X` is a star-import copy, and the
backend caches `torch.distributed.all_gather_into_tensor` / `reduce_scatter_tensor` when it is built.
Start is taken when the collective is issued, end in the completion callback of its Work's future (or when
a blocking call returns); nothing waits, so the overlap being measured is left alone. On gloo the start of
an async op is its enqueue time, and queued ops can show overlapping intervals.

Byte counts follow the nccl-tests convention: all_gather = output (gathered) bytes, reduce_scatter = input
(unreduced) bytes, all_reduce / broadcast = tensor bytes.

CPU path (tested): DS_ACCELERATOR=cpu before deepspeed is imported, gloo, and DeepSpeed's shared-memory comm
op build patched out. GPU path (nccl, cuda:LOCAL_RANK, CUDA events): written to the same contract but NOT
run in the session that wrote it (no GPU was available); treat its first run as a test.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
import warnings

from dtlab.config import RunConfig

COLLECTIVE_RECORDING = ("wrapped deepspeed.comm backend methods; start = issue time, end = completion callback; "
                        "no added synchronisation; blocked = timed Work.wait() of async collectives + the whole of "
                        "blocking calls (+ GPU: reduce_and_partition_stream.synchronize)")

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

# Frames skipped when naming the DeepSpeed function that asked for a collective.
_COMM_LAYERS = tuple(s.replace("/", os.sep) for s in (
    "deepspeed/comm/", "deepspeed/runtime/comm/", "deepspeed/utils/nvtx.py", "torch/distributed/",
    "torch/_dynamo/", "torch/utils/_contextlib.py", "torch/compiler/")) + (os.path.abspath(__file__),)

# ---- DeepSpeed import ------------------------------------------------------------------------------------

def import_deepspeed(backend: str):
    """Import deepspeed for this backend ('gloo' -> CPU accelerator, 'nccl' -> CUDA) and return it.

    The accelerator is chosen once, at import, from DS_ACCELERATOR; auto-detection would pick CUDA for a
    gloo run on a GPU machine, whose tensors then live on the wrong device.
    """
    want = "cuda" if backend == "nccl" else "cpu"
    if "deepspeed" in sys.modules and os.environ.get("DS_ACCELERATOR") not in (None, want):
        raise RuntimeError(f"deepspeed was already imported with DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}, "
                           f"backend {backend!r} needs {want!r}")
    os.environ["DS_ACCELERATOR"] = want
    # torch 2.13 deprecates the two collectives ZeRO-3 issues for every bucket (in favour of *_single), and
    # the warning otherwise repeats through each rank's log.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                                    r"is deprecated")
    import deepspeed

    # The CPU accelerator JIT-compiles a shared-memory comm op (about 30 s of g++ on first use) that only
    # inference_all_reduce uses; training never needs it on either accelerator. importlib, not
    # `import deepspeed.comm.torch`: deepspeed.comm re-exports the name `torch`, so that statement binds the
    # real torch module and the patch would land there.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    return deepspeed


def model_hidden_size(model) -> int:
    """The hidden size h the "auto" ZeRO knobs are sized from (DistilBERT: config.dim, 768)."""
    conf = getattr(model, "config", None)
    for name in ("hidden_size", "dim", "d_model", "n_embd"):
        h = getattr(conf, name, None)
        if isinstance(h, int) and h > 0:
            return h
    raise ValueError(f"cannot read the hidden size of {type(model).__name__} to size the ZeRO knobs; "
                     "set zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size and "
                     "zero.stage3_param_persistence_threshold explicitly")


AUTO_RULE = ("Hugging Face's DeepSpeed 'auto' rule with h = the model's hidden size: reduce_bucket_size = h^2, "
             "stage3_prefetch_bucket_size = int(0.9 h^2), stage3_param_persistence_threshold = 10 h")


def zero_auto(cfg: RunConfig, hidden: int) -> dict:
    """Which knobs were left to auto, what they resolved to, and the rule (recorded in run.resolved)."""
    z = cfg.zero
    return {"hidden_size": hidden, "rule": AUTO_RULE, "resolved": z.resolve(hidden),
            "auto_fields": [k for k in z.AUTO_FIELDS if getattr(z, k) is None]}


def ds_config(cfg: RunConfig, world: int, hidden: int | None = None) -> dict:
    """The DeepSpeed config for `cfg`: ZeRO stage 3 with cfg.zero's knobs, fp32, no gradient clipping.

    Knobs left None ("auto") are sized from the model's hidden size `hidden` (see AUTO_RULE); `hidden` may
    be omitted only when every sized knob is explicit. The optimizer is passed to `deepspeed.initialize` as a
    client torch.optim.AdamW (same math as the DDP path); DeepSpeed's FusedAdam / CPUAdam would JIT-compile
    C++ ops.
    """
    z = cfg.zero
    if hidden is None:
        missing = [k for k in z.AUTO_FIELDS if getattr(z, k) is None]
        if missing:
            raise ValueError(f"ds_config needs the model's hidden size to resolve auto zero.{missing[0]}")
        hidden = 1
    sized = z.resolve(hidden)
    zero = {"stage": 3, **sized, "stage3_max_reuse_distance": z.stage3_max_reuse_distance,
            "overlap_comm": z.overlap_comm}
    conf = {"train_micro_batch_size_per_gpu": cfg.batch_size, "gradient_accumulation_steps": 1,
            "train_batch_size": cfg.batch_size * world, "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True, "zero_optimization": zero}
    return conf


# ---- collective recording ----------------------------------------------------------------------------------

class _TimedWork:
    """Stands in for the Work a wrapped async collective returned: everything is forwarded to the real Work,
    and `wait()` is timed (how long the training thread, or on GPU the compute stream, was blocked on it)."""

    __slots__ = ("_work", "_recorder", "_rec")

    def __init__(self, work, recorder: "CollectiveRecorder", rec: dict):
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

    In flight (T_comm): start when issued, end in the completion callback of the Work's future (or when a
    blocking call returns). On GPU both ends are CUDA events: start on the issuing stream, end on the stream
    the Work's future hands its callback, so no host sync is added.

    Blocked (exposed communication): intervals during which the rank could not compute because it waited for
    a collective, recorded three ways:
    - `wait`: an async collective's Work is handed back wrapped in `_TimedWork`, whose `wait()` is timed.
      CPU: wall clock before and after. GPU: a CUDA event on the compute stream before the wait (the moment
      the compute stream reached the wait) and one on the stream that waits after it (the moment the
      collective released it); the stall is max(0, after - before). DeepSpeed waits on all-gather handles
      inside its all-gather stream and then makes the compute stream wait for that stream, so the after-event
      is where the compute stream is released; no dependency is added.
    - `blocking_call`: a collective called with async_op=False blocks for its whole duration. CPU: always.
      GPU: counted only when issued on the compute stream (one issued on a side stream stalls that stream;
      the compute stream meets it where it joins the side stream, see `stream_sync`).
    - `stream_sync` (GPU only): DeepSpeed synchronises the host with its reduce_and_partition_stream after
      the last gradient bucket; `watch_stream` times the compute stream's stall there the same way.
    """

    def __init__(self, device):
        import torch
        self._torch = torch
        self.cuda = device.type == "cuda"
        self.step, self.phase, self._ref = -1, "init", None
        self.compute_stream = torch.cuda.current_stream(device) if self.cuda else None
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
            import deepspeed.comm.comm as dscomm
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
        if self.cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def compute_mark(self):
        """A time mark on the compute stream (GPU) or the wall clock (CPU)."""
        if self.cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record(self.compute_stream)
            return ev
        return time.perf_counter()

    def _on_compute_stream(self) -> bool:
        return (not self.cuda) or self._torch.cuda.current_stream() == self.compute_stream

    def _add_blocked(self, rec: dict, how: str, a, b, error=None) -> None:
        blk = {"step": self.step, "phase": self.phase, "op": rec["op"], "method": rec["method"],
               "seq": rec.get("seq"), "how": how, "error": error, "_ref": self._ref, "_a": a, "_b": b}
        with self._lock:
            self._blocked.append(blk)

    def _wrap(self, method: str, fn, spec):
        op, (b_idx, b_name), async_spec = spec

        def wrapper(*args, **kwargs):
            async_op = bool(_arg(args, kwargs, *async_spec, default=False)) if async_spec else False
            with self._lock:
                seq, self._seq = self._seq, self._seq + 1
                self._last_seq[op] = seq
            rec = {"step": self.step, "op": op, "method": method, "phase": self.phase, "seq": seq,
                   "nbytes": _nbytes(_arg(args, kwargs, b_idx, b_name)), "async_op": async_op,
                   "fn": _caller(), "error": None, "_ref": self._ref, "_end": None, "_done": threading.Event()}
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
            if fut is not None:
                def done(_f, rec=rec):
                    rec["_end"] = self.now()
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

    def _seconds(self, ref, mark):
        """Seconds from `ref` to `mark` (None stays None). On GPU this reads events of a finished step."""
        if ref is None or mark is None:
            return None
        if self.cuda:
            mark.synchronize()  # after the step: already complete, so this stalls nothing
            return ref.elapsed_time(mark) / 1e3
        return mark - ref

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
            r["t_start"], r["t_end"] = self._seconds(ref, start), self._seconds(ref, end)
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
            ta, tb = self._seconds(ref, a), self._seconds(ref, b)
            r["t_start"] = ta
            r["t_end"] = None if ta is None or tb is None else max(ta, tb)
            out.append(r)
        return out


def blocked_seconds(blocked: list[dict], phase: str | None = None) -> float:
    """Length of the union of the blocked intervals (optionally of one phase): seconds the rank could not
    compute because it waited for collectives. A union, so nested or concurrent waits count once."""
    iv = sorted((b["t_start"], b["t_end"]) for b in blocked
                if b["t_start"] is not None and b["t_end"] is not None and (phase is None or b["phase"] == phase))
    total, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return float(total)


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


def blocked_recording(cuda: bool, stream_watched: bool) -> dict:
    """How blocked time (exposed communication) was measured on this rank, and what it cannot see."""
    if not cuda:
        return {"clock": "wall clock (perf_counter) on the training thread",
                "intercepted": ["Work.wait() of every async collective issued through deepspeed.comm",
                                "the whole of every blocking (async_op=False) collective"],
                "not_intercepted": ["waits inside torch.distributed calls that bypass deepspeed.comm (none in "
                                    "ZeRO-3 training on 0.19.8)",
                                    "CPU time the backend's own threads take from compute on shared cores "
                                    "(it slows compute, it does not block)"]}
    return {"clock": "CUDA events: a mark on the compute stream before each wait, one on the waiting stream after",
            "intercepted": ["Work.wait() of async collectives (all-gather handles, waited on the all-gather "
                            "stream that the compute stream then joins)",
                            "blocking collectives issued on the compute stream"]
                           + (["reduce_and_partition_stream.synchronize() (host waits for the reduce-scatters)"]
                              if stream_watched else []),
            "not_intercepted": ["host waits on DeepSpeed's back-pressure events (__ongoing_fetch_events, "
                                "param_reduce_events .synchronize()): the GPU only stalls there if its queue runs dry",
                                "default_stream().wait_stream(reduce_and_partition_stream) in the fp16 overflow "
                                "check (not reached in fp32)",
                                "the all-gather stream's unpacking copies (torch.cat) after each wait"]
                           + ([] if stream_watched else ["reduce_and_partition_stream.synchronize() (could not be "
                                                         "wrapped)"])}


# ---- what the engine says about traffic and memory -----------------------------------------------------------

def _padded_bytes(p, world: int) -> int:
    """Bytes of `p` as ZeRO-3 communicates it: its partition (ceil(numel/world) elements) times world."""
    return int(p.ds_tensor.ds_numel * world * p.ds_tensor.element_size())


def nonresident_bytes(params, world: int) -> int:
    """Padded bytes of the parameters that are not materialised on this rank right now (neither available
    nor in flight): what ZeRO-3 must all-gather before the next pass can use them."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return sum(_padded_bytes(p, world) for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)


def zero_facts(engine, world: int) -> dict:
    """Traffic expectations and layout facts read from the initialised engine (bytes, elements)."""
    params = list(engine.module.parameters())
    trainable = [p for p in params if p.requires_grad]
    persist = [p for p in params if p.ds_persist]
    nonpersist = [p for p in params if not p.ds_persist]
    grad_bytes = sum(p.ds_numel * p.ds_tensor.element_size() for p in trainable)
    padded = sum(_padded_bytes(p, world) for p in trainable)
    np_padded = sum(_padded_bytes(p, world) for p in nonpersist)
    pp_padded = sum(_padded_bytes(p, world) for p in persist)
    total_numel = sum(p.ds_numel for p in params)
    reuse, prefetch = engine.zero_max_reuse_distance(), engine.zero_prefetch_bucket_size()
    # Backward re-gathers what forward released. Forward keeps a parameter when it recurs within
    # max_reuse_distance elements of the parameter trace (or when prefetch has claimed its next use). The trace
    # of one step holds each module's parameters at most twice (forward and backward), hence the bound.
    if reuse >= 2 * total_numel:
        bwd, rule = 0, (f"stage3_max_reuse_distance {reuse:,} >= 2 x {total_numel:,} parameters: every parameter "
                        "gathered in forward is kept until its backward use, so backward gathers nothing")
    elif reuse == 0 and prefetch == 0:
        bwd, rule = np_padded, ("stage3_max_reuse_distance 0 and no prefetch: forward releases every gathered "
                                "parameter, backward gathers each again")
    else:
        bwd, rule = None, (f"stage3_max_reuse_distance {reuse:,} with prefetch {prefetch:,}: depends on the trace; "
                           "see the per-step allgather_expected_bwd_bytes in step events")
    return {
        "grad_bytes_unpadded": grad_bytes,
        "padded_grad_bytes": padded,
        "padding_bytes": padded - grad_bytes,
        "persistent_params": len(persist),
        "persistent_bytes": sum(p.ds_numel * p.ds_tensor.element_size() for p in persist),
        "persistent_padded_bytes": pp_padded,
        "nonpersistent_params": len(nonpersist),
        "nonpersistent_padded_bytes": np_padded,
        "expected_reduce_scatter_bytes_per_step": padded if engine.zero_reduce_scatter() else 0,
        "expected_allgather_bytes_forward": np_padded,
        "expected_allgather_bytes_backward": bwd,
        "expected_allgather_bytes_optimizer": pp_padded,
        "allgather_backward_rule": rule,
        "allgather_note": ("steady steps (trace recorded): forward gathers the non-persistent parameters; "
                           "persistent ones are re-gathered once per step in the optimizer phase (_post_step). "
                           "Step 0 records the trace and releases after every use, so it gathers every "
                           "parameter in forward and again in backward."),
        "zero_effective": {
            "stage": engine.zero_optimization_stage(), "reduce_bucket_size": engine.zero_reduce_bucket_size(),
            "stage3_prefetch_bucket_size": prefetch,
            "stage3_param_persistence_threshold": engine.zero_param_persistence_threshold(),
            "stage3_max_reuse_distance": reuse, "stage3_max_live_parameters": engine.zero_max_live_parameters(),
            "overlap_comm": engine.zero_overlap_comm(), "reduce_scatter": engine.zero_reduce_scatter(),
            "contiguous_gradients": engine.zero_contiguous_gradients()},
    }


class _Storage:
    """Counts bytes of tensor storage once, however many views or categories reach it."""

    def __init__(self):
        self._covered: dict[int, list[tuple[int, int]]] = {}

    def add(self, tensors) -> int:
        """Bytes of these tensors not counted before (by storage and byte range)."""
        total = 0
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            a = t.storage_offset() * t.element_size()
            b = a + t.numel() * t.element_size()
            ivs = self._covered.setdefault(key, [])
            covered = sum(max(0, min(b, y) - max(a, x)) for x, y in ivs)  # ivs are kept disjoint
            total += (b - a) - covered
            merged = [(x, y) for x, y in ivs if y < a or x > b]
            lo = min([a] + [x for x, y in ivs if not (y < a or x > b)])
            hi = max([b] + [y for x, y in ivs if not (y < a or x > b)])
            self._covered[key] = merged + [(lo, hi)]
        return int(total)


def memory_record(engine) -> dict:
    """What this rank holds, in bytes, counted from the tensors (each storage byte once):

    - params_bytes: the rank's parameter partitions (`p.ds_tensor`, padding included) + every parameter
      materialised whole (persistent ones always; others only between gather and release).
    - grads_bytes: the gradient partition buffer (+ any `p.grad` still set).
    - optim_bytes: the fp32 master partition + the AdamW state (exp_avg, exp_avg_sq, step). In fp32 training
      DeepSpeed 0.19.8 keeps the master partition as a separate copy (its "same device" test compares a
      torch.device with a string, which is False), so it is counted here; if it ever shares storage with
      the parameter partitions, it adds 0.
    Also returned, for the record: fp32_master_bytes, adam_state_bytes and ipg_bucket_bytes (the reduce
    bucket, `reduce_bucket_size` elements allocated with torch.empty: virtual memory on CPU, mostly untouched;
    real device memory on GPU), none of which is part of the three totals above except as stated.
    """
    import torch

    zopt = engine.optimizer
    params = list(engine.module.parameters())
    seen = _Storage()
    params_bytes = seen.add(p.ds_tensor for p in params) + seen.add(p.data for p in params)
    grads_bytes = seen.add([getattr(zopt, "grad_partitions_flat_buffer", None)]) + seen.add(p.grad for p in params)
    master = seen.add(getattr(zopt, "fp32_partitioned_groups_flat", []) or [])
    inner = getattr(zopt, "optimizer", None)
    state = [v for st in getattr(inner, "state", {}).values() for v in st.values() if torch.is_tensor(v)]
    adam = seen.add(state)
    ipg = sum(b.buffer.numel() * b.buffer.element_size()
              for b in getattr(zopt, "ipg_buckets", {}).values() if getattr(b, "buffer", None) is not None)
    return {"params_bytes": params_bytes, "grads_bytes": grads_bytes, "optim_bytes": master + adam,
            "fp32_master_bytes": master, "adam_state_bytes": adam, "ipg_bucket_bytes": int(ipg)}


# ---- the rank's training loop ------------------------------------------------------------------------------

def train(cfg: RunConfig, run_dir: str, rank: int, world: int, writer) -> None:
    backend = cfg.resolved_backend()
    deepspeed = import_deepspeed(backend)
    import torch

    from dtlab.rank.ddp import build_everything
    from dtlab.rank.recorder import StepClock, peak_memory
    from dtlab.rank.lifecycle import maybe_inject_fault, record_resolved

    # build_everything's process group suits DeepSpeed: init_distributed finds torch.distributed initialised
    # and only builds its backend object around it (for nccl it binds device_id just as DeepSpeed would).
    device, backend, built, batches, sources = build_everything(cfg, run_dir, rank, world)
    deepspeed.init_distributed(dist_backend=backend)
    recorder = CollectiveRecorder(device)
    wrapped = recorder.install()

    hidden = model_hidden_size(built.model)
    conf = ds_config(cfg, world, hidden)
    model = built.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    recorder.begin(-1, "init", recorder.now())
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    t_initialize = time.perf_counter() - t0
    for r in recorder.collect():
        writer.write("collective", rank=rank, **r)
    for b in recorder.collect_blocked():
        writer.write("blocked", rank=rank, **b)
    watched = recorder.watch_stream(getattr(engine.optimizer, "reduce_and_partition_stream", None),
                                    "reduce_and_partition_stream")

    sources = {**sources, **zero_facts(engine, world), "ds_config": conf, "zero_auto": zero_auto(cfg, hidden),
               "blocked_recording": blocked_recording(device.type == "cuda", watched),
               "ds_accelerator": os.environ.get("DS_ACCELERATOR"), "deepspeed_initialize_s": t_initialize,
               "collective_recording": COLLECTIVE_RECORDING, "wrapped_methods": wrapped}
    if device.type == "cuda":
        sources["zero3_note"] = "the ZeRO-3 GPU path (nccl, CUDA events) was written without a GPU to test it"
    if rank == 0:
        record_resolved(run_dir, cfg, backend, device, sources, world)
    writer.write("ready", rank=rank, time=time.time(), **sources)

    params = list(engine.module.parameters())
    expect_opt = sources["expected_allgather_bytes_optimizer"]
    clock = StepClock(device)
    for step in range(cfg.steps):
        maybe_inject_fault(rank, step)
        batch = batches[step % len(batches)]
        expect_fwd = nonresident_bytes(params, world)
        clock.mark("start")
        recorder.begin(step, "forward", clock.start)
        out = engine(**batch)
        clock.mark("fwd")
        expect_bwd = nonresident_bytes(params, world)  # forward's leftovers decide backward's gathers
        recorder.phase = "backward"
        engine.backward(out.loss)
        clock.mark("bwd")
        recorder.phase = "optimizer"
        engine.step()
        clock.mark("opt")
        recorder.phase = "between_steps"
        t = clock.read()  # the step's one sync point on GPU
        blocked = recorder.collect_blocked()
        in_step = [b for b in blocked if b["step"] == step and b["phase"] != "between_steps"]
        writer.write("step", rank=rank, step=step, t_fwd=t["fwd"], t_bwd=t["bwd"] - t["fwd"],
                     t_opt=t["opt"] - t["bwd"], t_step=t["opt"], loss=float(out.loss.detach()), time=time.time(),
                     allgather_expected_fwd_bytes=expect_fwd, allgather_expected_bwd_bytes=expect_bwd,
                     allgather_expected_opt_bytes=expect_opt, t_blocked=blocked_seconds(in_step),
                     **{f"t_blocked_{k}": blocked_seconds(in_step, ph) for k, ph in
                        (("fwd", "forward"), ("bwd", "backward"), ("opt", "optimizer"))},
                     n_blocked=len(in_step))
        for r in recorder.collect():
            writer.write("collective", rank=rank, **r)
        for b in blocked:
            writer.write("blocked", rank=rank, **b)
        if step == 0:
            writer.write("memory", rank=rank, **memory_record(engine), peak_bytes=None, peak_kind=None)

    peak, kind = peak_memory(device)
    writer.write("memory", rank=rank, **memory_record(engine), peak_bytes=peak, peak_kind=kind)
