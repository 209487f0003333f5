"""What the initialised ZeRO-3 engine says about traffic and memory, read from its parameters and optimizer
(no communication, no sync): the expected all-gather / reduce-scatter bytes and layout facts (`zero_facts`,
`nonresident_bytes`, sizes padded as ZeRO-3 communicates them) and the bytes a rank holds (`memory_record`,
each storage byte counted once by `_Storage`).
"""

from __future__ import annotations

import torch


def _padded_bytes(p, world: int) -> int:
    """Bytes of `p` as ZeRO-3 communicates it: its partition (ceil(numel/world) elements) times world."""
    return int(p.ds_tensor.ds_numel * world * p.ds_tensor.element_size())


def nonresident_bytes(params, world: int) -> int:
    """Padded bytes of the parameters that are not materialised on this rank right now (neither available
    nor in flight): what ZeRO-3 must all-gather before the next pass can use them."""
    # deepspeed only after engine.import_deepspeed set DS_ACCELERATOR (importing this module must not import it)
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(_padded_bytes(p, world) for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)


def zero_facts(engine, world: int) -> dict:
    """Traffic expectations and layout facts read from the initialised engine (bytes, elements)."""
    params = list(engine.module.parameters())
    trainable = [p for p in params if p.requires_grad]
    persist = [p for p in params if p.ds_persist]
    nonpersist = [p for p in params if not p.ds_persist]
    grad_bytes = sum(p.ds_numel * p.ds_tensor.element_size() for p in trainable)
    padded = sum(_padded_bytes(p, world) for p in trainable)
    np_padded = sum(_padded_bytes(p, world) for p in nonpersist)
    pp_padded = sum(_padded_bytes(p, world) for p in persist)
    total_numel = sum(p.ds_numel for p in params)
    reuse, prefetch = engine.zero_max_reuse_distance(), engine.zero_prefetch_bucket_size()
    # Backward re-gathers what forward released. Forward keeps a parameter when it recurs within
    # max_reuse_distance elements of the parameter trace (or when prefetch has claimed its next use). The trace
    # of one step holds each module's parameters at most twice (forward and backward), hence the bound.
    if reuse >= 2 * total_numel:
        bwd, rule = (
            0,
            (
                f"stage3_max_reuse_distance {reuse:,} >= 2 x {total_numel:,} parameters: every parameter "
                "gathered in forward is kept until its backward use, so backward gathers nothing"
            ),
        )
    elif reuse == 0 and prefetch == 0:
        bwd, rule = (
            np_padded,
            (
                "stage3_max_reuse_distance 0 and no prefetch: forward releases every gathered "
                "parameter, backward gathers each again"
            ),
        )
    else:
        bwd, rule = (
            None,
            (
                f"stage3_max_reuse_distance {reuse:,} with prefetch {prefetch:,}: depends on the trace; "
                "see the per-step allgather_expected_bwd_bytes in step events"
            ),
        )
    return {
        "grad_bytes_unpadded": grad_bytes,
        "padded_grad_bytes": padded,
        "padding_bytes": padded - grad_bytes,
        "persistent_params": len(persist),
        "persistent_bytes": sum(p.ds_numel * p.ds_tensor.element_size() for p in persist),
        "persistent_padded_bytes": pp_padded,
        "nonpersistent_params": len(nonpersist),
        "nonpersistent_padded_bytes": np_padded,
        "expected_reduce_scatter_bytes_per_step": padded if engine.zero_reduce_scatter() else 0,
        "expected_allgather_bytes_forward": np_padded,
        "expected_allgather_bytes_backward": bwd,
        "expected_allgather_bytes_optimizer": pp_padded,
        "allgather_backward_rule": rule,
        "allgather_note": (
            "steady steps (trace recorded): forward gathers the non-persistent parameters; "
            "persistent ones are re-gathered once per step in the optimizer phase (_post_step). "
            "Step 0 records the trace and releases after every use, so it gathers every "
            "parameter in forward and again in backward."
        ),
        "zero_effective": {
            "stage": engine.zero_optimization_stage(),
            "reduce_bucket_size": engine.zero_reduce_bucket_size(),
            "stage3_prefetch_bucket_size": prefetch,
            "stage3_param_persistence_threshold": engine.zero_param_persistence_threshold(),
            "stage3_max_reuse_distance": reuse,
            "stage3_max_live_parameters": engine.zero_max_live_parameters(),
            "overlap_comm": engine.zero_overlap_comm(),
            "reduce_scatter": engine.zero_reduce_scatter(),
            "contiguous_gradients": engine.zero_contiguous_gradients(),
        },
    }


class _Storage:
    """Counts bytes of tensor storage once, however many views or categories reach it."""

    def __init__(self):
        self._covered: dict[int, list[tuple[int, int]]] = {}

    def add(self, tensors) -> int:
        """Bytes of these tensors not counted before (by storage and byte range)."""
        total = 0
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            a = t.storage_offset() * t.element_size()
            b = a + t.numel() * t.element_size()
            ivs = self._covered.setdefault(key, [])
            covered = sum(max(0, min(b, y) - max(a, x)) for x, y in ivs)  # ivs are kept disjoint
            total += (b - a) - covered
            merged = [(x, y) for x, y in ivs if y < a or x > b]
            lo = min([a] + [x for x, y in ivs if not (y < a or x > b)])
            hi = max([b] + [y for x, y in ivs if not (y < a or x > b)])
            self._covered[key] = merged + [(lo, hi)]
        return int(total)


def memory_record(engine) -> dict:
    """What this rank holds, in bytes, counted from the tensors (each storage byte once):

    - params_bytes: the rank's parameter partitions (`p.ds_tensor`, padding included) + every parameter
      materialised whole (persistent ones always; others only between gather and release).
    - grads_bytes: the gradient partition buffer (+ any `p.grad` still set).
    - opt_bytes: the fp32 master partition + the AdamW state (exp_avg, exp_avg_sq, step). In fp32 training
      DeepSpeed 0.19.8 keeps the master partition as a separate copy (its "same device" test compares a
      torch.device with a string, which is False), so it is counted here; if it ever shares storage with
      the parameter partitions, it adds 0.
    Also returned, for the record: fp32_master_bytes, adam_state_bytes and ipg_bucket_bytes (the reduce
    bucket, `reduce_bucket_size` elements allocated with torch.empty: virtual memory on CPU, mostly untouched;
    real device memory on GPU), none of which is part of the three totals above except as stated.
    """
    zopt = engine.optimizer
    params = list(engine.module.parameters())
    seen = _Storage()
    params_bytes = seen.add(p.ds_tensor for p in params) + seen.add(p.data for p in params)
    grads_bytes = seen.add([getattr(zopt, "grad_partitions_flat_buffer", None)]) + seen.add(p.grad for p in params)
    master = seen.add(getattr(zopt, "fp32_partitioned_groups_flat", []) or [])
    inner = getattr(zopt, "optimizer", None)
    state = [v for st in getattr(inner, "state", {}).values() for v in st.values() if torch.is_tensor(v)]
    adam = seen.add(state)
    ipg = sum(
        b.buffer.numel() * b.buffer.element_size()
        for b in getattr(zopt, "ipg_buckets", {}).values()
        if getattr(b, "buffer", None) is not None
    )
    return {
        "params_bytes": params_bytes,
        "grads_bytes": grads_bytes,
        "opt_bytes": master + adam,
        "fp32_master_bytes": master,
        "adam_state_bytes": adam,
        "ipg_bucket_bytes": int(ipg),
    }
