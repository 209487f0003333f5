"""What the strategies beyond data parallelism ('tp', 'pp', 'fsdp2') share inside a rank: the replica
(dtlab.rank.build) with this replica's batches, the DeviceMesh of a 2-D layout, the data-parallel gradient average
between replicas, the timed step, the bytes a rank holds, and the single-process reference (dtlab.rank.reference)
when the config asks for it: `SplitStrategy`, the part of the three strategies the one loop (dtlab.rank.loop)
drives.

A 'tp' or 'pp' run of W ranks with dp_degree d is a d x (W / d) mesh with dimensions ("dp", "tp") or ("dp",
"pp"): rank r sits at dp coordinate r // (W / d), so the ranks of one replica are consecutive. Every rank of a
replica reads the same batch (the replica's share of the global batch); 'fsdp2' is data parallel over all ranks.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dtlab.config.parallel import layout
from dtlab.config.run import RunConfig
from dtlab.rank.build import build_replica
from dtlab.rank.collectives import CommRecorder
from dtlab.rank.loop import Setup, Step, Strategy
from dtlab.rank.marks import rank_marks
from dtlab.rank.recorder import Mark, StepClock
from dtlab.rank.reference import Reference


@dataclass
class Built:
    """What `build` made: device, backend, the model (unparallelised yet), this replica's batches, the
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


def build(cfg: RunConfig, run_dir: str, rank: int, world: int) -> Built:
    """The replica (dtlab.rank.build: process group, model, this replica's batches), the mesh and the reference."""
    deg = layout(cfg)
    dp = deg["dp"]
    dp_rank = rank // (world // dp)
    rep = build_replica(cfg, rank, world, shards=dp, shard=dp_rank, every_shard=cfg.checks.reference)
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
    return Built(rep.device, rep.backend, rep.model, rep.batches, ref, mesh, dp_rank, deg, facts)


def dp_sync(params, mesh, recorder) -> None:
    """Average the gradients of `params` over the mesh's "dp" dimension: one all-reduce (sum) of every local
    gradient flattened into one buffer, then / dp. A no-op with one replica."""
    if mesh is None or mesh.size(0) == 1:
        return
    grads = [_local(p.grad) for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    group, n = mesh.get_group("dp"), mesh.size(0)
    recorder.record_call(
        "all_reduce", flat.numel() * flat.element_size(), "dp", n, lambda: dist.all_reduce(flat, group=group)
    )
    flat.div_(n)
    with torch.no_grad():
        for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(new)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard; None skipped)."""
    return int(sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None))


def held_bytes(params, opt) -> dict:
    """What this rank holds: its parameters, gradients and optimizer state (local shards)."""
    params = list(params)
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return {
        "params_bytes": local_bytes(params),
        "grads_bytes": local_bytes(p.grad for p in params),
        "opt_bytes": local_bytes(state),
    }


def check_reference(ref, step: int, named_params, writer, rank: int, loss) -> None:
    """Train the reference one step on the global batch and write how this rank's gradients compare; then wait
    for every rank (the reference's time must not land in the next step as a wait for this one)."""
    t0 = time.perf_counter()
    rec = ref.step_and_compare(step, named_params)
    writer.write("reference", rank=rank, step=step, loss=loss, seconds=time.perf_counter() - t0, **rec)
    dist.barrier()


class SplitStrategy(Strategy):
    """What 'tp', 'pp' and 'fsdp2' share on the one loop (dtlab.rank.loop): the replica and mesh (`build`), the
    rank's marks and collective recorder, the timed step (`timed_step`), the comparison with the one-process
    reference after each step, and the local shards' memory. A subclass splits the model (`split`), runs a step's
    forward and backward (`compute`) and names its step event's fields (`step_fields`)."""

    #: every rank meets at a barrier before the step's clock starts (the pipeline's stages start together)
    align = False

    def split(self, b: Built) -> dict:
        """Wrap or split `b.model`; set `self.model`, `self.params`, `self.opt` and `self.mesh` (the mesh whose "dp"
        dimension averages gradients, or None); prepare the marks' streams. Returns the facts rank 0 adds to
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
        b = self.b = build(ctx.cfg, ctx.run_dir, ctx.rank, ctx.world)
        self.marks = rank_marks(b.device, b.backend)
        self.rec = CommRecorder(ctx.writer, ctx.rank, self.marks)
        facts = self.split(b)
        resolved = {**b.facts, **facts, "timing_method": self.marks.facts()}
        ready = {**self.ready_fields(), **{k: v for k, v in b.facts.items() if k != "param_nbytes"}}
        return Setup(b.device, b.backend, resolved, ready)

    def start(self) -> int:
        """The step clock; no stream is made after this."""
        self.clock = StepClock(self.b.device, self.marks)
        self.marks.seal()
        return 0

    def step(self, step: int, paired: int | None) -> Step:
        """One timed step on this replica's batch (see `timed_step`)."""
        b = self.b
        batch = b.batches[step % len(b.batches)]
        t, t_blocked, out = timed_step(
            step, self.clock, self.rec, self.opt, self.compute, batch, self.params, self.mesh, align=self.align
        )
        taken = self.step_fields(step, t, out)
        taken.fields["t_blocked"] = t_blocked
        return taken

    def after_step(self, step: int, paired: int | None, rec: dict) -> None:
        """The comparison with the one-process reference run, when there is one."""
        if self.b.reference is not None:
            check_reference(self.b.reference, step, self.named(), self.ctx.writer, self.ctx.rank, rec["loss"])

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
