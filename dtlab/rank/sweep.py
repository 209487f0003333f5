"""The collective sweep a calibration rank runs (dtlab.rank.calibration is its entry point): every (op, size, ranks)
that dtlab.launching.calibration configures, timed in warmed-up blocks over shuffled rounds, idle and, with
`load='backward'`, issued from inside a replayed backward pass. See dtlab.launching.calibration for how samples are
timed on gloo and CUDA."""

from __future__ import annotations

import os
import random
import time

import torch
import torch.distributed as dist

from dtlab.config.calibration import CalibConfig
from dtlab.config.run import RunConfig
from dtlab.rank.contention import BackwardLoad
from dtlab.rank.lifecycle import record_resolved, setup_distributed
from dtlab.rank.marks import Marks


def sweep(cfg: CalibConfig, run_dir: str, rank: int, world: int, writer) -> None:
    """Time every configured collective on this rank and write its `sample` events (and the load's events)."""
    rc = RunConfig(nproc=cfg.nproc, backend=cfg.backend)
    placed = rc.placement()  # resolved once: the process group and the record read the same
    device, backend = setup_distributed(placed, rank, world)
    timer = BlockTimer(writer, rank, device, cfg.batch)
    if rank == 0:
        record_resolved(run_dir, rc, placed, device, _facts(backend, timer.cuda, timer.k_calls), world)
    warm = torch.ones(1 << 20, device=device)
    for _ in range(3):  # connections and buffers are set up lazily: pay for that before any timed size
        dist.all_reduce(warm)
    # One group per timed size p: the first p ranks (the whole world: the default group). Every rank creates
    # every group, in the same order (torch requires it); a rank outside a group only joins the barriers.
    groups = {k: None if k == world else dist.new_group(list(range(k))) for k in cfg.ranks_timed()}
    loaded = _backward_load(cfg, device, backend, rank, world, writer) if cfg.load == "backward" else None
    calls = {}
    for op in cfg.ops:
        for nbytes in cfg.rounded_sizes():
            for k, group in groups.items():
                calls[(op, nbytes, k)] = collective(op, nbytes, k, device, group) if rank < k else None
    # Rounds of warmed-up blocks: each round visits every (op, size) in an order shuffled per round (same on
    # all ranks), and times a short block of it after `warmup` untimed calls, as nccl-tests does per size. The
    # blocks give each size its steady state (a 4 KiB all-reduce right after a 64 MiB one is slower); the
    # shuffled rounds spread drift in the machine's load over all sizes instead of biasing a few.
    order = list(calls)
    rng = random.Random(0)
    per_round = [cfg.iters // cfg.rounds + (1 if r < cfg.iters % cfg.rounds else 0) for r in range(cfg.rounds)]
    it = 0
    for rnd, n_timed in enumerate(per_round):
        rng.shuffle(order)
        for key in order:
            timer.block(key, calls[key], cfg.warmup, n_timed, it)
        if loaded is not None:  # the same sizes, each issued from inside a replayed backward pass (whole world)
            loaded.round(rnd, n_timed, it, rng)
        it += n_timed
        writer.write("calib", rank=rank, round=rnd, rounds=cfg.rounds)
    if loaded is not None:
        writer.write("load_done", rank=rank, passes=loaded.load.passes, time=time.time())


def _facts(backend: str, cuda: bool, k_calls: int) -> dict:
    """What rank 0 adds to config.json: how a sample is timed, and NCCL's algorithm and protocol when pinned."""
    timing = (
        f"slowest rank per sample; each sample = CUDA events around {k_calls} back-to-back calls / "
        f"{k_calls}, devices aligned by a tiny all_reduce just before the start event (no host barrier)"
        if cuda
        else f"slowest rank per sample; host barrier (not timed), then wall clock around "
        f"{k_calls} blocking call(s) / {k_calls}"
    )
    algo = {k: os.environ[k] for k in ("NCCL_ALGO", "NCCL_PROTO") if k in os.environ}
    return {
        "what": "collective calibration",
        "timing": timing,
        "calls_per_sample": k_calls,
        "nccl_algo_proto": algo
        or (
            "chosen by NCCL's tuner per size (torch does not expose the choice; pin it with NCCL_ALGO / NCCL_PROTO)"
            if backend == "nccl"
            else None
        ),
    }


class BlockTimer:
    """Times blocks of one (op, size, ranks) on this rank and writes their idle `sample` events. A sample is the
    mean of `k_calls` back-to-back calls (`batch`; None: 20 on CUDA, 1 on CPU): on CUDA, events around them after a
    tiny all-reduce that aligns the devices; on CPU, the wall clock after a host barrier."""

    def __init__(self, writer, rank: int, device, batch: int | None):
        self.writer, self.rank = writer, rank
        self.cuda = device.type == "cuda"
        self.k_calls = batch or (20 if self.cuda else 1)
        self.align = torch.zeros(1, device=device)

    def block(self, key: tuple, call, warmup: int, n_timed: int, first: int) -> None:
        """`warmup` untimed calls, then `n_timed` samples numbered from `first`. `call` None: this rank is not in
        the block's group, and only keeps step with the barriers (or the CUDA alignment)."""
        op, nbytes, p = key
        for _ in range(warmup if call else 0):
            call()
        for k in range(n_timed):
            if call is None:
                dist.all_reduce(self.align) if self.cuda else dist.barrier()
                continue
            t = self.sample(call)
            self.writer.write(
                "sample", rank=self.rank, op=op, nbytes=nbytes, nproc=p, iter=first + k, seconds=t, load="idle"
            )

    def sample(self, call) -> float:
        """Seconds per call of `k_calls` calls of `call`."""
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.all_reduce(self.align)  # device-side alignment: completes only when every rank is here
            a.record()
            for _ in range(self.k_calls):
                call()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3 / self.k_calls
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(self.k_calls):
            call()  # blocking on gloo: returns when the collective has completed on this rank
        return (time.perf_counter() - t0) / self.k_calls


class LoadedSampler:
    """The loaded half of a round: every (op, size) issued asynchronously by the whole world from inside a
    replayed backward pass (dtlab.rank.contention.BackwardLoad), in a shuffled order."""

    def __init__(self, cfg: CalibConfig, load: BackwardLoad, issue: dict, writer, rank: int, world: int):
        self.cfg, self.load, self.issue = cfg, load, issue
        self.writer, self.rank, self.world = writer, rank, world

    def round(self, rnd: int, n_timed: int, first: int, rng: random.Random) -> None:
        """Round `rnd`: `cfg.warmup` untimed issues of each, then `n_timed` samples of each numbered from `first`."""
        issue, writer, rank = self.issue, self.writer, self.rank
        timed = [(op, nbytes, first + k) for op, nbytes in issue for k in range(n_timed)]
        rng.shuffle(timed)
        warmups = [((op, nbytes, None), issue[(op, nbytes)]) for op, nbytes in issue for _ in range(self.cfg.warmup)]

        def progress(passes, left, figures, idle=False, solo=False):
            writer.write(
                "load_pass",
                rank=rank,
                round=rnd,
                passes=passes,
                left=left,
                idle=idle,
                solo=solo,
                time=time.time(),
                **figures,
            )

        for who in range(self.world):  # each rank's pass alone: what sharing the machine costs its compute
            mine = self.load.solo_pass(who)
            if mine is not None:
                progress(self.load.passes, len(timed), mine, idle=True, solo=True)

        # a pass with nothing in flight before and after the round's loaded passes: the compute they are compared
        # with (dtlab.model.sharing), under the same drift
        calls = warmups + [((op, n, i), issue[(op, n)]) for op, n, i in timed]
        progress(self.load.passes, len(calls), self.load.idle_pass(), idle=True)
        samples = self.load.sample(calls, on_pass=progress)
        progress(self.load.passes, 0, self.load.idle_pass(), idle=True)
        for (op, nbytes, i), t in samples:
            if i is not None:
                writer.write(
                    "sample", rank=rank, op=op, nbytes=nbytes, nproc=self.world, iter=i, seconds=t, load="backward"
                )


def _backward_load(cfg: CalibConfig, device, backend: str, rank: int, world: int, writer) -> LoadedSampler:
    """The model whose backward pass the loaded samples are issued from, and an asynchronous call of every
    (op, size) over the whole world."""
    marks = Marks(device, backend)
    marks.prepare()
    load = BackwardLoad(cfg.load_model, cfg.load_batch_size, cfg.load_seq_len, device, marks, seed=rank)
    if rank == 0:
        writer.write(
            "load",
            rank=rank,
            model=cfg.load_model,
            batch_size=cfg.load_batch_size,
            seq_len=cfg.load_seq_len,
            threads=torch.get_num_threads(),
            time=time.time(),
        )
    issue = {
        (op, nbytes): collective(op, nbytes, world, device, None, async_op=True)
        for op in cfg.ops
        for nbytes in cfg.rounded_sizes()
    }
    return LoadedSampler(cfg, load, issue, writer, rank, world)


def collective(op: str, nbytes: int, world: int, device, group=None, async_op: bool = False):
    """A zero-argument call of `op` among `world` ranks (`group`; None: all) on preallocated fp32 buffers of
    `nbytes` (full message): blocking, or with `async_op` returning the Work of its last collective. 'ps' is
    strategy ps's round for one bucket: reduce to rank 0 (every group's first rank), then broadcast from it."""
    n = nbytes // 4
    if op == "all_reduce":
        x = torch.ones(n, device=device)
        return lambda: dist.all_reduce(x, group=group, async_op=async_op)
    if op == "ps":
        x = torch.ones(n, device=device)
        return lambda: (dist.reduce(x, dst=0, group=group), dist.broadcast(x, src=0, group=group, async_op=async_op))[1]
    if op == "reduce_scatter":
        x, y = torch.ones(n, device=device), torch.empty(n // world, device=device)
        return lambda: dist.reduce_scatter_tensor(y, x, group=group, async_op=async_op)
    x, y = torch.ones(n // world, device=device), torch.empty(n, device=device)
    return lambda: dist.all_gather_into_tensor(y, x, group=group, async_op=async_op)
