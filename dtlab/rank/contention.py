"""Collectives timed the way DDP meets them: issued from inside a backward pass, while it goes on.

During training a bucket's all-reduce is issued by DDP's hook in the middle of the rank's backward pass, and the
rest of the backward pass runs on while it is in flight. On a CPU, gloo's threads share the cores with the
autograd thread; on a GPU, NCCL's kernels share the SMs, memory bandwidth and copy engines with the backward
kernels. Timed in isolation, with a blocking call, the same all-reduce is several times faster (measured on this
project's 2-core machine: a 27 MiB gloo all-reduce 38 ms alone, 150-300 ms issued from a DistilBERT backward pass;
a load in another thread of the same process slowed it far less).

`BackwardLoad` replays a training rank's backward pass (`loss.backward(retain_graph=True)` on one forward of a batch
of the run's shape: the model's own layers, matmul shapes and thread budget) with a hook on every parameter's
gradient (as DDP's reducer has). At fixed hooks of each pass, the same on every rank (DDP's buckets become ready at
the same layers on every rank), the next collective is issued asynchronously once the one before it has completed:
its issue is marked there, its end in its future's completion callback, the way dtlab.rank.recorder marks a bucket
(dtlab.rank.marks). A rank that reaches an issue point first waits for its peers; the rank that issued last times
the collective itself, its service time under load (dtlab.results.calibration takes that rank's time).

The other direction is measured too: the transfers take CPU (gloo's threads, the kernel's TCP stack) from the
backward pass they run beside. Every pass records its wall time, the time its hooks waited for a collective and
how long collectives were in flight during it, and `idle_pass` times passes with nothing in flight;
dtlab.model.sharing fits the backward seconds lost per second of communication in flight.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from dtlab.rank.data import build_model


class BackwardLoad:
    """A model's backward pass to issue collectives from. `model`: 'tiny' or 'distilbert' (random weights: the
    arithmetic is what matters); `batch_size`, `seq_len`: a training rank's batch; `marks`: the rank's
    dtlab.rank.marks.Marks. Construction builds the model and runs one forward and backward (counting the gradient
    hooks a pass fires), so that the first timed pass does not pay for allocation. `passes` counts the backward
    passes replayed."""

    #: Hooks a pass spends issuing: the last 15% of a backward pass is left without new collectives, so that a
    #: sample rarely runs on after backward has ended (it would be priced idle).
    SPREAD = 0.85

    def __init__(self, model: str, batch_size: int, seq_len: int, device, marks, seed: int = 0, per_pass: int = 8):
        torch.manual_seed(seed)
        self.model = build_model(model, "random", None, seed).model.to(device)
        self.model.train()
        self.marks = marks
        self.per_pass = per_pass
        vocab = self.model.config.vocab_size
        ids = torch.randint(1000, vocab, (batch_size, seq_len), device=device)
        labels = torch.randint(0, 2, (batch_size,), device=device)
        self._loss = self.model(input_ids=ids, labels=labels).loss
        self._fired = 0
        self._queue: list = []
        self._issued: list = []
        self._works: list = []
        self._at: set = set()
        self._lock = threading.Lock()
        self._waited = 0.0  # seconds this pass's hooks waited for the collective before theirs
        self._spans: list = []  # [issue, end] host seconds of this pass's collectives (end None: in flight)
        # DDP's reducer copies every gradient into its bucket as it becomes ready: the same copies here, into one
        # flat buffer, so the load moves the memory a training rank's backward moves
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._flat = torch.empty(sum(p.numel() for p in params), device=device)
        self._slot, off = {}, 0
        for p in params:
            self._slot[p] = self._flat[off : off + p.numel()]
            off += p.numel()
            p.register_post_accumulate_grad_hook(self._hook)
        self._loss.backward(retain_graph=True)
        self.hooks = self._fired  # gradient hooks one pass fires (the same on every rank: the same model)
        self.passes = 0

    def _hook(self, param) -> None:
        """A gradient is ready: copied into its slot of the flat buffer, as DDP copies it into its bucket. At the
        pass's issue points (the same hook counts on every rank, as DDP's buckets are ready at the same layers on
        every rank) the next collective is issued, from the autograd thread."""
        self._slot[param].copy_(param.grad.view(-1))
        self._fired += 1
        if self._fired not in self._at or not self._queue:
            return
        t0 = time.perf_counter()
        self._settle()  # one at a time, and every rank issues the same call at the same point: no skipping
        self._waited += time.perf_counter() - t0
        key, issue = self._queue.pop(0)
        rec = {"key": key, "issue": self.marks.now(), "span": [time.perf_counter(), None]}
        self._spans.append(rec["span"])
        self._issued.append(rec)
        work = issue()
        self._works.append(work)
        try:
            work.get_future().then(lambda fut: self._finish(rec))
        except RuntimeError:  # gloo's reduce_scatter has no future ("Work::getFuture not implemented"): a waiter
            threading.Thread(target=lambda: (work.wait(), self._finish(rec)), daemon=True).start()

    def _finish(self, rec: dict) -> None:
        rec["span"][1] = time.perf_counter()
        rec["end"] = self.marks.end()

    def _settle(self) -> None:
        """Wait until every issued collective has completed and been marked (rarely needed inside a pass: the
        issue points are far enough apart for most collectives)."""
        for w in self._works:
            w.wait()
        self._works = []
        while any("end" not in r for r in self._issued):
            time.sleep(0.0005)

    def sample(self, calls: list, on_pass=None) -> list:
        """Time `calls`, a list of (key, issue) where issue() starts one collective asynchronously and returns its
        Work, in that order (the same on every rank), each issued from inside a replayed backward pass at one of
        `per_pass` points spread over its first 85% (one at a time: at a point where the one before is still in
        flight, the hook waits for it first, so a sample is one collective, not a queue). Returns
        [(key, seconds from issue to end)] in issue order. `on_pass(passes, left, figures)`, when given, is called
        after every pass with the pass's own figures (:meth:`_pass`): a calibration rank writes an event there (a
        long loaded phase is progress, not a stall)."""
        self._queue, self._issued, self._works = list(calls), [], []
        self._at = {max(1, round((i + 1) * self.SPREAD * self.hooks / self.per_pass)) for i in range(self.per_pass)}
        while self._queue:
            figures = self._pass()
            if on_pass is not None:
                on_pass(self.passes, len(self._queue), figures)
        return [(r["key"], self.marks.seconds(r["issue"], r["end"])) for r in self._issued]

    def idle_pass(self) -> dict:
        """One replayed backward pass with nothing issued from it (every rank together): the compute a pass takes
        with no communication in flight, what :meth:`sample`'s passes are compared with. Returns :meth:`_pass`'s
        figures."""
        queue, self._queue = self._queue, []
        try:
            return self._pass()
        finally:
            self._queue = queue

    def solo_pass(self, who: int) -> dict | None:
        """One backward pass that only rank `who` runs while the others wait at a barrier, nothing issued: a rank's
        compute alone on the machine, beside :meth:`idle_pass`'s all together (dtlab.model.sharing.fit_alone).
        Returns {"seconds": its wall time} on rank `who`, None on the others."""
        dist.barrier()
        out = None
        if dist.get_rank() == who:
            t0 = time.perf_counter()
            self._loss.backward(retain_graph=True)
            out = {"seconds": self._computed() - t0, "waited": 0.0, "in_flight": 0.0}
            self.passes += 1
        dist.barrier()
        return out

    def _computed(self) -> float:
        """The host clock once the pass's compute has finished: on a GPU, when the compute stream reaches an event
        recorded after backward (not the collectives' stream, and not just the kernels' launch)."""
        if self._flat.is_cuda:
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        return time.perf_counter()

    def _pass(self) -> dict:
        """One replayed backward pass, the ranks started together, issuing from `_queue` at the issue points.
        Returns its figures (host seconds): `seconds` (the pass's wall time), `waited` (its hooks' waits for the
        collective before theirs, not compute) and `in_flight` (how long collectives issued from it were in flight
        while it computed: before it ended, its waits taken out)."""
        self._fired, self._waited, self._spans = 0, 0.0, []
        # the ranks start each pass together, as training steps do (a step ends when every bucket is reduced):
        # the i-th issue point is then the same moment on every rank, up to their compute's own skew
        dist.barrier()
        t0 = time.perf_counter()
        self._loss.backward(retain_graph=True)  # the gradients accumulate: only the work matters
        t1 = self._computed()
        self.passes += 1
        spans = [(a, t1 if b is None else min(b, t1)) for a, b in self._spans]  # read before the settle below
        self._settle()  # before the next pass's barrier, which every rank must reach with nothing pending
        in_flight = sum(max(0.0, b - max(a, t0)) for a, b in spans)  # one at a time: the spans do not overlap
        # a hook waits only while the collective before its own is in flight: that time computed nothing
        return {"seconds": t1 - t0, "waited": self._waited, "in_flight": max(0.0, in_flight - self._waited)}
