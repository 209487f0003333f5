"""torch's own DDP compression hooks for one run (dtlab.config.compression), and the bytes each bucket puts on the wire.

`Codec(name, ...)` is called by the recorder's hook with a bucket; it returns the hook's future (whose value is
the averaged, decompressed bucket) and the bucket's bytes on the wire:
- fp16 / bf16: the bucket's numel x 2 bytes (one 16-bit all-reduce);
- powersgd: read off torch's own PowerSGDState counters (total_numel_after_compression grows by what this
  bucket sends: (n + m) r per compressed matrix, numel per uncompressed tensor), x the gradient's element
  size (P and Q have the gradient's dtype). While torch still runs plain all-reduce (the first
  powersgd_start_iter steps), the bucket's own bytes.

PowerSGD issues its second and third all-reduces from the first one's future callback. On gloo those callbacks
run in gloo's worker threads, so with two buckets in flight the ranks can issue the chained all-reduces in
different orders and deadlock (seen here with 0.05 MiB buckets). With `serialize=True` (dtlab sets it for
gloo) a PowerSGD bucket starts only after the previous bucket's chain completed: on gloo PowerSGD's buckets
never overlap each other (they still overlap the backward compute before them). NCCL orders the chain on its
stream and needs no such wait.
"""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd


class Codec:
    """One run's compression hook: `codec(bucket) -> (future, wire_bytes)`."""

    def __init__(self, name: str, rank: int = 1, start_iter: int = 2, seed: int = 0, serialize: bool = False):
        self.name, self.state, self.serialize, self._last = name, None, serialize, None
        if name == "fp16":
            self._hook = lambda bucket: default_hooks.fp16_compress_hook(None, bucket)
        elif name == "bf16":
            self._hook = lambda bucket: default_hooks.bf16_compress_hook(None, bucket)
        elif name == "powersgd":
            self.state = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter, random_seed=seed
            )
            self._hook = lambda bucket: psgd.powerSGD_hook(self.state, bucket)
        else:
            raise ValueError(f"comm_hook must be one of fp16, bf16, powersgd for a Codec, got {name!r}")

    def __call__(self, bucket):
        buf = bucket.buffer()
        if self.state is None:
            return self._hook(bucket), buf.numel() * 2
        if self.serialize and self._last is not None and not self._last.done():
            self._last.wait()  # the previous bucket's chained all-reduces first: one order on every rank
        seen, sent = self.state.total_numel_before_compression, self.state.total_numel_after_compression
        fut = self._hook(bucket)
        self._last = fut
        if self.state.total_numel_before_compression == seen:  # torch ran its plain all-reduce
            return fut, buf.numel() * buf.element_size()
        return fut, (self.state.total_numel_after_compression - sent) * buf.element_size()
