"""Strategy 'fsdp2': PyTorch's own ZeRO-3, `torch.distributed.fsdp.fully_shard`, beside DeepSpeed's ('zero3').

Every transformer block is one FSDP unit and the root (embeddings, head) another, on a 1-D mesh over all ranks:
each rank holds 1/p of every parameter (a DTensor sharded on dim 0, padded to a multiple of p rows), its
gradient and its optimizer state. A unit all-gathers its parameters before its forward and frees them after
(reshard_after_forward; the root keeps its own for backward), all-gathers them again before its backward, and
reduce-scatters its gradients after it (Rajbhandari et al., "ZeRO", 2020: stage 3).

Collectives are recorded through FSDP2's own extension point, `set_custom_all_gather` / `set_custom_reduce_scatter`
on each unit, with subclasses of torch's default implementations that time each call (op, bytes in the
nccl-tests convention, phase, the unit's layer, the reduce op), on the rank's marks (dtlab.rank.marks). FSDP2
unshards synchronously unless it prefetches (async_op); an asynchronous call is issued and its end is unknown to
the wrapper (t_end None). Time blocked: on CPU a synchronous call blocks the training thread, so it is both its
interval and time blocked. On CUDA FSDP2 issues its all-gathers and reduce-scatters on streams of its own
(torch's `FSDPCommContext`), so a call there stalls only that stream; the compute stream meets an all-gather in
the unit's `wait_for_unshard` (it waits on the all-gather's event, then copies the parameters out), which is
timed instead: a mark on the compute stream before and after (`blocked_recording` in config.json says what is
and is not intercepted). The reduce op is recorded: FSDP2 on gloo was reported to sum
gradients instead of averaging them (github.com/pytorch/pytorch/issues/162338), which `reference=True` catches
(dtlab.rank.reference, dtlab.results.reference).

`expected_bytes_per_step` (config.json) is what the units' padded sizes say a steady step moves: every unit
gathered in forward, every non-root unit again in backward, every unit's gradients reduce-scattered.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dtlab.config.run import RunConfig
from dtlab.rank.loop import Step
from dtlab.rank.optim import adamw
from dtlab.rank.recorder import Mark
from dtlab.rank.strategies.bases import SplitStrategy


def _padded_bytes(p, world: int) -> int:
    """Bytes of `p` as FSDP2 communicates it: dim 0 padded to a multiple of the ranks (the whole tensor)."""
    rows = p.shape[0] if p.dim() else 1
    per_row = p.numel() // rows if rows else 0
    return int(-(-rows // world) * world * per_row * p.element_size())


def _recorders(rec, label, layer):
    """A recording all-gather and reduce-scatter for one FSDP unit (subclasses of torch's defaults)."""
    # a private module of torch (2.11 to 2.14): imported only by a recording run, so that a torch that moves it
    # fails the recording, not every fsdp2 run
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    def run(op, nbytes, group, call, async_op, **extra):
        on_compute = rec.marks.on_compute_stream()  # CUDA: FSDP2's own streams are not the compute stream
        r = rec.start(op, nbytes, "dp", group.size(), layer, None, unit=label, **extra)
        work = call()
        if async_op and work is not None:  # FSDP2 waits on it later, out of the wrapper's sight
            r["async_op"] = True
            return work
        rec.finish(r)
        if on_compute:
            rec.block(r, r["_start"], r["_end"], "blocking_call")
        return work

    class AllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return run(
                "all_gather",
                output_tensor.numel() * output_tensor.element_size(),
                group,
                lambda: super(AllGather, self).__call__(output_tensor, input_tensor, group, async_op),
                async_op,
            )

    class ReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return run(
                "reduce_scatter",
                input_tensor.numel() * input_tensor.element_size(),
                group,
                lambda: super(ReduceScatter, self).__call__(output_tensor, input_tensor, group, op, async_op),
                async_op,
                reduce_op=str(op),
            )

    return AllGather(), ReduceScatter()


def _watch_unshard(rec, unit, label) -> bool:
    """CUDA: time the compute stream's wait for `unit`'s all-gather (FSDPParamGroup.wait_for_unshard, a private
    method of torch 2.11 to 2.14, wrapped on the instance); False where this torch has no such method."""
    try:
        group = unit._get_fsdp_state()._fsdp_param_group
        real = group.wait_for_unshard
    except AttributeError:
        return False
    if group is None:
        return False

    def wait_for_unshard(*args, **kwargs):
        a = rec.marks.compute_mark()
        try:
            return real(*args, **kwargs)
        finally:
            rec.block_here("all_gather", a, rec.marks.compute_mark(), f"wait_for_unshard:{label}")

    group.wait_for_unshard = wait_for_unshard
    return True


def blocked_recording(cuda: bool, watched: bool) -> dict:
    """How FSDP2's time blocked was measured on this rank, and what it cannot see (config.json)."""
    if not cuda:
        return {
            "clock": "wall clock (perf_counter) on the training thread",
            "intercepted": ["the whole of every synchronous all-gather and reduce-scatter"],
            "not_intercepted": ["waits on asynchronous (prefetched) all-gathers"],
        }
    return {
        "clock": "CUDA events on the compute stream",
        "intercepted": (
            [
                "each unit's wait_for_unshard: the compute stream's wait for the all-gather and the "
                "copy-out of the parameters after it"
            ]
            if watched
            else []
        )
        + ["all-gathers and reduce-scatters issued on the compute stream"],
        "not_intercepted": [
            "the compute stream's wait for the reduce-scatters at the end of backward (FSDP2's post-reduce event)"
        ]
        + ([] if watched else ["waits for all-gathers (wait_for_unshard could not be wrapped on this torch)"]),
    }


class FullyShard(SplitStrategy):
    """Every block one FSDP unit and the root another, on a 1-D mesh over all ranks (see the module docstring)."""

    def split(self, replica) -> dict:
        """Shard the model, install the recording collectives; the units' expected traffic."""
        cfg, world = self.ctx.cfg, self.ctx.world
        self.model = model = replica.model.to(replica.device)
        model.train()
        self.mesh = None  # FSDP2 reduce-scatters the gradients itself: no separate data-parallel average
        mesh = init_device_mesh(replica.device.type, (world,), mesh_dim_names=("dp",))
        blocks = list(model.distilbert.transformer.layer)
        block_params = {id(p) for blk in blocks for p in blk.parameters()}
        root_bytes = sum(_padded_bytes(p, world) for p in model.parameters() if id(p) not in block_params)
        blocks_bytes = sum(_padded_bytes(p, world) for blk in blocks for p in blk.parameters())
        for blk in blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.marks.prepare([mesh.get_group()])
        watched = _record_units(cfg, self.rec, model, blocks)
        self.params = list(model.parameters())
        self.opt = adamw(self.params, cfg.lr, cfg.optimizer_impl)
        expected = {
            "all_gather_forward": root_bytes + blocks_bytes,
            "all_gather_backward": blocks_bytes,
            "reduce_scatter": root_bytes + blocks_bytes,
        }
        return {
            "fsdp_units": 1 + len(blocks),
            "fsdp_expected": expected,
            "expected_bytes_per_step": (
                {
                    "all_gather": world * (expected["all_gather_forward"] + expected["all_gather_backward"]),
                    "reduce_scatter": world * expected["reduce_scatter"],
                }
                if cfg.record
                else {}
            ),
            "collective_recording": "FSDP2's set_custom_all_gather / set_custom_reduce_scatter, timed per call",
            "blocked_recording": blocked_recording(self.marks.cuda, watched),
        }

    def compute(self, batch):
        """Forward (units gathered, freed) and backward (gathered again, gradients reduce-scattered)."""
        out = self.model(**batch)
        self.clock.mark(Mark.FWD)
        out.loss.backward()
        return out

    def step_fields(self, step: int, t: dict, out) -> Step:
        """The loss."""
        return Step(t, {"loss": float(out.loss.detach())})


def _record_units(cfg: RunConfig, rec, model, blocks) -> bool:
    """With cfg.record, install the recording all-gather and reduce-scatter on every FSDP unit (the root and each
    block) and, on CUDA, time each unit's wait for its all-gather; returns whether those waits are watched."""
    watched = bool(cfg.record and rec.marks.cuda)
    if cfg.record:
        for label, layer, unit in [("root", None, model)] + [(f"layer.{i}", i, blk) for i, blk in enumerate(blocks)]:
            ag, rs = _recorders(rec, label, layer)
            unit.set_custom_all_gather(ag)
            unit.set_custom_reduce_scatter(rs)
            if rec.marks.cuda:
                watched = _watch_unshard(rec, unit, label) and watched
    return watched
