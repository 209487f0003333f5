"""The rank side of the "build it yourself" exercises: `torchrun ... -m dtlab.rank.harness RUN_DIR`.

The notebook (dtlab.course.exercises) wrote the student's function into RUN_DIR/student.py and what to check
into config.json["exercise"]. Each rank imports that file, joins a gloo group on CPU and checks it:

- comm_hook: a DDP model (float64 MLP) whose buckets go through the student's hook, wrapped so each bucket's
  ready / issue / completion is marked (as dtlab.rank.recorder.BucketRecorder does for dtlab's own hook), is
  compared after every step with a single-process model trained on the concatenation of every rank's batch;
- ring_allreduce: the student's ring against `dist.all_reduce` on several sizes, with the point-to-point and
  collective calls it made counted, then timed next to `dist.all_reduce`.

Events (events/rank{r}.jsonl): `ready` (the student's code is loaded and the group formed: the notebook's stall
limit starts), `hook_step`, `bucket`, `ring_size`, `ring_time`; a `not_implemented` event
when the student's function raises NotImplementedError (the rank then ends cleanly). Never imported by the
notebook side.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP

from dtlab.rank.lifecycle import exit_rank, rank_main, read_config

P2P = ("send", "recv", "isend", "irecv")
COLLECTIVES = (
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
)


def load_student(run_dir: str, name: str):
    spec = importlib.util.spec_from_file_location("dtlab_student", os.path.join(run_dir, "student.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def body(run_dir: str, rank: int, world: int, writer) -> None:
    ex = read_config(run_dir)["exercise"]
    torch.set_num_threads(1)  # tiny tensors; the two ranks share the cores
    dist.init_process_group("gloo")
    fn = load_student(run_dir, ex["name"])
    writer.write("ready", rank=rank)  # started: from here the notebook's stall limit applies
    try:
        (check_hook if ex["kind"] == "comm_hook" else check_ring)(fn, ex, rank, world, writer)
    except NotImplementedError as e:
        writer.write("not_implemented", rank=rank, message=str(e))
        dist.barrier()  # the peer may be blocked in the reference's collective: keep the ending clean
        return
    dist.barrier()


# ---- comm_hook ------------------------------------------------------------------------------------------
def _mlp(dims, seed):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        layers.append(torch.nn.Linear(a, b, dtype=torch.float64))
        if i < len(dims) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def _layer_names(model) -> dict:
    """id(parameter) -> 'linear2 (32->32)': the MLP's Linear layers numbered from the input, with their shapes,
    so a bucket's contents read as layers, not as nn.Sequential indices."""
    out, k = {}, 0
    for m in model:
        if isinstance(m, torch.nn.Linear):
            k += 1
            for p in m.parameters():
                out[id(p)] = f"linear{k} ({m.in_features}->{m.out_features})"
    return out


def _batch(seed: int, step: int, batch: int, dims):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(batch, dims[0], generator=g, dtype=torch.float64)
    return x, torch.randn(batch, dims[-1], generator=g, dtype=torch.float64)


def _flat_grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _timed_hook(fn, by_id: dict, layer_of: dict, recs: list):
    """The student's hook `fn` wrapped so that each bucket it reduces is appended to `recs` with its marks."""

    def timed_hook(state, bucket):
        # t_ready: the bucket reached the hook; t_start: the student's hook returned its future (the
        # all-reduce is handed to the backend; whatever the hook did before issuing lies in between); t_end:
        # the future's callback, which gloo runs in its thread the moment the collective completes.
        t_ready = time.perf_counter()
        buf = bucket.buffer()
        rec = {
            "bucket": bucket.index(),
            "nbytes": buf.numel() * buf.element_size(),
            "nparams": len(bucket.parameters()),
            "params": [by_id.get(id(p), "?") for p in bucket.parameters()],
            "layers": sorted({layer_of.get(id(p), "?") for p in bucket.parameters()}),
            "t_ready": t_ready,
        }
        fut = fn(state, bucket)
        rec["t_start"] = time.perf_counter()
        if not isinstance(fut, torch._C.Future):  # what work.get_future() and .then() return
            raise TypeError(
                "the hook must return a torch.futures.Future (e.g. work.get_future().then(...)), "
                f"got {type(fut).__name__}"
            )
        recs.append(rec)

        def done(f):
            rec["t_end"] = time.perf_counter()
            value = f.value()
            if isinstance(value, (list, tuple)):  # work.get_future() as it is: DDP cannot copy a list back
                raise TypeError(
                    f"the hook's future holds a list of {len(value)} tensor(s), what work.get_future() "
                    "gives; DDP needs a future whose value is the bucket tensor itself: return "
                    "work.get_future().then(lambda fut: fut.value()[0])"
                )
            return value

        return fut.then(done)

    return timed_hook


def check_hook(fn, ex, rank, world, writer) -> None:
    dims, lr, batch = ex["dims"], ex["lr"], ex["batch"]
    model, ref, local = _mlp(dims, ex["init_seed"]), _mlp(dims, ex["init_seed"]), _mlp(dims, ex["init_seed"])
    names = [n for n, _ in model.named_parameters()]
    by_id = {id(p): n for n, p in model.named_parameters()}
    layer_of = _layer_names(model)
    ddp = DDP(model, bucket_cap_mb=ex["bucket_bytes"] / 2**20)
    recs = []
    ddp.register_comm_hook(None, _timed_hook(fn, by_id, layer_of, recs))
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    loss_fn = torch.nn.MSELoss()
    for step in range(ex["steps"]):
        xs, ys = zip(*[_batch(ex["data_seed"] + r, step, batch, dims) for r in range(world)])
        # what this rank would compute without any communication, at the same parameters
        local.load_state_dict(model.state_dict())
        local.zero_grad()
        loss_fn(local(xs[rank]), ys[rank]).backward()
        local_grads = _flat_grads(local)
        # the single-process reference: one model on the union of every rank's batch
        ref_opt.zero_grad()
        loss_fn(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_grads = _flat_grads(ref)
        ref_opt.step()
        recs.clear()
        opt.zero_grad()
        t0 = time.perf_counter()
        loss_fn(ddp(xs[rank]), ys[rank]).backward()
        t_bwd = time.perf_counter() - t0
        grads = _flat_grads(model)
        opt.step()
        t_step = time.perf_counter() - t0
        errs = [float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters())]
        close = [
            torch.allclose(p, q, rtol=ex["rtol"], atol=ex["atol"]) for p, q in zip(model.parameters(), ref.parameters())
        ]
        writer.write(
            "hook_step",
            rank=rank,
            step=step,
            t_step=t_step,
            t_bwd=t_bwd,
            max_abs_err=max(errs),
            allclose=all(close),
            bad_params=[n for n, ok in zip(names, close) if not ok],
            ratio=_ratio(grads, ref_grads),
            is_local=all(torch.allclose(g, lg) for g, lg in zip(grads, local_grads))
            and not all(torch.allclose(lg, rg) for lg, rg in zip(local_grads, ref_grads)),
        )
        for rec in recs:
            writer.write(
                "bucket", rank=rank, step=step, **{k: (v - t0 if k.startswith("t_") else v) for k, v in rec.items()}
            )


def _ratio(grads, ref_grads) -> float | None:
    """Median of got / expected over the gradient entries the reference does not leave near zero."""
    got, want = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])
    keep = want.abs() > 1e-6 * float(want.abs().max() or 1.0)
    return float((got[keep] / want[keep]).median()) if keep.any() else None


# ---- ring_allreduce -------------------------------------------------------------------------------------
class CallCounter:
    """Counts the torch.distributed calls the student's function makes (and bytes it sends), by wrapping the
    functions in torch.distributed and in distributed_c10d (where P2POp checks its `op` against them)."""

    def __init__(self):
        self.counts, self.sent_bytes, self._saved = {}, 0, []

    def __enter__(self):
        for name in P2P + COLLECTIVES:
            orig = getattr(c10d, name)
            wrapper = self._wrap(name, orig)
            for mod in (dist, c10d):
                self._saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, wrapper)
        return self

    def _wrap(self, name, orig):
        @functools.wraps(orig)
        def wrapper(tensor, *args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            if name in ("send", "isend"):
                self.sent_bytes += tensor.numel() * tensor.element_size()
            return orig(tensor, *args, **kwargs)

        return wrapper

    def __exit__(self, *exc):
        for mod, name, orig in reversed(self._saved):
            setattr(mod, name, orig)


def _call_ring(fn, x):
    out = fn(x)
    return out if isinstance(out, torch.Tensor) else x


def check_ring(fn, ex, rank, world, writer) -> None:
    for n in ex["sizes"]:
        g = torch.Generator().manual_seed(ex["data_seed"] + 7919 * rank + n)
        x = torch.randn(n, generator=g)
        want = x.clone()
        dist.all_reduce(want)
        with CallCounter() as cc:
            got = _call_ring(fn, x.clone())
        ok = got.shape == want.shape and torch.allclose(got, want, rtol=ex["rtol"], atol=ex["atol"])
        chunks = []
        if got.shape == want.shape:
            for gc, wc, xc in zip(got.tensor_split(world), want.tensor_split(world), x.tensor_split(world)):
                chunks.append(_chunk_state(gc, wc, xc, ex))
        writer.write(
            "ring_size",
            rank=rank,
            n=n,
            nbytes=n * 4,
            ok=bool(ok),
            chunks=chunks,
            calls=cc.counts,
            sent_bytes=cc.sent_bytes,
            shape=list(got.shape),
            max_abs_err=float((got - want).abs().max()) if got.shape == want.shape else None,
        )
    for nbytes in ex["timing_sizes"]:
        buf, ref = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
        # each call bound to this size's buffers
        ring, allreduce = (lambda buf=buf: _call_ring(fn, buf)), (lambda ref=ref: dist.all_reduce(ref))
        for what, call in (("ring", ring), ("all_reduce", allreduce)):
            for i in range(ex["warmup"] + ex["iters"]):
                dist.barrier()  # align the ranks (not timed); the slowest rank per iteration is the sample
                t0 = time.perf_counter()
                call()
                t = time.perf_counter() - t0
                if i >= ex["warmup"]:
                    writer.write("ring_time", rank=rank, what=what, nbytes=nbytes, iter=i - ex["warmup"], seconds=t)
            buf.fill_(1.0)
            ref.fill_(1.0)


def _chunk_state(got, want, mine, ex) -> str:
    if got.numel() == 0 or torch.allclose(got, want, rtol=ex["rtol"], atol=ex["atol"]):
        return "ok"
    if torch.equal(got, mine):
        return "never reduced"
    keep = want.abs() > 1e-3
    if keep.any():
        r = float((got[keep] / want[keep]).median())
        if abs(r - round(r * 4) / 4) < 1e-3 and round(r * 4) != 4:
            return f"{r:.2f}x the sum"
    return "wrong values"


def entry(argv: list[str]) -> int:
    """An exercise rank for the run directory argv[0]; returns the exit code."""
    return rank_main(argv[0], body)


if __name__ == "__main__":
    exit_rank(entry(sys.argv[1:]))
