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
all-reduce per step over the mesh's "dp" dimension (dtlab.rank.strategies.bases.dp_sync).

transformers 5.24 views q, k and v as (..., -1, head_size), so a rank's local heads follow from its local width.
Every collective is recorded by dtlab.rank.collectives (op, bytes, phase, layer, sublayer, axis, interval) and
so is every wait for one; step events carry t_blocked.
"""

from __future__ import annotations

import contextlib

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from dtlab.rank.collectives import FuncolMode, LayerTracker
from dtlab.rank.loop import Step
from dtlab.rank.optim import adamw
from dtlab.rank.recorder import Mark, local_bytes
from dtlab.rank.strategies.bases import SplitStrategy


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


class TensorParallel(SplitStrategy):
    """Every block split over the replica's "tp" ranks (`megatron_plan`), every collective recorded."""

    def split(self, replica) -> dict:
        """Split every block over the "tp" mesh dimension; the form's expected traffic."""
        cfg, world = self.ctx.cfg, self.ctx.world
        self.model = model = replica.model.to(replica.device)
        model.train()
        self.mesh = replica.mesh
        tp_mesh = replica.mesh["tp"]
        tp = tp_mesh.size()
        for block in model.distilbert.transformer.layer:
            # src_data_rank=None: every rank built the same weights from the seed, so nothing is scattered at setup
            parallelize_module(block, tp_mesh, megatron_plan(), src_data_rank=None)
            block.attention.n_heads = block.attention.n_heads // tp  # not read in forward; kept truthful
        self.params = params = list(model.parameters())
        self.opt = adamw(params, cfg.lr, cfg.optimizer_impl)
        form = expected_allreduce_bytes(cfg.batch_size, cfg.seq_len, replica.facts["hidden"], replica.facts["n_layers"])
        local_grad = local_bytes(params)
        per_rank = form["bytes_per_step"] + (local_grad if replica.degrees["dp"] > 1 else 0)
        self.marks.prepare(
            [tp_mesh.get_group()] + ([replica.mesh.get_group("dp")] if replica.degrees["dp"] > 1 else [])
        )
        self.tracker = LayerTracker(model.distilbert.transformer.layer)
        return {
            "tp_form": form,
            "local_param_bytes": local_grad,
            "expected_bytes_per_step": {"all_reduce": world * per_rank} if cfg.record else {},
            "collective_recording": "TorchDispatchMode over DTensor's functional collectives (dtlab.rank.collectives)",
        }

    def compute(self, batch):
        """Forward and backward, every functional collective of DTensor recorded (cfg.record)."""
        record = self.ctx.cfg.record
        mode = FuncolMode(self.rec, "tp", self.tracker) if record else contextlib.nullcontext()
        with mode:
            out = self.model(**batch)
            self.clock.mark(Mark.FWD)
            out.loss.backward()
        if record:
            mode.close()
        return out

    def step_fields(self, step: int, t: dict, out) -> Step:
        """The loss and this rank's replica."""
        return Step(t, {"loss": float(out.loss.detach()), "dp_rank": self.replica.dp_rank})
