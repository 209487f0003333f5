"""One replica's setup, the same for every strategy: the process group, the model (seeded), the learning rate its
optimizer will use, its dropout, this rank's batches, and the facts that rank 0 writes into config.json and every
rank into its `ready` event.

A strategy then wraps or splits the model (DDP, DeepSpeed, fully_shard, a tensor-parallel plan, a pipeline stage)
and builds its optimizer over the parameters that gives it, at the `cfg.lr` settled here (dtlab.rank.optim).

The global batch is cut into `shards` shares: one per rank for the data-parallel strategies, one per replica for
'tp' and 'pp' (every rank of a replica reads its replica's share, dtlab.rank.strategies.bases), one per worker for the
asynchronous server (which reads none itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtlab.config.convergence import LrPlan, eval_samples_for, settle_lr
from dtlab.config.run import RunConfig
from dtlab.rank.data import apply_dropout, build_model, load_heldout, load_sentences
from dtlab.rank.lifecycle import setup_distributed


def make_batches(cfg: RunConfig, tokenizer, sentences, labels, rank: int, world: int, device):
    """Tokenise this rank's share once, padded/truncated to exactly seq_len so every step has one shape."""
    mine_s, mine_l = sentences[rank::world], labels[rank::world]
    enc = tokenizer(mine_s, padding="max_length", truncation=True, max_length=cfg.seq_len, return_tensors="pt")
    y = torch.tensor(mine_l, dtype=torch.long)
    out = []
    for i in range(0, len(mine_s) - cfg.batch_size + 1, cfg.batch_size):
        sl = slice(i, i + cfg.batch_size)
        out.append(
            {
                "input_ids": enc["input_ids"][sl].to(device),
                "attention_mask": enc["attention_mask"][sl].to(device),
                "labels": y[sl].to(device),
            }
        )
    return out


@dataclass
class Replica:
    """What `build_replica` made: where the rank runs, the model (on the CPU, not yet wrapped or split) and its
    tokenizer, this rank's batches, every shard's batches when asked for (else None), and the facts."""

    device: torch.device
    backend: str
    model: torch.nn.Module
    tokenizer: object
    batches: list
    every_shard: list | None
    facts: dict
    lr: LrPlan
    heldout: tuple | None  # (sentences, labels, source) of the held-out split an evaluating rank uses, else None


def build_replica(
    ctx,
    shards: int,
    shard: int | None,
    every_shard: bool = False,
    nccl_timing: bool = False,
    heldout: bool = False,
) -> Replica:
    """Process group (where `ctx.placed` says), model, learning rate, dropout and the batches of share `shard` of
    `shards` (None: no batches, for a rank that trains on none), for rank `ctx.rank` of the run `ctx.cfg`
    (dtlab.rank.loop.RankContext). `every_shard`: also every share's batches (the reference trains on the global
    batch). `nccl_timing`: switch on NCCL's own per-collective timing, for a run that reads it. `heldout`: also load the
    held-out split that goes with the data (as many sentences as config.convergence.eval_samples_for settles), for
    the rank that evaluates."""
    cfg = ctx.cfg
    device, backend = setup_distributed(ctx.placed, ctx.rank, ctx.world, cfg.deterministic, nccl_timing)
    torch.manual_seed(cfg.seed)
    built = build_model(cfg.model, cfg.model_source, cfg.model_path, cfg.seed)
    # explicit, or the default for these weights; scaled and warmed up (config.convergence)
    lr = settle_lr(cfg, built.pretrained, ctx.spec.asynchronous)
    eval_samples = eval_samples_for(cfg, device.type)  # held-out sentences per evaluation (None: all)
    apply_dropout(built.model, cfg.dropout)
    # training steps only: a baseline step reuses the batch of the training step it is paired with, so the data (and
    # the losses) of a run do not depend on how many baseline steps it has
    sentences, labels, data_src = load_sentences(
        cfg.data, cfg.steps * cfg.ddp.accumulate * cfg.batch_size * shards, cfg.seed
    )
    held = load_heldout(data_src, eval_samples) if heldout else None
    wanted = range(shards) if every_shard else [] if shard is None else [shard]
    made = {s: make_batches(cfg, built.tokenizer, sentences, labels, s, shards, device) for s in wanted}
    params = list(built.model.parameters())
    facts = {
        "model_source": built.model_source,
        "tokenizer_source": built.tokenizer_source,
        "data_source": data_src,
        "lr": {"value": lr.value, "source": lr.source},
        "num_parameters": sum(p.numel() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        # per-parameter gradient bytes in registration order: what-if bucket layouts are built from it
        "param_nbytes": [p.numel() * p.element_size() for p in params if p.requires_grad],
    }
    every = [made[s] for s in range(shards)] if every_shard else None
    return Replica(device, backend, built.model, built.tokenizer, made.get(shard, []), every, facts, lr, held)
