"""torch's own DDP compression hooks for one run (dtlab.levers), and the bytes each bucket puts on the wire.

`Codec(name, ...)` is called by the recorder's hook with a bucket; it returns the hook's future (whose value is
the averaged, decompressed bucket) and the bucket's bytes on the wire:
- fp16 / bf16: the bucket's numel x 2 bytes (one 16-bit all-reduce);
- powersgd: read off torch's own PowerSGDState counters (total_numel_after_compression grows by what this
  bucket sends: (n + m) r per compressed matrix, numel per uncompressed tensor), x the gradient's element
  size (P and Q have the gradient's dtype). While torch still runs plain all-reduce (the first
  powersgd_start_iter steps), the bucket's own bytes.
"""

from __future__ import annotations


class Codec:
    """One run's compression hook: `codec(bucket) -> (future, wire_bytes)`."""

    def __init__(self, name: str, rank: int = 1, start_iter: int = 2, seed: int = 0):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        self.name, self.state = name, None
        if name == "fp16":
            self._hook = lambda bucket: default_hooks.fp16_compress_hook(None, bucket)
        elif name == "bf16":
            self._hook = lambda bucket: default_hooks.bf16_compress_hook(None, bucket)
        elif name == "powersgd":
            self.state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=start_iter, random_seed=seed)
            self._hook = lambda bucket: psgd.powerSGD_hook(self.state, bucket)
        else:
            raise ValueError(f"comm_hook must be one of fp16, bf16, powersgd for a Codec, got {name!r}")

    def __call__(self, bucket):
        buf = bucket.buffer()
        if self.state is None:
            return self._hook(bucket), buf.numel() * 2
        seen, sent = self.state.total_numel_before_compression, self.state.total_numel_after_compression
        fut = self._hook(bucket)
        if self.state.total_numel_before_compression == seen:  # torch ran its plain all-reduce
            return fut, buf.numel() * buf.element_size()
        return fut, (self.state.total_numel_after_compression - sent) * buf.element_size()
