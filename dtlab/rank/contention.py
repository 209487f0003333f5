"""A training rank's backward pass as a load, for timing collectives the way training meets them.

During training a bucket's all-reduce runs while the rank is still computing the rest of its backward pass: on a
CPU, gloo's threads share the cores with the autograd thread; on a GPU, NCCL's kernels share the SMs, memory
bandwidth and copy engines with the backward kernels. `BackwardLoad` reproduces that beside a calibration sweep:
a thread of its own replays the model's backward pass (`loss.backward(retain_graph=True)` on one forward of a
batch of the run's shape, so the layers, matmul shapes and thread budget are a training rank's) while the main
thread times collectives. On a GPU it launches on a stream of its own, so the timing events on the main thread's
stream do not wait for its kernels.
"""

from __future__ import annotations

import threading
import time


class BackwardLoad:
    """Replays one model's backward pass in a background thread while `running()` is entered.

    `model`: 'tiny' or 'distilbert' (random weights: the arithmetic is what matters); `batch_size`, `seq_len`: the
    training rank's batch. Construction builds the model and runs one forward and backward (so the first timed
    block does not pay for allocation); `close()` stops the thread. `passes` counts the backward passes replayed and
    `busy_s` the seconds the thread spent in them (how much load there was)."""

    def __init__(self, model: str, batch_size: int, seq_len: int, device, seed: int = 0):
        import torch

        from dtlab.rank.data import build_model
        torch.manual_seed(seed)
        self.model = build_model(model, "random", None, seed).model.to(device)
        self.model.train()
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        vocab = self.model.config.vocab_size
        ids = torch.randint(1000, vocab, (batch_size, seq_len), device=device)
        labels = torch.randint(0, 2, (batch_size,), device=device)
        self._loss = self.model(input_ids=ids, labels=labels).loss
        self._loss.backward(retain_graph=True)
        self.passes, self.busy_s = 0, 0.0
        self._on = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._loop, name="dtlab-backward-load", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import contextlib

        import torch
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            while not self._stop.is_set():
                if not self._on.wait(timeout=0.1):
                    continue
                self._idle.clear()
                t0 = time.perf_counter()
                while self._on.is_set() and not self._stop.is_set():
                    self._loss.backward(retain_graph=True)  # the gradients accumulate: only the work matters
                    if self.stream is not None:
                        self.stream.synchronize()  # one pass at a time in flight, as a training rank has
                    self.passes += 1
                self.busy_s += time.perf_counter() - t0
                self._idle.set()

    def start(self) -> None:
        """Start replaying backward passes (returns at once)."""
        self._idle.clear()
        self._on.set()

    def pause(self) -> None:
        """Stop after the pass in progress and return once the thread is idle."""
        self._on.clear()
        self._idle.wait()

    def close(self) -> None:
        """Stop the thread."""
        self._on.clear()
        self._stop.set()
        self._thread.join(timeout=60)
