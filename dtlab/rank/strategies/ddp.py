"""Strategy 'ddp': DistributedDataParallel with a recording comm hook, one rank per process. The same loop runs
local SGD (`local_sgd`: a plain model per rank, dtlab.rank.local_sgd) and evaluates between steps (`eval_every`,
dtlab.rank.evaluation)."""

from __future__ import annotations

import contextlib
import inspect
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dtlab.config.baseline import run_order
from dtlab.config.busy import snapshot
from dtlab.config.convergence import lr_rule_text
from dtlab.config.run import RunConfig
from dtlab.config.stragglers import straggler_plan
from dtlab.rank.build import build_replica
from dtlab.rank.compression import Codec
from dtlab.rank.evaluation import Evaluator, TrainClock, eval_pause
from dtlab.rank.lifecycle import maybe_inject_fault, record_resolved
from dtlab.rank.local_sgd import LocalSGD, digest_due
from dtlab.rank.marks import rank_marks
from dtlab.rank.optim import Optimizer
from dtlab.rank.profiling import StepProfiler
from dtlab.rank.recorder import (
    BucketRecorder,
    StepClock,
    optimizer_state_bytes,
    peak_memory,
    recorder_facts,
    tensor_bytes,
)
from dtlab.rank.restarts import Checkpointer
from dtlab.rank.stragglers import Straggler, ddp_compute_s


def train(cfg: RunConfig, run_dir: str, rank: int, world: int, writer, make_transport=None) -> None:
    """The DDP training loop. `make_transport(world, device, backend)`, when given, builds how each divided
    bucket is reduced inside the recording hook (strategy 'ps': reduce to rank 0 + broadcast); None keeps
    DDP's all-reduce."""
    run = DDPRun(cfg, run_dir, rank, world, writer, make_transport)
    # how busy the machine is while the steps run (dtlab.config.busy): this rank's CPU time, rank 0 the machine's
    writer.write("machine", rank=rank, phase="start", **snapshot(machine=rank == 0))
    order = run_order(cfg.steps, cfg.warmup, cfg.baseline_steps, run.first)
    profiler = StepProfiler(cfg, run_dir, rank, run.device, order)
    for step, paired in run_order(cfg.steps, cfg.warmup, cfg.baseline_steps, run.first):
        profiler.begin(step, paired)  # cfg.profile: one ProfilerStep per step (dtlab.rank.profiling)
        maybe_inject_fault(rank, step)
        run.step(step, paired)
    profiler.finish()
    writer.write("machine", rank=rank, phase="end", **snapshot(machine=rank == 0))
    run.finish()


class DDPRun:
    """One rank's DDP run (or local SGD's plain models): built, recorded as ready and resumed by the constructor,
    then `step(step, paired)` for every entry of the run order, then `finish()`."""

    def __init__(self, cfg: RunConfig, run_dir: str, rank: int, world: int, writer, make_transport=None):
        self.cfg, self.rank, self.world, self.writer = cfg, rank, world, writer
        # NCCL's own timing of each bucket's collective (backend_ms) is read only when buckets are recorded
        rep = build_replica(
            cfg, rank, world, shards=world, shard=rank, nccl_timing=bool(cfg.record and not cfg.sync.local_sgd)
        )
        device, backend = rep.device, rep.backend
        self.device, self.batches = device, rep.batches
        self.marks = rank_marks(device, backend)  # every clock of this rank: steps, buckets, local SGD's average
        self.straggler = Straggler(cfg.straggler, rank, world, device)
        self.model = model = rep.model.to(device)
        model.train()
        # local SGD: a plain model per rank, its parameters averaged every H steps (dtlab.rank.local_sgd)
        self.local = LocalSGD(model, cfg.sync.local_sgd, world, device, self.marks) if cfg.sync.local_sgd else None
        self.ddp = model if self.local else _wrap(model, device, cfg.bucket_mb)
        codec = None
        comp = cfg.compression
        if comp.hook != "none":
            codec = Codec(
                comp.hook, comp.powersgd_rank, comp.powersgd_start_iter, cfg.seed, serialize=backend == "gloo"
            )
        transport = make_transport(world, device, backend) if make_transport is not None else None
        self.recorder = BucketRecorder(world, device, codec, transport, backend=backend, marks=self.marks)
        if (cfg.record or cfg.baseline_steps) and not self.local:  # the baseline needs the hook to switch to no-op
            self.ddp.register_comm_hook(None, self.recorder.hook)
        self.optim = Optimizer(cfg, self.ddp.parameters())  # AdamW, lr scaled and warmed up (config.convergence)
        self.opt = self.optim.opt
        self.evaluator = Evaluator(cfg, rep.tokenizer, rep.facts["data_source"], device, active=rank == 0)
        if rank == 0:
            facts = {
                **rep.facts,
                "straggler": straggler_plan(cfg.straggler, world),
                **recorder_facts(self.recorder),
                **self.evaluator.facts,
                "lr_rule": lr_rule_text(cfg),
            }
            record_resolved(run_dir, cfg, backend, device, facts, world)
        writer.write("ready", rank=rank, time=time.time(), **rep.facts)
        self.ckpt = Checkpointer(cfg, run_dir, rank, world, device, writer)
        self.first = self.ckpt.resume(self.ddp, self.opt)  # 0, or where a group restarted by torchrun goes on
        self.optim.resume_at(self.first)
        self.train_clock = TrainClock()  # training time for the evaluations: evaluations excluded
        if self.first == 0:
            eval_pause(self.evaluator, model, 0, self.train_clock, writer, rank)
        self.clock = StepClock(device, self.marks)
        self.marks.seal()
        self.ddp_forwards: list[int | None] = []  # per synchronised DDP forward: its training step (None: baseline)
        self.optim_s = 0.0  # the last training step's optimizer time: a baseline step's t_opt (see `_times`)

    def step(self, step: int, paired: int | None) -> None:
        """Training step `step`, or (`paired` set) a no-op hook baseline step right after the training step it is
        paired with: its records, then what follows a step (checkpoint, evaluation, memory)."""
        cfg, baseline = self.cfg, paired is not None
        self.recorder.mode = "noop" if baseline else "allreduce"
        if baseline:
            t_baseline = time.perf_counter()  # not training time: left out of the evaluations' clock
            rng = rng_state(self.device)  # dropout draws from it: given back after the step
        else:
            self.train_clock.start()
        self.clock.mark("start")
        self.recorder.begin_step(self.clock.start)
        self.straggler.begin_step()
        out, slept = self._micro_batches(paired if baseline else step)  # a baseline: its step's batch again
        lr = self.optim.lr
        averaged = None if baseline else self._optimizer_step(step)
        step_start = self.clock.start
        t = self.clock.read()  # the step's one sync point on GPU
        rec = {
            "rank": self.rank,
            "step": step,
            **self._times(t, baseline),
            "loss": float(out.loss.detach()),
            "micro_batches": cfg.accumulate,
            "straggle_s": slept,
            "lr": lr,
            "time": time.time(),
        }
        if baseline:
            rec["paired_step"] = paired
        self.writer.write("baseline_step" if baseline else "step", **rec)
        self._after_records(step, baseline, averaged, step_start, rec["t_opt"], slept)
        if baseline:
            self.opt.zero_grad(set_to_none=False)  # this rank's own gradients: never applied
            set_rng_state(self.device, rng)
            if self.world > 1:  # no collective aligned the ranks in this step: start the next training step together
                barrier(self.device)
            self.train_clock.exclude(time.perf_counter() - t_baseline)
            return
        self._after_training_step(step)

    def _micro_batches(self, data_step: int):
        """Forward and backward of the step's micro-batches (only the last one communicates), the injected
        straggler delay before the last backward; returns (the last output, seconds slept)."""
        cfg, ddp, clock = self.cfg, self.ddp, self.clock
        slept = 0.0
        k_last = cfg.accumulate - 1
        for k in range(cfg.accumulate):
            batch = self.batches[(data_step * cfg.accumulate + k) % len(self.batches)]
            with ddp.no_sync() if k < k_last and not self.local else contextlib.nullcontext():
                out = ddp(**batch)
                clock.mark(f"fwd{k}")
                if k == k_last:  # every bucket this rank issues is late by the delay (see dtlab.config.stragglers)
                    slept = self.straggler.pause()
                # DDP's hook fires per bucket in the last backward, which returns once all buckets are reduced
                (out.loss / cfg.accumulate if cfg.accumulate > 1 else out.loss).backward()
                clock.mark(f"bwd{k}")
        return out, slept

    def _optimizer_step(self, step: int):
        """A training step's optimizer (and local SGD's average, inside the step as t_opt); returns the average's
        record, or None."""
        self.optim.step()
        self.opt.zero_grad(set_to_none=False)
        if self.local:
            self.clock.mark("optim")
        averaged = self.local.after_step(step) if self.local else None
        self.clock.mark("opt")
        return averaged

    def _times(self, t: dict, baseline: bool) -> dict:
        """The step's t_fwd, t_bwd, t_opt and t_step from the clock's marks."""
        k_last = self.cfg.accumulate - 1
        t_fwd = sum(t[f"fwd{k}"] - (t[f"bwd{k - 1}"] if k else 0.0) for k in range(self.cfg.accumulate))
        t_bwd_end = t[f"bwd{k_last}"]
        if baseline:
            # A baseline step does not step the optimizer: the model, the optimizer's state and the schedule stay
            # those of the training steps. Its optimizer time is the one its paired training step measured just
            # before (the optimizer communicates nothing), so its t_step is forward + backward + that time.
            t_opt, t_step = self.optim_s, t_bwd_end + self.optim_s
        else:
            t_opt, t_step = t["opt"] - t_bwd_end, t["opt"]
            self.optim_s = (t["optim"] if self.local else t["opt"]) - t_bwd_end
        return {"t_fwd": t_fwd, "t_bwd": t_bwd_end - t_fwd, "t_opt": t_opt, "t_step": t_step}

    def _after_records(self, step: int, baseline: bool, averaged, step_start, t_opt: float, slept: float) -> None:
        """The records that follow a step's: local SGD's average and digest, the buckets, DDP's own stats."""
        cfg, local, writer, rank = self.cfg, self.local, self.writer, self.rank
        if averaged:
            writer.write("collective", rank=rank, step=step, **local.seconds(averaged, step_start))
        if local and not baseline and digest_due(step, cfg.sync.local_sgd, cfg.steps - 1):  # ranks agree? (not timed)
            t0 = time.perf_counter()
            local.digest_event(writer, rank, step, averaged=averaged is not None)
            self.train_clock.exclude(time.perf_counter() - t0)
        buckets = self.recorder.collect() if not baseline and cfg.record else []
        for b in buckets:
            writer.write("bucket", rank=rank, step=step, **b)
        self.straggler.observe(step, ddp_compute_s(buckets, t_opt, slept))
        if not local:
            # DDP logs a forward's runtime stats in the next synchronised forward (these are the previous one's),
            # and only for its sampled iterations (<= 10 and every 100th): skip the logging-data call on the others.
            self.ddp_forwards.append(None if baseline else step)
            done = len(self.ddp_forwards) - 1  # DDP's count of finished iterations when this forward logged
            if done >= 1 and (done <= 10 or done % 100 == 0) and self.ddp_forwards[done - 1] is not None:
                _write_ddp_stats(self.ddp, writer, rank, self.ddp_forwards[done - 1], done)

    def _after_training_step(self, step: int) -> None:
        """A checkpoint when due, the evaluation when due, and after step 0 the memory this rank holds."""
        self.ckpt.after_step(step, self.ddp, self.opt)  # every checkpoint_every training steps, after the records
        # rank 0 evaluates when due, every rank waits: no step clock runs meanwhile
        eval_pause(self.evaluator, self.model, step + 1, self.train_clock, self.writer, self.rank)
        if step == 0:
            self._write_memory(None, None)

    def _write_memory(self, peak, kind) -> None:
        model = self.model
        self.writer.write(
            "memory",
            rank=self.rank,
            params_bytes=tensor_bytes(model.parameters()),
            grads_bytes=tensor_bytes(p.grad for p in model.parameters()),
            opt_bytes=optimizer_state_bytes(self.opt),
            peak_bytes=peak,
            peak_kind=kind,
        )

    def finish(self) -> None:
        """After the last step: the transport's thread stops, the memory with its peak, DDP's own view."""
        self.recorder.transport.close()
        self._write_memory(*peak_memory(self.device))
        if self.local:
            return
        try:  # DDP's own view (bucket sizes, comm hook, ...), a free cross-check
            data = self.ddp._get_ddp_logging_data()
            self.writer.write(
                "ddp_logging",
                rank=self.rank,
                data={k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in data.items()},
            )
        except Exception as e:  # noqa: BLE001 - private API, may change between torch versions
            self.writer.write("ddp_logging", rank=self.rank, data={"error": repr(e)})


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


def rng_state(device) -> dict:
    """The random number generators a step draws from (dropout): the CPU's, and the GPU's on CUDA."""
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(device, state: dict) -> None:
    """Give back what `rng_state` took: a baseline step leaves the training steps' dropout masks as they were."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def barrier(device) -> None:
    """Every rank waits for the others (not timed); NCCL is told which GPU this rank uses."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


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
