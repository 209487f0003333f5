"""The two bases of the strategies a rank runs on the one training loop (dtlab.rank.loop): `DataParallel`, one whole
replica per rank (DDP, 'ps', local SGD: dtlab.rank.strategies.ddp and .ps), and `SplitStrategy`, a replica split
over its ranks or sharded ('tp', 'pp', 'fsdp2').

`DataParallel`: one replica per rank on its share of the global batch, trained with AdamW and its lr rule
(dtlab.rank.optim), with the injected straggler delay (`Straggler`, below), checkpoints (dtlab.rank.restarts),
evaluations between steps (dtlab.rank.evaluation), a bucket recorder whose no-op mode is the compute baseline
(dtlab.rank.recorder), and the machine's snapshots around the steps. A step runs `accumulate` micro-batches (only the
last one communicates) and marks (FWD, k) and (BWD, k) for each, so the loop sums the forwards; a subclass says how
the model is wrapped and what it records beside the buckets.

`Straggler`: the delay that `RunConfig.stragglers.slow` asks of this rank (dtlab.config.stragglers has the spec and
the rule). `DataParallel.step` calls `begin_step()` at the step start and `pause()` after the last forward, before
its backward, and writes the seconds slept as the step's `straggle_s`; `after_step` hands `observe(step,
compute_s)` the step's compute without the delay. On a rank that is not slowed every call costs nothing.

`SplitStrategy`: the replica (dtlab.rank.build) with this replica's batches, the DeviceMesh of a 2-D layout, the
data-parallel gradient average between replicas, the timed step, the bytes a rank holds, and the single-process
reference (dtlab.rank.reference) when the config asks for it. A 'tp' or 'pp' run of W ranks with dp_degree d is a
d x (W / d) mesh with dimensions ("dp", "tp") or ("dp", "pp"): rank r sits at dp coordinate r // (W / d), so the
ranks of one replica are consecutive. Every rank of a replica reads the same batch (the replica's share of the
global batch); 'fsdp2' is data parallel over all ranks.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import init_device_mesh

from dtlab.config.parallel import layout
from dtlab.config.stragglers import HISTORY_STEPS, parse_straggler, straggler_plan
from dtlab.rank.build import build_replica
from dtlab.rank.collectives import CommRecorder
from dtlab.rank.compression import Codec
from dtlab.rank.evaluation import Evaluator, eval_pause
from dtlab.rank.loop import Setup, Step, Strategy
from dtlab.rank.marks import rank_marks
from dtlab.rank.optim import Optimizer
from dtlab.rank.recorder import (
    BucketRecorder,
    Mark,
    StepClock,
    held_bytes,
    local_tensor,
    optimizer_state_bytes,
    recorder_facts,
    tensor_bytes,
)
from dtlab.rank.reference import Reference
from dtlab.rank.restarts import Checkpointer


class Straggler:
    """One rank's injected delay per step (s): fixed, or (FACTOR - 1) x the rank's own recent compute. `plan` is
    what config.json records of the whole run's stragglers (dtlab.config.stragglers.straggler_plan)."""

    def __init__(self, spec: str | None, rank: int, world: int):
        self.entry = parse_straggler(spec, world).get(rank) if spec else None
        self.plan = straggler_plan(spec, world)
        self._history: deque[float] = deque(maxlen=HISTORY_STEPS)
        self._t0 = 0.0

    @property
    def active(self) -> bool:
        """True when this rank is slowed."""
        return self.entry is not None

    def begin_step(self) -> None:
        """Mark the step start (wall clock, s): the FACTOR rule's fallback measures the forward from here."""
        if self.active:
            self._t0 = time.perf_counter()

    def delay_s(self, so_far_s: float) -> float:
        """The delay to inject now (s), given the seconds this step has run so far (its forward)."""
        if self.entry is None:
            return 0.0
        if self.entry.delay_ms is not None:
            return self.entry.delay_ms / 1e3
        compute = statistics.median(self._history) if self._history else 3.0 * so_far_s
        return (self.entry.factor - 1.0) * compute

    def pause(self, device=None) -> float:
        """Sleep this step's delay; returns the seconds actually slept (wall clock), 0.0 on other ranks. On a CUDA
        `device` the queued forward finishes first, so the GPU idles for the whole delay."""
        if self.entry is None:
            return 0.0
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        d = self.delay_s(t - self._t0)
        if d > 0:
            time.sleep(d)
        return time.perf_counter() - t if d > 0 else 0.0

    def observe(self, step: int, compute_s: float | None) -> None:
        """Remember this step's compute (s, the delay excluded) for the FACTOR rule; step 0 (allocation, DDP's
        first-iteration bucket) and steps without a measurement (None) are skipped."""
        if self.entry is not None and step >= 1 and compute_s is not None and compute_s > 0:
            self._history.append(float(compute_s))


def ddp_compute_s(buckets: list[dict], t_opt: float, straggle_s: float) -> float | None:
    """A DDP step's compute on this rank without the injected delay (s): until its last bucket was ready
    (forward + backward compute, every bucket being issued asynchronously) plus the optimizer, minus the
    delay. None when no bucket was recorded (no-op baseline steps)."""
    ready = [b["t_ready"] for b in buckets if b.get("t_ready") is not None]
    return max(ready) + t_opt - straggle_s if ready else None


class DataParallel(Strategy):
    """One replica per rank (see the module docstring). A subclass wraps the model (`wrap`), may reduce buckets
    its own way (`transport`), and adds its records before (`sync_records`) and after (`backend_records`) the
    buckets'."""

    noop_baseline = True
    machine_snapshots = True
    #: NCCL's own timing of each bucket's collective (backend_ms), read only where buckets are recorded
    nccl_timing = True

    def wrap(self, model, device):
        """The model the steps run (DDP, or the plain model)."""
        raise NotImplementedError

    def transport(self, device, backend):
        """How a divided bucket is reduced inside the recording hook; None: DDP's all-reduce."""
        return None

    def sync_records(self, step: int, baseline: bool) -> None:
        """Records of the step's own synchronisation, written before its buckets (local SGD's average)."""

    def backend_records(self, step: int, baseline: bool) -> None:
        """Records written after the step's buckets (DDP's own statistics)."""

    def setup(self) -> Setup:
        """Build the replica, wrap it, the recorder, optimizer and evaluator; the facts rank 0 records."""
        cfg, rank, world = self.ctx.cfg, self.ctx.rank, self.ctx.world
        self.straggler = Straggler(cfg.stragglers.slow, rank, world)
        rep = build_replica(
            self.ctx,
            shards=world,
            shard=rank,
            nccl_timing=bool(cfg.record and self.nccl_timing),
            heldout=rank == 0 and cfg.evaluation.every > 0,
        )
        device, backend = rep.device, rep.backend
        self.device, self.batches = device, rep.batches
        self.marks = rank_marks(device, backend)  # every clock of this rank: steps, buckets, local SGD's average
        self.model = model = rep.model.to(device)
        model.train()
        self.ddp = self.wrap(model, device)
        codec = None
        comp = cfg.compression
        if comp.hook != "none":
            codec = Codec(
                comp.hook, comp.powersgd_rank, comp.powersgd_start_iter, cfg.seed, serialize=backend == "gloo"
            )
        transport = self.transport(device, backend)
        self.recorder = BucketRecorder(world, self.marks, codec, transport)
        self.clock = StepClock(self.marks)
        recorded = recorder_facts(self.recorder)
        self.register_hook()
        self.optim = Optimizer(rep.lr, self.ddp.parameters(), cfg.optimizer_impl)  # AdamW, lr scaled, warmed up
        self.opt = self.optim.opt
        self.evaluator = Evaluator(
            cfg.evaluation,
            rep.tokenizer,
            rep.heldout,
            device,
            active=rank == 0,
            total_steps=cfg.steps,
            seq_len=cfg.seq_len,
        )
        facts = {
            **rep.facts,
            "straggler": self.straggler.plan,
            **recorded,
            **self.evaluator.facts,
            "lr_rule": rep.lr.rule,
        }
        return Setup(device, backend, facts, rep.facts)

    def register_hook(self) -> None:
        """Install the recording comm hook where the model has one (DDP)."""

    def before_steps(self) -> int:
        """Resume from a checkpoint when a group was restarted, evaluate before the first step; the first step."""
        ctx = self.ctx
        self.ckpt = Checkpointer(
            ctx.cfg.restarts, ctx.cfg.steps, ctx.run_dir, ctx.rank, ctx.world, self.device, ctx.writer
        )
        first = self.ckpt.resume(self.ddp, self.opt)  # 0, or where a group restarted by torchrun goes on
        self.optim.resume_at(first)
        if first == 0:
            eval_pause(self.evaluator, self.model, 0, ctx.train_clock, ctx.writer, ctx.rank)
        self.marks.seal()
        return first

    def step(self, step: int, paired: int | None) -> Step:
        """Training step `step`, or (`paired` set) the no-op hook baseline step on its paired step's batch."""
        cfg, baseline = self.ctx.cfg, paired is not None
        self.recorder.mode = "noop" if baseline else "allreduce"
        self.clock.mark(Mark.START)
        self.recorder.begin_step(self.clock.start)
        self.straggler.begin_step()
        out, slept = self._micro_batches(paired if baseline else step)  # a baseline: its step's batch again
        lr = self.optim.lr
        if not baseline:
            self.optimizer_step(step)
        self.step_start = self.clock.start
        t = self.clock.read()  # the step's one sync point on GPU
        fields = {"loss": float(out.loss.detach()), "micro_batches": cfg.ddp.accumulate, "straggle_s": slept, "lr": lr}
        return Step(t, fields)

    def _micro_batches(self, data_step: int):
        """Forward and backward of the step's micro-batches (only the last one communicates), the injected
        straggler delay before the last backward; returns (the last output, seconds slept)."""
        cfg, clock = self.ctx.cfg, self.clock
        slept = 0.0
        k_last = cfg.ddp.accumulate - 1
        for k in range(cfg.ddp.accumulate):
            batch = self.batches[(data_step * cfg.ddp.accumulate + k) % len(self.batches)]
            with self.accumulating(k < k_last):
                out = self.ddp(**batch)
                clock.mark(Mark.FWD, k)
                if k == k_last:  # every bucket this rank issues is late by the delay (see dtlab.config.stragglers)
                    slept = self.straggler.pause(self.device)
                # DDP's hook fires per bucket in the last backward, which returns once all buckets are reduced
                (out.loss / cfg.ddp.accumulate if cfg.ddp.accumulate > 1 else out.loss).backward()
                clock.mark(Mark.BWD, k)
        return out, slept

    def accumulating(self, no_sync: bool):
        """The context a micro-batch runs in (DDP: `no_sync` for all but the last)."""
        raise NotImplementedError

    def optimizer_step(self, step: int) -> None:
        """A training step's optimizer; marks Mark.OPT when the optimizer phase is over."""
        self.optim.step()
        self.opt.zero_grad(set_to_none=False)
        self.clock.mark(Mark.OPT)

    def after_step(self, step: int, paired: int | None, rec: dict) -> None:
        """The step's own records, its buckets, the straggler's observation; then (training) a checkpoint and an
        evaluation when due, or (baseline) this rank's own gradients dropped."""
        cfg, writer, rank, baseline = self.ctx.cfg, self.ctx.writer, self.ctx.rank, paired is not None
        self.sync_records(step, baseline)
        buckets = self.recorder.collect() if not baseline and cfg.record else []
        for b in buckets:
            writer.write("bucket", rank=rank, step=step, **b)
        self.straggler.observe(step, ddp_compute_s(buckets, rec["t_opt"], rec["straggle_s"]))
        self.backend_records(step, baseline)
        if baseline:
            self.opt.zero_grad(set_to_none=False)  # this rank's own gradients: never applied
            return
        self.ckpt.after_step(step, self.ddp, self.opt)  # every checkpoint_every training steps, after the records
        # rank 0 evaluates when due, every rank waits: no step clock runs meanwhile
        eval_pause(self.evaluator, self.model, step + 1, self.ctx.train_clock, writer, rank)

    def memory(self, final: bool) -> dict:
        """The replica's parameters, gradients and optimizer state."""
        params = list(self.model.parameters())
        return {
            "params_bytes": tensor_bytes(params),
            "grads_bytes": tensor_bytes(p.grad for p in params),
            "opt_bytes": optimizer_state_bytes(self.opt),
        }

    def finish(self) -> None:
        """The transport's thread stops."""
        self.recorder.transport.close()


@dataclass
class SplitReplica:
    """What `split_replica` made: device, backend, the model (unparallelised yet), this replica's batches, the
    reference (or None), the mesh (or None), this rank's dp coordinate and the run's degrees, the facts for
    config.json."""

    device: object
    backend: str
    model: object
    batches: list
    reference: object
    mesh: object
    dp_rank: int
    degrees: dict
    facts: dict


def split_replica(ctx) -> SplitReplica:
    """The replica of rank `ctx.rank` (dtlab.rank.build: process group, model, this replica's batches), the mesh and
    the reference."""
    cfg, rank, world = ctx.cfg, ctx.rank, ctx.world
    deg = layout(cfg)
    dp = deg["dp"]
    dp_rank = rank // (world // dp)
    rep = build_replica(ctx, shards=dp, shard=dp_rank, every_shard=cfg.checks.reference)
    spec_axis = "tp" if deg["tp"] > 1 else "pp" if deg["pp"] > 1 else None
    mesh = None
    if spec_axis is not None:
        mesh = init_device_mesh(rep.device.type, (dp, deg[spec_axis]), mesh_dim_names=("dp", spec_axis))
    ref = Reference(copy.deepcopy(rep.model), rep.every_shard, cfg.lr, rep.device) if cfg.checks.reference else None
    config = rep.model.config
    facts = {
        **rep.facts,
        "layout": deg,
        "n_layers": int(config.n_layers),
        "hidden": int(config.dim),
        "n_heads": int(config.n_heads),
        "ffn_hidden": int(config.hidden_dim),
        "global_batch": cfg.batch_size * dp,
        "dropout": cfg.dropout,
    }
    return SplitReplica(rep.device, rep.backend, rep.model, rep.batches, ref, mesh, dp_rank, deg, facts)


def dp_sync(params, mesh, recorder) -> None:
    """Average the gradients of `params` over the mesh's "dp" dimension: one all-reduce (sum) of every local
    gradient flattened into one buffer, then / dp. A no-op with one replica."""
    if mesh is None or mesh.size(0) == 1:
        return
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    group, n = mesh.get_group("dp"), mesh.size(0)
    recorder.record_call(
        "all_reduce", flat.numel() * flat.element_size(), "dp", n, lambda: dist.all_reduce(flat, group=group)
    )
    flat.div_(n)
    with torch.no_grad():
        for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(new)


def check_reference(ref, step: int, named_params, writer, rank: int, loss) -> None:
    """Train the reference one step on the global batch and write how this rank's gradients compare; then wait
    for every rank (the reference's time must not land in the next step as a wait for this one)."""
    t0 = time.perf_counter()
    rec = ref.step_and_compare(step, named_params)
    writer.write("reference", rank=rank, step=step, loss=loss, seconds=time.perf_counter() - t0, **rec)
    dist.barrier()


class SplitStrategy(Strategy):
    """What 'tp', 'pp' and 'fsdp2' share on the one loop (dtlab.rank.loop): the replica and mesh (`split_replica`), the
    rank's marks and collective recorder, the timed step (`timed_step`), the comparison with the one-process
    reference after each step, and the local shards' memory. A subclass splits the model (`split`), runs a step's
    forward and backward (`compute`) and names its step event's fields (`step_fields`)."""

    #: every rank meets at a barrier before the step's clock starts (the pipeline's stages start together)
    align = False

    def split(self, replica: SplitReplica) -> dict:
        """Wrap or split `replica.model`; set `self.model`, `self.params`, `self.opt` and `self.mesh` (the mesh whose
        "dp" dimension averages gradients, or None); prepare the marks' streams. Returns the facts rank 0 adds to
        config.json besides the replica's."""
        raise NotImplementedError

    def ready_fields(self) -> dict:
        """Fields of the ready event besides the replica's facts."""
        return {}

    def named(self):
        """The (name, parameter) pairs of this rank the reference compares, named as in the model."""
        return self.model.named_parameters()

    def compute(self, batch):
        """Forward and backward of one step (marks "fwd" or its own marks on `self.clock`)."""
        raise NotImplementedError

    def step_fields(self, step: int, t: dict, out) -> Step:
        """The step's marks and event fields from what `compute` returned."""
        raise NotImplementedError

    def setup(self) -> Setup:
        """Build the replica, its marks and recorder, and split it."""
        ctx = self.ctx
        replica = self.replica = split_replica(ctx)
        self.marks = rank_marks(replica.device, replica.backend)
        self.rec = CommRecorder(ctx.writer, ctx.rank, self.marks)
        facts = self.split(replica)
        resolved = {**replica.facts, **facts, "timing_method": self.marks.facts()}
        ready = {**self.ready_fields(), **{k: v for k, v in replica.facts.items() if k != "param_nbytes"}}
        return Setup(replica.device, replica.backend, resolved, ready)

    def before_steps(self) -> int:
        """The step clock; no stream is made after this."""
        self.clock = StepClock(self.marks)
        self.marks.seal()
        return 0

    def step(self, step: int, paired: int | None) -> Step:
        """One timed step on this replica's batch (see `timed_step`)."""
        replica = self.replica
        batch = replica.batches[step % len(replica.batches)]
        t, t_blocked, out = timed_step(
            step, self.clock, self.rec, self.opt, self.compute, batch, self.params, self.mesh, align=self.align
        )
        taken = self.step_fields(step, t, out)
        taken.fields["t_blocked"] = t_blocked
        return taken

    def after_step(self, step: int, paired: int | None, rec: dict) -> None:
        """The comparison with the one-process reference run, when there is one."""
        if self.replica.reference is not None:
            check_reference(self.replica.reference, step, self.named(), self.ctx.writer, self.ctx.rank, rec["loss"])

    def memory(self, final: bool) -> dict:
        """This rank's local shards (after step 0: once the optimizer state exists)."""
        return held_bytes(self.params, self.opt)


def timed_step(step: int, clock, rec, opt, compute, batch, params, mesh=None, align: bool = False):
    """One timed step of a split strategy (tp, pp, fsdp2); returns (the clock's marks, time blocked, what `compute`
    returned). The gradients are zeroed before the clock starts (the reference compares them after the step);
    with `align`, every rank meets at a barrier first, so that the step starts together on every stage.
    `compute(batch)` runs forward and backward and marks "fwd" (or its own marks) on `clock`; then come the
    replicas' gradient average over the mesh's "dp" dimension (`dp_sync`; nothing without a mesh), the mark "bwd",
    the optimizer and the mark "opt". The clock is read once (on GPU, the step's one sync point) before the
    recorder's marks are."""
    opt.zero_grad(set_to_none=True)
    if align:
        dist.barrier()
    clock.mark(Mark.START)
    rec.begin(step, clock.start)
    out = compute(batch)
    rec.phase = "backward"
    dp_sync(params, mesh, rec)
    clock.mark(Mark.BWD)
    rec.phase = "optimizer"
    opt.step()
    clock.mark(Mark.OPT)
    t = clock.read()
    return t, rec.flush(), out
