"""What the strategies beyond data parallelism ('tp', 'pp', 'fsdp2') share inside a rank: the model and this
replica's batches, the DeviceMesh of a 2-D layout, the data-parallel gradient average between replicas, the
bytes a rank holds, and the single-process reference (dtlab.rank.reference) when the config asks for it.

A 'tp' or 'pp' run of W ranks with dp_degree d is a d x (W / d) mesh with dimensions ("dp", "tp") or ("dp",
"pp"): rank r sits at dp coordinate r // (W / d), so the ranks of one replica are consecutive. Every rank of a
replica reads the same batch (the replica's share of the global batch); 'fsdp2' is data parallel over all ranks.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from dtlab.config.parallel import layout
from dtlab.config.run import RunConfig


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
    sources: dict


def build(cfg: RunConfig, run_dir: str, rank: int, world: int) -> Built:
    """Process group, mesh, model, tokenizer, this replica's batches and the reference."""
    import torch

    from dtlab.rank.data import apply_dropout, build_model, load_sentences
    from dtlab.rank.lifecycle import setup_distributed
    from dtlab.rank.optim import settle_lr
    from dtlab.rank.strategies.ddp import make_batches

    device, backend = setup_distributed(cfg, rank, world)
    deg = layout(cfg)
    spec_axis = "tp" if deg["tp"] > 1 else "pp" if deg["pp"] > 1 else None
    mesh = None
    if spec_axis is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (deg["dp"], deg[spec_axis]), mesh_dim_names=("dp", spec_axis))
    dp = deg["dp"]
    dp_rank = rank // (world // dp)
    torch.manual_seed(cfg.seed)
    built = build_model(cfg.model, cfg.model_source, cfg.model_path, cfg.seed)
    lr = settle_lr(cfg, built)  # cfg.lr: explicit, or the default for these weights (the strategies' AdamW reads it)
    apply_dropout(built.model, cfg.dropout)
    sentences, labels, data_src = load_sentences(cfg.data, cfg.steps * cfg.batch_size * dp, cfg.seed)
    per_replica = [make_batches(cfg, built.tokenizer, sentences, labels, r, dp, device) for r in range(dp)]
    ref = None
    if cfg.reference:
        from dtlab.rank.reference import Reference

        ref = Reference(copy.deepcopy(built.model), per_replica, cfg.lr, device)
    params = list(built.model.parameters())
    sources = {
        "model_source": built.model_source,
        "tokenizer_source": built.tokenizer_source,
        "data_source": data_src,
        "lr": lr,
        "num_parameters": sum(p.numel() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "param_nbytes": [p.numel() * p.element_size() for p in params if p.requires_grad],
        "layout": deg,
        "n_layers": int(built.model.config.n_layers),
        "hidden": int(built.model.config.dim),
        "n_heads": int(built.model.config.n_heads),
        "ffn_hidden": int(built.model.config.hidden_dim),
        "global_batch": cfg.batch_size * dp,
        "dropout": cfg.dropout,
    }
    return Built(device, backend, built.model, per_replica[dp_rank], ref, mesh, dp_rank, deg, sources)


def dp_sync(params, mesh, recorder) -> None:
    """Average the gradients of `params` over the mesh's "dp" dimension: one all-reduce (sum) of every local
    gradient flattened into one buffer, then / dp. A no-op with one replica."""
    if mesh is None or mesh.size(0) == 1:
        return
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

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
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard; None skipped)."""
    return int(sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None))


def memory_record(params, opt, device) -> dict:
    """What this rank holds: its parameters, gradients and optimizer state (local shards), and its peak."""
    import torch

    from dtlab.rank.recorder import peak_memory

    params = list(params)
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    peak, kind = peak_memory(device)
    return {
        "params_bytes": local_bytes(params),
        "grads_bytes": local_bytes(p.grad for p in params),
        "optim_bytes": local_bytes(state),
        "peak_bytes": peak,
        "peak_kind": kind,
    }


def check_reference(ref, step: int, named_params, writer, rank: int, loss) -> None:
    """Train the reference one step on the global batch and write how this rank's gradients compare; then wait
    for every rank (the reference's time must not land in the next step as a wait for this one)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    rec = ref.step_and_compare(step, named_params)
    writer.write("reference", rank=rank, step=step, loss=loss, seconds=time.perf_counter() - t0, **rec)
    dist.barrier()


def after_step(writer, rank: int, step: int, params, opt, device, reference, named_params, loss) -> None:
    """What every split strategy (tp, pp, fsdp2) records after a step's event: at step 0 the memory it holds
    once the optimizer state exists (peak not yet meaningful), and the comparison with the one-process
    reference run when there is one."""
    if step == 0:
        writer.write(
            "memory", rank=rank, **{**memory_record(params, opt, device), "peak_bytes": None, "peak_kind": None}
        )
    if reference is not None:
        check_reference(reference, step, named_params, writer, rank, loss)
