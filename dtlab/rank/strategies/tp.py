"""Strategy 'tp': Megatron-style tensor parallelism of DistilBERT with torch.distributed.tensor.parallel.

Each transformer block is split over the ranks of a replica (Shoeybi et al., "Megatron-LM", 2019, section 3):
the attention's q, k and v projections and the feed-forward's first linear layer are column-parallel (each rank
computes its share of the heads and of the 4h columns), the attention's output projection and the feed-forward's
second linear layer row-parallel (each rank's partial sum is all-reduced). Without sequence parallelism a step
has exactly 4 all-reduces per block, each of b x s x h activations: 2 in forward (after each row-parallel layer),
2 in backward (the gradient of each column-parallel layer's input). `PrepareModuleInput` turns the attention's
input into one replicated DTensor that q, k and v share, so their input gradients add up locally and backward
all-reduces them once (a plan with three separate inputs would all-reduce three times). Embeddings, LayerNorms,
the row-parallel biases and the classifier stay replicated: their gradients are the same on every rank of a
replica by construction, with no collective. With dp_degree > 1 the replicas average their gradients with one
all-reduce per step over the mesh's "dp" dimension (dtlab.rank.replicas.dp_sync).

transformers 5.24 views q, k and v as (..., -1, head_size), so a rank's local heads follow from its local width.
Every collective is recorded by dtlab.rank.collectives (op, bytes, phase, layer, sublayer, axis, interval) and
so is every wait for one; step events carry t_blocked.
"""

from __future__ import annotations

import contextlib
import time

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from dtlab.config.run import RunConfig
from dtlab.rank.collectives import CommRecorder, FuncolMode, LayerTracker
from dtlab.rank.lifecycle import maybe_inject_fault, record_resolved
from dtlab.rank.marks import rank_marks
from dtlab.rank.optim import adamw
from dtlab.rank.recorder import StepClock
from dtlab.rank.replicas import after_step, build, local_bytes, memory_record, step_times, timed_step


def megatron_plan() -> dict:
    """The tensor-parallel plan of one DistilBERT TransformerBlock (see the module docstring)."""
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        "attention.out_lin": RowwiseParallel(),
        "ffn.lin1": ColwiseParallel(),
        "ffn.lin2": RowwiseParallel(),
    }
    for name in ("q_lin", "k_lin", "v_lin"):
        plan[f"attention.{name}"] = ColwiseParallel(input_layouts=Replicate())
    return plan


def expected_allreduce_bytes(batch_size: int, seq_len: int, hidden: int, n_layers: int, itemsize: int = 4) -> dict:
    """The form: 4 all-reduces per block per step, each of b x s x h activations (bytes)."""
    each = batch_size * seq_len * hidden * itemsize
    return {
        "allreduces_per_block": 4,
        "forward_per_block": 2,
        "backward_per_block": 2,
        "blocks": n_layers,
        "bytes_each": each,
        "per_step": 4 * n_layers,
        "bytes_per_step": 4 * n_layers * each,
    }


def train(cfg: RunConfig, run_dir: str, rank: int, world: int, writer) -> None:
    """Build the replica's mesh, split every block, train cfg.steps steps and write step, collective, blocked,
    memory (and reference) events."""
    b = build(cfg, run_dir, rank, world)
    model = b.model.to(b.device)
    model.train()
    tp_mesh = b.mesh["tp"]
    tp = tp_mesh.size()
    for block in model.distilbert.transformer.layer:
        # src_data_rank=None: every rank built the same weights from the seed, so nothing is scattered at setup
        parallelize_module(block, tp_mesh, megatron_plan(), src_data_rank=None)
        block.attention.n_heads = block.attention.n_heads // tp  # not read in forward; kept truthful
    params = list(model.parameters())
    opt = adamw(params, cfg.lr, cfg.optimizer_impl)
    form = expected_allreduce_bytes(cfg.batch_size, cfg.seq_len, b.facts["hidden"], b.facts["n_layers"])
    local_grad = local_bytes(params)
    per_rank = form["bytes_per_step"] + (local_grad if b.degrees["dp"] > 1 else 0)
    marks = rank_marks(b.device, b.backend)
    marks.prepare([tp_mesh.get_group()] + ([b.mesh.get_group("dp")] if b.degrees["dp"] > 1 else []))
    if rank == 0:
        record_resolved(
            run_dir,
            cfg,
            b.backend,
            b.device,
            {
                **b.facts,
                "tp_form": form,
                "local_param_bytes": local_grad,
                "expected_bytes_per_step": {"all_reduce": world * per_rank} if cfg.record else {},
                "collective_recording": "TorchDispatchMode over DTensor's functional collectives "
                "(dtlab.rank.collectives)",
                "timing_method": marks.facts(),
            },
            world,
        )
    writer.write("ready", rank=rank, time=time.time(), **{k: v for k, v in b.facts.items() if k != "param_nbytes"})
    rec = CommRecorder(writer, rank, marks)
    tracker = LayerTracker(model.distilbert.transformer.layer)
    clock = StepClock(b.device, marks)
    marks.seal()

    def compute(batch):
        """Forward and backward, every functional collective of DTensor recorded (cfg.record)."""
        mode = FuncolMode(rec, "tp", tracker) if cfg.record else contextlib.nullcontext()
        with mode:
            out = model(**batch)
            clock.mark("fwd")
            out.loss.backward()
        if cfg.record:
            mode.close()
        return out

    for step in range(cfg.steps):
        maybe_inject_fault(rank, step)
        batch = b.batches[step % len(b.batches)]
        t, t_blocked, out = timed_step(step, clock, rec, opt, compute, batch, params, b.mesh)
        loss = float(out.loss.detach())
        writer.write(
            "step",
            rank=rank,
            step=step,
            **step_times(t, t["fwd"]),
            loss=loss,
            t_blocked=t_blocked,
            dp_rank=b.dp_rank,
            time=time.time(),
        )
        after_step(writer, rank, step, params, opt, b.device, b.reference, model.named_parameters(), loss)
    writer.write("memory", rank=rank, **memory_record(params, opt, b.device))
