"""The levers that shrink or hide T_comm besides buckets: gradient compression through torch's own
DDP comm hooks, and communicating once per `accumulate` micro-batches. Pure: checked before launch.

- fp16 / bf16 (`default_hooks.fp16_compress_hook`, `bf16_compress_hook`): each bucket is cast to 16 bits and
  divided by p before the all-reduce and cast back after: exactly half the bytes on the wire;
- powersgd (`powerSGD_hook`): each n x m gradient matrix whose rank-r factors are at least 2x smaller
  (torch's min_compression_rate) travels as P (n x r) and Q (m x r); other tensors (biases, LayerNorm) are
  all-reduced uncompressed. Plain all-reduce for the first `powersgd_start_iter` steps;
- accumulate K: K micro-batches per optimizer step, K - 1 of them under `ddp.no_sync()`: one all-reduce round
  per K micro-batches, so T_comm per sample drops by K while the compute per sample stays.

`wire_factor(name)` is the model's r for the 16-bit hooks (bytes on the wire / gradient bytes).
"""

from __future__ import annotations

from dtlab.config.validate import choice, int_at_least
from dtlab.config.strategies import strategy_spec

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


def wire_factor(comm_hook: str) -> float | None:
    """Bytes on the wire / gradient bytes for a hook whose ratio is fixed (none 1, fp16 and bf16 1/2); None
    for powersgd, whose ratio depends on the shapes and the rank (it is measured per bucket)."""
    return {"none": 1.0, "fp16": 0.5, "bf16": 0.5}.get(comm_hook)


def validate_levers(cfg, placed) -> None:
    """Refuse bad lever settings by name before launch (`placed`: the run's dtlab.config.placement plan)."""
    choice("comm_hook", cfg.comm_hook, COMM_HOOKS)
    int_at_least("accumulate", cfg.accumulate, 1)
    int_at_least("powersgd_rank", cfg.powersgd_rank, 1)
    int_at_least("powersgd_start_iter", cfg.powersgd_start_iter, 2)
    spec = strategy_spec(cfg.strategy)
    if cfg.comm_hook != "none" and not spec.comm_hooks:
        raise spec.refuse(
            "comm_hook",
            cfg.comm_hook,
            "a DDP compression hook reaches only the buckets DDP all-reduces itself "
            "(ZeRO-3 reduce-scatters inside DeepSpeed; ps reduces with its own hook)",
        )
    if cfg.accumulate != 1 and not spec.accumulate:
        raise spec.refuse("accumulate", cfg.accumulate, "gradient accumulation is wired through DDP's no_sync only")
    if spec.needs_record and not cfg.record:
        raise ValueError(
            f"strategy {spec.name!r} needs record=True: the recording hook is what reduces each "
            "bucket (without it DDP would all-reduce)"
        )
    if cfg.comm_hook != "none" and not cfg.record:
        raise ValueError(f"comm_hook {cfg.comm_hook!r} needs record=True: the recorder is what installs the hook")
    if cfg.comm_hook == "bf16" and placed.backend == "gloo" and placed.device == "cuda":
        raise ValueError(
            "comm_hook 'bf16' is not supported for gloo on CUDA tensors here; use 'fp16', or NCCL (one rank per GPU)"
        )
