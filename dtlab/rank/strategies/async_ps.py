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

from dtlab.config.convergence import lr_rule_text
from dtlab.config.run import RunConfig
from dtlab.rank.build import build_replica
from dtlab.rank.evaluation import Evaluator, TrainClock
from dtlab.rank.lifecycle import record_resolved
from dtlab.rank.marks import rank_marks
from dtlab.rank.optim import Optimizer
from dtlab.rank.recorder import peak_memory, tensor_bytes
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


def train(cfg: RunConfig, run_dir: str, rank: int, world: int, writer) -> None:
    """The server on rank 0, a worker on every other rank."""
    workers = world - 1  # the global batch is cut into one share per worker; the server reads none
    rep = build_replica(cfg, rank, world, shards=workers, shard=rank - 1 if rank else None)
    device, backend = rep.device, rep.backend
    nparams = rep.facts["num_parameters"]
    facts = {
        **rep.facts,
        "server_rank": SERVER,
        "workers": workers,
        "message_bytes": {"push": (HDR_PUSH + nparams) * 4, "pull": (HDR_PULL + nparams) * 4},
    }
    group = dist.new_group(backend="gloo") if backend != "gloo" else None  # host messages, any source
    model = rep.model.to(device)
    model.train()
    if rank == SERVER:
        evaluator = Evaluator(cfg, rep.tokenizer, facts["data_source"], device, active=True)
        timing = rank_marks(device, backend, synced=True).facts()  # how the workers take their marks
        record_resolved(
            run_dir,
            cfg,
            backend,
            device,
            {
                **facts,
                **evaluator.facts,
                "lr_rule": lr_rule_text(cfg),
                "timing_method": timing,
                "staleness": {"max": cfg.sync.max_staleness, "policy": cfg.sync.staleness_policy},
            },
            world,
        )
        writer.write("ready", rank=rank, time=time.time(), **facts)
        _serve(cfg, model, world, device, writer, evaluator, group)
    else:
        writer.write("ready", rank=rank, time=time.time(), **facts)
        _work(cfg, model, rank, rep.batches, device, writer, group)
    peak, kind = peak_memory(device)
    writer.write(
        "memory",
        rank=rank,
        params_bytes=tensor_bytes(model.parameters()),
        grads_bytes=tensor_bytes(p.grad for p in model.parameters()),
        opt_bytes=None,
        peak_bytes=peak,
        peak_kind=kind,
    )


def _serve(cfg: RunConfig, model, world: int, device, writer, evaluator, group) -> None:
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.zeros_like(p)
    optim = Optimizer(cfg, params)
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
    """Named marks of a worker's step on the rank's synchronised marks (dtlab.rank.marks.SyncedMarks): the host's
    wall clock, on a GPU taken after the device finished its queued work (the messages block the host anyway)."""

    def __init__(self, marks):
        self.m, self.marks = marks, {}

    def mark(self, name: str) -> None:
        self.marks[name] = self.m.now()

    def read(self) -> dict:
        t0 = self.marks.pop("start")
        out = {k: self.m.seconds(t0, v) for k, v in self.marks.items()}
        self.marks = {}
        return out


def _work(cfg: RunConfig, model, rank: int, batches, device, writer, group) -> None:
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)
    push = torch.zeros(HDR_PUSH + n)  # host memory: gloo's point-to-point messages
    pull = torch.empty(HDR_PULL + n)
    dist.recv(pull, src=SERVER, tag=PULL, group=group)  # the initial parameters: before the first step, not timed
    _unflat(pull[HDR_PULL:], params)
    version = int(pull[0])
    clock = _Clock(rank_marks(device, "nccl" if device.type == "cuda" else "gloo", synced=True))
    nbytes = {"push": push.numel() * push.element_size(), "pull": pull.numel() * pull.element_size()}
    for step in range(cfg.steps):
        batch = batches[step % len(batches)]
        clock.mark("start")
        model.zero_grad(set_to_none=False)
        out = model(**batch)
        clock.mark("fwd")
        out.loss.backward()
        clock.mark("bwd")
        push[0], push[1], push[2], push[3] = GRAD, float(step), float(version), float(out.loss.detach())
        push[HDR_PUSH:] = _flat(p.grad for p in params)
        clock.mark("push_start")
        dist.send(push, dst=SERVER, tag=PUSH, group=group)
        clock.mark("push_end")
        dist.recv(pull, src=SERVER, tag=PULL, group=group)
        clock.mark("pull_end")
        _unflat(pull[HDR_PULL:], params)
        version = int(pull[0])
        clock.mark("opt")
        t = clock.read()
        writer.write(
            "step",
            rank=rank,
            step=step,
            t_fwd=t["fwd"],
            t_bwd=t["bwd"] - t["fwd"],
            t_opt=t["opt"] - t["bwd"],
            t_step=t["opt"],
            loss=float(out.loss.detach()),
            lr=None,
            version=version,
            time=time.time(),
        )
        for op, a, b in (("push", "push_start", "push_end"), ("pull", "push_end", "pull_end")):
            writer.write(
                "collective", rank=rank, step=step, op=op, phase=op, nbytes=nbytes[op], t_start=t[a], t_end=t[b]
            )
    push[0] = DONE
    dist.send(push, dst=SERVER, tag=PUSH, group=group)
