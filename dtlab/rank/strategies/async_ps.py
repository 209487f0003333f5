"""Strategy 'async': an asynchronous parameter server. Rank 0 is the server (it holds the parameters and the
optimizer); ranks 1 .. p-1 are workers that each compute a gradient on their own batch, push it, and pull the
parameters back, never waiting for each other. The server applies every pushed gradient once, in the order they
arrive (one optimizer update each), unless it is staler than `max_staleness` (dtlab.rank.staleness: policy 'drop'
skips it, policy 'wait' holds fast workers back so that it never happens).

Messages are point to point (gloo's send/recv; the server receives from any source), fixed length, float32:

    push  worker -> server, tag 1: [kind, worker step, version computed on, loss, gradient (n numbers)]
                                   kind 1 = a gradient, 0 = done (the worker leaves; no reply)
    pull  server -> worker, tag 2: [version, 0, parameters (n numbers)]

Shutdown: a worker that has run its `steps` sends 'done' (a full-size message: a receive must match the size);
the server stops when no worker is left, after waiting for every reply it sent.

The messages always travel through gloo in host memory (a gloo group of their own when the run's backend is
NCCL, which cannot receive from any source), and times are the host's wall clock: a message blocks the host.
On a GPU the gradient's copy to host memory synchronises with the backward before the push.

What is recorded:
- workers: `step` events (t_fwd, t_bwd; t_opt = push + pull + loading the parameters, the worker's share of the
  optimizer step: it includes the wait while the server applies other updates or holds this worker back) and one
  `collective` event per message (op 'push' / 'pull', phase the same, nbytes the message's bytes with its header,
  t_start / t_end from the step start);
- the server: one `update` event per push taken (worker, its step, computed_on, staleness, applied, version
  after it, t = the server's training time, lr), `eval` events every `eval_every` versions (and at version 0 and
  at the end), a `staleness` summary at the end. Evaluations happen after the reply to the worker that pushed,
  and their time is left out of `t`; a worker whose push arrives meanwhile waits for it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dtlab.config.run import RunConfig
from dtlab.rank.build import build_replica
from dtlab.rank.evaluation import Evaluator, TrainClock
from dtlab.rank.loop import Setup, Step, Strategy
from dtlab.rank.marks import rank_marks
from dtlab.rank.optim import Optimizer
from dtlab.rank.recorder import Mark, tensor_bytes
from dtlab.rank.staleness import Book

PUSH, PULL = 1, 2
HDR_PUSH, HDR_PULL = 4, 2
GRAD, DONE = 1.0, 0.0
SERVER = 0


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, tensors) -> None:
    off = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off : off + n].view_as(t))
            off += n


class _AsyncRank(Strategy):
    """What the server and its workers share: the replica, the facts, the host-memory message group."""

    # the fault drills meet at a barrier at the faulty step, which the server, taking no steps, would never reach
    inject_faults = False

    def setup(self) -> Setup:
        """Build the replica (the global batch cut into one share per worker) and the message group."""
        cfg, rank, world = self.ctx.cfg, self.ctx.rank, self.ctx.world
        workers = world - 1  # the global batch is cut into one share per worker; the server reads none
        rep = build_replica(
            self.ctx,
            shards=workers,
            shard=rank - 1 if rank else None,
            heldout=rank == 0 and cfg.evaluation.every > 0,
        )
        self.device, self.batches = rep.device, rep.batches
        nparams = rep.facts["num_parameters"]
        self.facts = {
            **rep.facts,
            "server_rank": SERVER,
            "workers": workers,
            "message_bytes": {"push": (HDR_PUSH + nparams) * 4, "pull": (HDR_PULL + nparams) * 4},
        }
        self.group = dist.new_group(backend="gloo") if rep.backend != "gloo" else None  # host messages, any source
        self.model = rep.model.to(rep.device)
        self.model.train()
        self.tokenizer, self.lr, self.heldout = rep.tokenizer, rep.lr, rep.heldout
        return Setup(rep.device, rep.backend, self.facts, self.facts)

    def memory(self, final: bool) -> dict | None:
        """At the end only: the parameters and gradients this rank holds (the optimizer's state is not counted)."""
        if not final:
            return None
        params = list(self.model.parameters())
        return {
            "params_bytes": tensor_bytes(params),
            "grads_bytes": tensor_bytes(p.grad for p in params),
            "opt_bytes": None,
        }


class AsyncServer(_AsyncRank):
    """Rank 0: takes no steps of its own; serves the workers until every one is done."""

    def setup(self) -> Setup:
        """The replica, the evaluator, and the facts rank 0 records."""
        setup = super().setup()
        cfg = self.ctx.cfg
        self.evaluator = Evaluator(
            cfg.evaluation,
            self.tokenizer,
            self.heldout,
            self.device,
            active=True,
            total_steps=cfg.steps,
            seq_len=cfg.seq_len,
        )
        setup.resolved = {
            **self.facts,
            **self.evaluator.facts,
            "lr_rule": self.lr.rule,
            "timing_method": rank_marks(self.device, setup.backend, synced=True).facts(),  # the workers' marks
            "staleness": {"max": cfg.sync.max_staleness, "policy": cfg.sync.staleness_policy},
        }
        return setup

    def order(self, first: int) -> list:
        """No steps: the server's work is `after_steps`."""
        return []

    def after_steps(self) -> None:
        """Serve the workers (see `_serve`)."""
        _serve(
            self.ctx.cfg, self.lr, self.model, self.ctx.world, self.device, self.ctx.writer, self.evaluator, self.group
        )


class AsyncWorker(_AsyncRank):
    @classmethod
    def for_rank(cls, ctx):
        """The server on rank 0, a worker on every other rank."""
        return AsyncServer(ctx) if ctx.rank == SERVER else cls(ctx)

    """Ranks 1 .. p-1: compute a gradient, push it, pull the parameters back."""

    def before_steps(self) -> int:
        """The message buffers, and the initial parameters from the server (before the first step, not timed)."""
        self.params = params = [p for p in self.model.parameters()]
        n = sum(p.numel() for p in params)
        self.push = torch.zeros(HDR_PUSH + n)  # host memory: gloo's point-to-point messages
        self.pull = torch.empty(HDR_PULL + n)
        dist.recv(self.pull, src=SERVER, tag=PULL, group=self.group)
        _unflat(self.pull[HDR_PULL:], params)
        self.version = int(self.pull[0])
        marks = rank_marks(self.device, "nccl" if self.device.type == "cuda" else "gloo", synced=True)
        self.clock = _Clock(marks)
        self.nbytes = {op: b.numel() * b.element_size() for op, b in (("push", self.push), ("pull", self.pull))}
        return 0

    def step(self, step: int, paired: int | None) -> Step:
        """Forward and backward on this worker's batch, the gradient pushed, the parameters pulled and loaded
        (t_opt: the worker's share of the optimizer step, waits for the server included)."""
        clock, push, pull, group = self.clock, self.push, self.pull, self.group
        batch = self.batches[step % len(self.batches)]
        clock.mark(Mark.START)
        self.model.zero_grad(set_to_none=False)
        out = self.model(**batch)
        clock.mark(Mark.FWD)
        out.loss.backward()
        clock.mark(Mark.BWD)
        push[0], push[1], push[2], push[3] = GRAD, float(step), float(self.version), float(out.loss.detach())
        push[HDR_PUSH:] = _flat(p.grad for p in self.params)
        clock.mark(Mark.PUSH_START)
        dist.send(push, dst=SERVER, tag=PUSH, group=group)
        clock.mark(Mark.PUSH_END)
        dist.recv(pull, src=SERVER, tag=PULL, group=group)
        clock.mark(Mark.PULL_END)
        _unflat(pull[HDR_PULL:], self.params)
        self.version = int(pull[0])
        clock.mark(Mark.OPT)
        self.t = t = clock.read()
        return Step(t, {"loss": float(out.loss.detach()), "lr": None, "version": self.version})

    def after_step(self, step: int, paired: int | None, rec: dict) -> None:
        """One `collective` event per message of the step."""
        t, rank = self.t, self.ctx.rank
        for op, a, b in (("push", Mark.PUSH_START, Mark.PUSH_END), ("pull", Mark.PUSH_END, Mark.PULL_END)):
            fields = {"op": op, "phase": op, "nbytes": self.nbytes[op], "t_start": t[a], "t_end": t[b]}
            self.ctx.writer.write("collective", rank=rank, step=step, **fields)

    def after_steps(self) -> None:
        """'done': the server stops waiting for this worker."""
        self.push[0] = DONE
        dist.send(self.push, dst=SERVER, tag=PUSH, group=self.group)


def _serve(cfg: RunConfig, lr, model, world: int, device, writer, evaluator, group) -> None:
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.zeros_like(p)
    optim = Optimizer(lr, params, cfg.optimizer_impl)
    book = Book(cfg.sync.max_staleness, cfg.sync.staleness_policy)
    inbox = torch.empty(HDR_PUSH + n)  # host memory: gloo's point-to-point messages
    outbox = {w: torch.empty(HDR_PULL + n) for w in range(1, world)}
    sending: dict = {}  # worker -> the Work of its last reply (waited before its buffer is reused)
    active = set(range(1, world))
    clock = TrainClock()
    evaluator.total = None  # the number of updates is not known in advance: the last evaluation is at the end
    last_eval = None

    def reply(w: int) -> None:
        if w in sending:
            sending.pop(w).wait()
        buf = outbox[w]
        buf[0], buf[1] = float(book.version), 0.0
        buf[HDR_PULL:] = _flat(params)
        sending[w] = dist.isend(buf, dst=w, tag=PULL, group=group)

    def evaluate() -> None:
        nonlocal last_eval
        evaluator.run(model, book.version, clock, writer, SERVER, force=True, updates=len(book.taken))
        last_eval = book.version

    def start_or_hold(w: int) -> None:
        """Send worker `w` the parameters, or hold it back while the policy says it may not start a step."""
        if book.may_start(w):
            book.started(w)
            reply(w)
        else:
            book.held.append(w)

    if evaluator.due(0):
        evaluate()
    clock.start()
    for w in sorted(active):  # the initial parameters (version 0), as far as the policy lets workers start
        start_or_hold(w)
    while active:
        src = dist.recv(inbox, src=None, tag=PUSH, group=group)  # any worker (gloo returns the sender's rank)
        kind, wstep, wver, loss = (float(x) for x in inbox[:HDR_PUSH])
        if kind == DONE:
            active.discard(src)
            book.outstanding.pop(src, None)
        else:
            taken = _take(book, optim, params, inbox, src, int(wstep), int(wver), loss, writer, clock)
            start_or_hold(src)
        for w in book.release(active):
            reply(w)
        if kind != DONE and taken.applied and evaluator.every and book.version % evaluator.every == 0:
            evaluate()
    if evaluator.active and last_eval != book.version:
        evaluate()
    for work in sending.values():
        work.wait()
    _write_staleness(writer, book, clock)


def _take(book, optim, params, inbox, src: int, wstep: int, wver: int, loss: float, writer, clock):
    """Worker `src`'s pushed gradient (in `inbox`): applied unless the policy drops it, and its `update` event
    written; returns the book's record of it."""
    taken = book.push(src, wstep, wver)
    lr = optim.lr
    if taken.applied:
        _unflat(inbox[HDR_PUSH:], [p.grad for p in params])
        optim.step()
    writer.write(
        "update",
        rank=SERVER,
        worker=src,
        step=taken.step,
        computed_on=taken.computed_on,
        staleness=taken.staleness,
        applied=taken.applied,
        version=taken.version,
        t=clock.train(),
        lr=lr if taken.applied else None,
        loss=loss,
        time=time.time(),
    )
    return taken


def _write_staleness(writer, book, clock) -> None:
    """The server's summary at the end: the histogram of staleness, updates applied and dropped."""
    hist = book.histogram()
    writer.write(
        "staleness",
        rank=SERVER,
        histogram={str(k): v for k, v in hist.items()},
        applied=sum(hist.values()),
        dropped=sum(not t.applied for t in book.taken),
        version=book.version,
        t=clock.train(),
        time=time.time(),
    )


class _Clock:
    """A worker step's marks (dtlab.rank.recorder.Mark) on the rank's synchronised marks
    (dtlab.rank.marks.SyncedMarks): the host's wall clock, on a GPU taken after the device finished its queued work
    (the messages block the host anyway)."""

    def __init__(self, marks):
        self.m, self.marks = marks, {}

    def mark(self, mark: Mark) -> None:
        if not isinstance(mark, Mark):
            raise TypeError(f"a step's mark is a dtlab.rank.recorder.Mark, got {mark!r}")
        self.marks[mark] = self.m.now()

    def read(self) -> dict:
        t0 = self.marks.pop(Mark.START)
        out = {k: self.m.seconds(t0, v) for k, v in self.marks.items()}
        self.marks = {}
        return out
