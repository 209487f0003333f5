"""Strategy 'ddp': DistributedDataParallel with a recording comm hook, one rank per process, driven by the one
training loop (dtlab.rank.loop) with what every data-parallel replica shares (dtlab.rank.strategies.bases).

With `local_sgd` H set the same strategy runs local SGD instead (`LocalSGDStrategy`): a plain model per rank, no
gradient all-reduce, the parameters averaged after every H local steps (dtlab.rank.local_sgd). Everything else is
what every data-parallel replica shares: data, optimizer, straggler, checkpoints, evaluations, the bucket recorder's
facts, the no-op baseline steps (there the same compute, no hook: nothing communicates in backward). The average runs
inside the step, after the optimizer (as PostLocalSGDOptimizer.step does): the optimizer itself ends at Mark.OPTIM,
the average at Mark.OPT, so t_opt holds the average and a baseline step's t_opt only the optimizer's time. Each
average is a `collective` event; `params` digests, taken outside the timed step, show the ranks agreeing after each
average and drifting apart between averages."""

from __future__ import annotations

import contextlib
import inspect
import time

from torch.nn.parallel import DistributedDataParallel as DDP

from dtlab.rank.local_sgd import LocalSGD, digest_due
from dtlab.rank.recorder import Mark
from dtlab.rank.strategies.bases import DataParallel


class DDPStrategy(DataParallel):
    """DDP with dtlab's recording hook (its no-op mode is the compute baseline), DDP's own statistics recorded
    beside the buckets and its logging data at the end. A subclass may reduce each bucket its own way
    (`transport`: strategy 'ps')."""

    @classmethod
    def for_rank(cls, ctx):
        """Local SGD's strategy where `local_sgd` H > 0 ('ddp' runs it: a plain model per rank), else DDP's."""
        if cls is DDPStrategy and ctx.cfg.sync.local_sgd:
            return LocalSGDStrategy(ctx)
        return cls(ctx)

    def wrap(self, model, device):
        """`model` in DDP with `bucket_mb` buckets (see `_wrap`)."""
        self.ddp_forwards: list[int | None] = []  # per synchronised DDP forward: its training step (None: baseline)
        return _wrap(model, device, self.ctx.cfg.ddp.bucket_mb)

    def register_hook(self) -> None:
        """The recording hook, when buckets are recorded or a baseline needs it to switch to no-op."""
        cfg = self.ctx.cfg
        if cfg.record or cfg.measurement.baseline_steps:
            self.ddp.register_comm_hook(None, self.recorder.hook)

    def accumulating(self, no_sync: bool):
        """`no_sync` for every micro-batch but the last: only the last backward communicates."""
        return self.ddp.no_sync() if no_sync else contextlib.nullcontext()

    def backend_records(self, step: int, baseline: bool) -> None:
        """DDP's own runtime stats of the forward before this one (see `_write_ddp_stats`)."""
        # DDP logs a forward's runtime stats in the next synchronised forward (these are the previous one's),
        # and only for its sampled iterations (<= 10 and every 100th): skip the logging-data call on the others.
        self.ddp_forwards.append(None if baseline else step)
        done = len(self.ddp_forwards) - 1  # DDP's count of finished iterations when this forward logged
        if done >= 1 and (done <= 10 or done % 100 == 0) and self.ddp_forwards[done - 1] is not None:
            _write_ddp_stats(self.ddp, self.ctx.writer, self.ctx.rank, self.ddp_forwards[done - 1], done)

    def finish(self) -> None:
        """The transport's thread stops; DDP's own view of the run."""
        super().finish()
        writer, rank = self.ctx.writer, self.ctx.rank
        try:  # DDP's own view (bucket sizes, comm hook, ...), a free cross-check
            data = self.ddp._get_ddp_logging_data()
            writer.write(
                "ddp_logging",
                rank=rank,
                data={k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in data.items()},
            )
        except Exception as e:  # noqa: BLE001 - private API, may change between torch versions
            writer.write("ddp_logging", rank=rank, data={"error": repr(e)})


def _wrap(model, device, bucket_mb) -> DDP:
    """`model` in DDP with `bucket_mb` buckets and no buffer broadcast.

    broadcast_buffers=False: dtlab's models have one buffer, the constant position ids (512 int64, 4,096 B); DDP
    would broadcast it at the start of every forward, a collective that T_fwd and T_comp would count as compute.
    Nothing needs it: no buffer changes during training (no BatchNorm statistics). torch 2.13 renamed the argument
    forward_sync_buffers (and warns on the old name); older versions only know broadcast_buffers."""
    no_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP).parameters
        else {"broadcast_buffers": False}
    )
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb, **no_sync)


_DDP_STATS = (
    "backward_comm_time",
    "backward_compute_time",
    "backward_compute_comm_overlap_time",
    "forward_compute_time",
)


def _write_ddp_stats(ddp, writer, rank: int, step: int, iteration: int) -> None:
    """DDP's own runtime stats for training `step`, logged by DDP when its finished-iteration count was `iteration`
    (its timers: CUDA events on GPU, wall clock on CPU; nanoseconds, written here in seconds): a cross-check of
    dtlab's events that costs nothing inside the step."""
    try:
        data = ddp._get_ddp_logging_data()
        if int(data.get("iteration", -1)) != iteration:  # DDP samples iterations <= 10 and every 100th only
            return
        writer.write(
            "ddp_stats",
            rank=rank,
            step=step,
            **{k: data[k] / 1e9 for k in _DDP_STATS if isinstance(data.get(k), (int, float))},
        )
    except Exception:  # noqa: BLE001 - private API, may change between torch versions
        pass


class LocalSGDStrategy(DataParallel):
    """Local SGD on the shared data-parallel replica (see the module docstring)."""

    nccl_timing = False  # no bucket is communicated: nothing for NCCL to time

    def wrap(self, model, device):
        """The plain model, with the averager that makes every rank start from rank 0's parameters."""
        self.local = LocalSGD(model, self.ctx.cfg.sync.local_sgd, self.ctx.world, device, self.marks)
        self.averaged = None
        return model

    def accumulating(self, no_sync: bool):
        """Nothing to hold back: no micro-batch communicates."""
        return contextlib.nullcontext()

    def optimizer_step(self, step: int) -> None:
        """The optimizer (Mark.OPTIM), then the parameters' average when due (Mark.OPT)."""
        self.optim.step()
        self.opt.zero_grad(set_to_none=False)
        self.clock.mark(Mark.OPTIM)
        self.averaged = self.local.after_step(step)
        self.clock.mark(Mark.OPT)

    def sync_records(self, step: int, baseline: bool) -> None:
        """The average's `collective` event, and the parameters' digest when due (not timed)."""
        cfg, writer, rank = self.ctx.cfg, self.ctx.writer, self.ctx.rank
        averaged = None if baseline else self.averaged
        if averaged:
            writer.write("collective", rank=rank, step=step, **self.local.seconds(averaged, self.step_start))
        if not baseline and digest_due(step, cfg.sync.local_sgd, cfg.steps - 1):  # do the ranks agree?
            t0 = time.perf_counter()
            self.local.digest_event(writer, rank, step, averaged=averaged is not None)
            self.ctx.train_clock.exclude(time.perf_counter() - t0)
