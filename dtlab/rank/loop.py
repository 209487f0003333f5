"""The one training loop of a rank, and the strategy protocol it drives.

A strategy (ddp, ps, local SGD, zero3, fsdp2, tp, pp, async) is an object that builds its model, states its
facts, takes one step and records what is particular to it (`Strategy`). Everything that is the same for every
strategy happens here, once:

- `ready`: rank 0 adds the strategy's facts to config.json (`record_resolved`), then every rank writes its
  `ready` event;
- the run order: the training steps, and for a strategy with a no-op mode (`Strategy.noop_baseline`: DDP's
  recording hook minus the collective) the baseline steps interleaved with them (dtlab.config.baseline). A
  baseline step reruns its paired training step's batch without the optimizer; the loop gives the random
  number generators back afterwards, aligns the ranks and leaves the step out of the training clock;
- per step: the profiler (`profile=True`), the fault drills (`maybe_inject_fault`), the step, and its `step`
  (or `baseline_step`) event, whose times are derived from the clock's marks in one place (`step_times`);
- after the step, the strategy's own records (collectives, buckets, checkpoints, evaluations), and after the
  first training step the memory the rank holds; after the last, the memory with its peak;
- the machine's snapshots around the steps, for the strategies that record them (dtlab.config.busy).

So a measurement every strategy should record is one edit: a field of `write_step` (see docs/layout.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dtlab.config.baseline import run_order
from dtlab.config.busy import snapshot
from dtlab.config.placement import Placement
from dtlab.config.run import RunConfig
from dtlab.config.strategies import StrategySpec
from dtlab.rank.evaluation import TrainClock
from dtlab.rank.lifecycle import maybe_inject_fault, record_resolved
from dtlab.rank.profiling import StepProfiler
from dtlab.rank.recorder import Mark, peak_memory


@dataclass
class RankContext:
    """Where a strategy runs: the run's config and directory, this rank, the world size, the event writer, the
    placement and the strategy's spec, both resolved once at the rank's entry (dtlab.config.placement.Placement:
    backend, device, GPU sharing; dtlab.config.strategies.StrategySpec), and the rank's training time (evaluations
    and baseline steps left out; dtlab.rank.evaluation)."""

    cfg: RunConfig
    run_dir: str
    rank: int
    world: int
    writer: object
    placed: Placement
    spec: StrategySpec
    train_clock: TrainClock = field(default_factory=TrainClock)


@dataclass
class Setup:
    """What a strategy states once built: where it runs, the facts rank 0 adds to config.json (`resolved`), and
    the fields of this rank's `ready` event."""

    device: torch.device
    backend: str
    resolved: dict
    ready: dict


@dataclass
class Step:
    """What one step returns to the loop: the clock's marks in seconds from the step start (`t`, keyed by
    dtlab.rank.recorder.Mark: FWD ends forward unless `t_fwd` says otherwise, BWD backward, OPT the optimizer phase,
    OPTIM the optimizer itself where more work follows it in that phase; micro-batch k marks (FWD, k) and (BWD, k),
    see `step_times`), and the step event's own fields (loss and the strategy's extras)."""

    t: dict
    fields: dict
    t_fwd: float | None = None


class Strategy:
    """The protocol a strategy follows (subclass it; `run` drives it). Declarations, set by a subclass:

    - `noop_baseline`: the strategy has a no-op (compute-only) mode for the baseline steps; its `step` is then
      called with `paired` set for them and runs that mode, without the optimizer;
    - `machine_snapshots`: record the machine's CPU counters around the steps (read by dtlab.results.busy);
    - `inject_faults`: the fault drills may fire at a step (every rank of the group meets at a barrier there)."""

    noop_baseline = False
    machine_snapshots = False
    inject_faults = True

    def __init__(self, ctx: RankContext):
        self.ctx = ctx

    @classmethod
    def for_rank(cls, ctx: RankContext) -> Strategy:
        """The strategy object rank `ctx.rank` runs: this class's, unless a subclass picks another for the rank or
        the config (the asynchronous server on rank 0, local SGD under 'ddp')."""
        return cls(ctx)

    def setup(self) -> Setup:
        """Build the model (process group, wrapping or splitting, optimizer) and state the facts."""
        raise NotImplementedError

    def before_steps(self) -> int:
        """After `ready`, before the steps (resume from a checkpoint, the first evaluation, seal the marks);
        returns the first training step."""
        return 0

    def order(self, first: int) -> list[tuple[int, int | None]]:
        """The steps this rank runs: (step, None) for a training step, (step, paired step) for a baseline step."""
        cfg = self.ctx.cfg
        baseline = cfg.measurement.baseline_steps if self.noop_baseline else 0
        return run_order(cfg.steps, cfg.warmup, baseline, first)

    def step(self, step: int, paired: int | None) -> Step:
        """Take training step `step`, or (`paired` set) the no-op baseline step paired with that training step."""
        raise NotImplementedError

    def after_step(self, step: int, paired: int | None, rec: dict) -> None:
        """The records that follow the step's event `rec` (collectives, buckets, checkpoints, evaluations)."""

    def after_steps(self) -> None:
        """After the last step (a rank that takes no steps of its own does its work here)."""

    def memory(self, final: bool) -> dict | None:
        """params_bytes, grads_bytes and opt_bytes this rank holds, after the first training step (`final`
        False) and after the last (True); None: no memory event then."""
        return None

    def finish(self) -> None:
        """End-of-run records and cleanup, after the final memory."""


def step_times(t: dict, t_fwd: float | None = None, optimizer_s: float | None = None) -> dict:
    """A step event's times from the clock's marks (seconds from the step start): forward until Mark.FWD (or
    `t_fwd`; with micro-batches, marks (FWD, 0), (BWD, 0), (FWD, 1), ..., every micro-batch's forward summed),
    backward from there until Mark.BWD (or the last micro-batch's), the optimizer until Mark.OPT. A baseline step
    (`optimizer_s` set) steps no optimizer: the model, its optimizer state and the schedule stay those of the
    training steps, so its optimizer time is the one its paired training step measured just before (the optimizer
    communicates nothing), and its t_step is forward + backward + that time."""
    fwd, bwd_end = _forward_s(t, t_fwd), backward_end(t)
    if optimizer_s is not None:
        return {"t_fwd": fwd, "t_bwd": bwd_end - fwd, "t_opt": optimizer_s, "t_step": bwd_end + optimizer_s}
    return {"t_fwd": fwd, "t_bwd": bwd_end - fwd, "t_opt": t[Mark.OPT] - bwd_end, "t_step": t[Mark.OPT]}


def _micro_batches(t: dict) -> int:
    return sum(1 for k in t if isinstance(k, tuple) and k[0] is Mark.FWD)


def backward_end(t: dict) -> float:
    """When backward ended: Mark.BWD, or the last micro-batch's (BWD, k)."""
    if Mark.BWD in t:
        return t[Mark.BWD]
    return t[(Mark.BWD, _micro_batches(t) - 1)]


def _forward_s(t: dict, t_fwd: float | None) -> float:
    if t_fwd is not None:
        return t_fwd
    if Mark.FWD in t:
        return t[Mark.FWD]
    return sum(t[(Mark.FWD, k)] - (t[(Mark.BWD, k - 1)] if k else 0.0) for k in range(_micro_batches(t)))


class Loop:
    """What `run` does at each step for every strategy, and its state across steps: the last training step's
    optimizer time (a baseline step's t_opt)."""

    def __init__(self, strategy: Strategy, device):
        self.s, self.ctx, self.device = strategy, strategy.ctx, device
        self.optimizer_s = 0.0

    def write_step(self, step: int, paired: int | None, taken: Step) -> dict:
        """The step's event: `step` for a training step, `baseline_step` for a baseline step (with the training
        step it is paired with). Every strategy's step events are written here."""
        t = taken.t
        baseline = paired is not None
        if not baseline:
            self.optimizer_s = t.get(Mark.OPTIM, t[Mark.OPT]) - backward_end(t)
        times = step_times(t, taken.t_fwd, self.optimizer_s if baseline else None)
        rec = {"rank": self.ctx.rank, "step": step, **times, **taken.fields, "time": time.time()}
        if baseline:
            rec["paired_step"] = paired
        self.ctx.writer.write("baseline_step" if baseline else "step", **rec)
        return rec

    def one(self, step: int, paired: int | None) -> None:
        """One entry of the run order: the step, its event, the records after it."""
        ctx, s = self.ctx, self.s
        baseline = paired is not None
        if baseline:
            t0 = time.perf_counter()  # not training time: left out of the training clock
            rng = rng_state(self.device)  # dropout draws from it: given back after the step
        else:
            ctx.train_clock.start()
        taken = s.step(step, paired)
        rec = self.write_step(step, paired, taken)
        s.after_step(step, paired, rec)
        if baseline:
            set_rng_state(self.device, rng)
            if ctx.world > 1:  # no collective aligned the ranks in this step: start the next training step together
                barrier(self.device)
            ctx.train_clock.exclude(time.perf_counter() - t0)
        elif step == 0:
            self.write_memory(False)

    def write_memory(self, final: bool) -> None:
        """The memory this rank holds (the strategy's bytes), with the peak after the last step."""
        held = self.s.memory(final)
        if held is None:
            return
        peak, kind = peak_memory(self.device) if final else (None, None)
        self.ctx.writer.write("memory", rank=self.ctx.rank, **held, peak_bytes=peak, peak_kind=kind)

    def snapshot(self, phase: str) -> None:
        """How busy the machine is while the steps run (dtlab.config.busy): this rank's CPU time, rank 0 the
        machine's."""
        if self.s.machine_snapshots:
            rank = self.ctx.rank
            self.ctx.writer.write("machine", rank=rank, phase=phase, **snapshot(machine=rank == 0))


def run(strategy: Strategy) -> None:
    """Drive `strategy` through one rank's run: setup and `ready`, the steps, the records after them."""
    ctx = strategy.ctx
    setup = strategy.setup()
    if ctx.rank == 0:
        record_resolved(ctx.run_dir, ctx.cfg, ctx.placed, setup.device, setup.resolved, ctx.world)
    ctx.writer.write("ready", rank=ctx.rank, time=time.time(), **setup.ready)
    first = strategy.before_steps()
    loop = Loop(strategy, setup.device)
    loop.snapshot("start")
    order = strategy.order(first)
    profiler = StepProfiler(ctx.cfg.measurement.profile, ctx.cfg.warmup, ctx.run_dir, ctx.rank, setup.device, order)
    for step, paired in order:
        profiler.begin(step, paired)  # cfg.measurement.profile: one ProfilerStep per step (dtlab.rank.profiling)
        if strategy.inject_faults:
            maybe_inject_fault(ctx.rank, step)
        loop.one(step, paired)
    profiler.finish()
    strategy.after_steps()
    loop.snapshot("end")
    loop.write_memory(True)
    strategy.finish()


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
