"""A calibration rank (`torchrun ... -m dtlab.rank.calibration RUN_DIR`): the sweep that dtlab.launching.calibration
configures, inside the one rank lifecycle. See dtlab.launching.calibration for how samples are timed on gloo and CUDA."""

from __future__ import annotations

import os
import random
import sys
import time

from dtlab.config.calibration import CalibConfig

# ---- the rank side ----------------------------------------------------------------------------------------


def _rank_main(run_dir: str) -> int:
    """A calibration rank: the one rank lifecycle (dtlab.rank.lifecycle.rank_main) around the sweep."""
    from dtlab.rank.lifecycle import rank_main, read_config

    def body(run_dir, rank, world, writer):
        _sweep(CalibConfig(**read_config(run_dir)["calibration"]), run_dir, rank, world, writer)

    return rank_main(run_dir, body)


def _sweep(cfg: CalibConfig, run_dir: str, rank: int, world: int, writer) -> None:
    import torch
    import torch.distributed as dist

    from dtlab.config.run import RunConfig
    from dtlab.rank.lifecycle import record_resolved, setup_distributed

    rc = RunConfig(nproc=cfg.nproc, backend=cfg.backend)
    device, backend = setup_distributed(rc, rank, world)
    cuda = device.type == "cuda"
    k_calls = cfg.batch or (20 if cuda else 1)
    if rank == 0:
        timing = (
            f"slowest rank per sample; each sample = CUDA events around {k_calls} back-to-back calls / "
            f"{k_calls}, devices aligned by a tiny all_reduce just before the start event (no host barrier)"
            if cuda
            else f"slowest rank per sample; host barrier (not timed), then wall clock around "
            f"{k_calls} blocking call(s) / {k_calls}"
        )
        algo = {k: os.environ[k] for k in ("NCCL_ALGO", "NCCL_PROTO") if k in os.environ}
        record_resolved(
            run_dir,
            rc,
            backend,
            device,
            {
                "what": "collective calibration",
                "timing": timing,
                "calls_per_sample": k_calls,
                "nccl_algo_proto": algo
                or (
                    "chosen by NCCL's tuner per size (torch does not expose the choice; pin "
                    "it with NCCL_ALGO / NCCL_PROTO)"
                    if backend == "nccl"
                    else None
                ),
            },
            world,
        )
    align = torch.zeros(1, device=device)
    warm = torch.ones(1 << 20, device=device)
    for _ in range(3):  # connections and buffers are set up lazily: pay for that before any timed size
        dist.all_reduce(warm)
    # One group per timed size p: the first p ranks (the whole world: the default group). Every rank creates
    # every group, in the same order (torch requires it); a rank outside a group only joins the barriers.
    groups = {k: None if k == world else dist.new_group(list(range(k))) for k in cfg.ranks_timed()}
    load = None
    if cfg.load == "backward":
        from dtlab.rank.contention import BackwardLoad
        from dtlab.rank.marks import Marks

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
            (op, nbytes): _collective(op, nbytes, world, device, None, async_op=True)
            for op in cfg.ops
            for nbytes in cfg.rounded_sizes()
        }
    calls = {}
    for op in cfg.ops:
        for nbytes in cfg.rounded_sizes():
            for k, group in groups.items():
                calls[(op, nbytes, k)] = _collective(op, nbytes, k, device, group) if rank < k else None
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
        first = it
        for op, nbytes, p in order:
            call = calls[(op, nbytes, p)]
            for _ in range(cfg.warmup if call else 0):
                call()
            for k in range(n_timed):
                if call is None:  # not in this group: keep step with the barriers (or the CUDA alignment)
                    dist.all_reduce(align) if cuda else dist.barrier()
                    continue
                if cuda:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    dist.all_reduce(align)  # device-side alignment: completes only when every rank is here
                    a.record()
                    for _ in range(k_calls):
                        call()
                    b.record()
                    b.synchronize()
                    t = a.elapsed_time(b) / 1e3 / k_calls
                else:
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(k_calls):
                        call()  # blocking on gloo: returns when the collective has completed on this rank
                    t = (time.perf_counter() - t0) / k_calls
                writer.write("sample", rank=rank, op=op, nbytes=nbytes, nproc=p, iter=first + k, seconds=t, load="idle")
        if load is not None:  # the same sizes, each issued from inside a replayed backward pass (whole world)
            timed = [(op, nbytes, first + k) for op, nbytes in issue for k in range(n_timed)]
            rng.shuffle(timed)
            warm = [((op, nbytes, None), issue[(op, nbytes)]) for op, nbytes in issue for _ in range(cfg.warmup)]

            def progress(passes, left, rnd=rnd):
                writer.write("load_pass", rank=rank, round=rnd, passes=passes, left=left, time=time.time())

            for (op, nbytes, i), t in load.sample(
                warm + [((op, n, i), issue[(op, n)]) for op, n, i in timed], on_pass=progress
            ):
                if i is not None:
                    writer.write(
                        "sample", rank=rank, op=op, nbytes=nbytes, nproc=world, iter=i, seconds=t, load="backward"
                    )
        it += n_timed
        writer.write("calib", rank=rank, round=rnd, rounds=cfg.rounds)
    if load is not None:
        writer.write("load_done", rank=rank, passes=load.passes, time=time.time())


def _collective(op: str, nbytes: int, world: int, device, group=None, async_op: bool = False):
    """A zero-argument call of `op` among `world` ranks (`group`; None: all) on preallocated fp32 buffers of
    `nbytes` (full message): blocking, or with `async_op` returning the Work of its last collective. 'ps' is
    strategy ps's round for one bucket: reduce to rank 0 (every group's first rank), then broadcast from it."""
    import torch
    import torch.distributed as dist

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


def entry(argv: list[str]) -> int:
    """A calibration rank for the run directory argv[0]; returns the exit code."""
    return _rank_main(argv[0])


def warm(argv: list[str]) -> None:
    """What a calibration rank imports: torch.distributed (torchrun's agent imports it before forking CPU ranks)."""
    import torch.distributed  # noqa: F401


if __name__ == "__main__":
    from dtlab.rank.lifecycle import exit_rank

    exit_rank(entry(sys.argv[1:]))
