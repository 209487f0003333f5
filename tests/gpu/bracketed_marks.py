"""A rank's marks with a host bracket (for tests/gpu/test_gpu_timing.py, through dtlab.rank.marks' test-only hook
DTLAB_MARKS_HOOK): every mark the training thread takes is preceded by torch.cuda.synchronize() and a host clock
reading, and every figure read from two such marks is written beside the host's time between them. With the device
idle at each mark, the CUDA events and the synchronize-bracketed host times measure the same span."""

import json
import os
import threading
import time

import torch

from dtlab.rank.marks import Marks

#: Where each rank writes its pairs: {DTLAB_BRACKETS}/rank{RANK}.jsonl
OUT_ENV = "DTLAB_BRACKETS"


class BracketedMarks(Marks):
    """Marks whose training-thread marks are synchronised and read on the host clock too."""

    def __init__(self, device, backend):
        super().__init__(device, backend)
        self.host = {}
        path = os.path.join(os.environ[OUT_ENV], f"rank{os.environ.get('RANK', '0')}.jsonl")
        self._out = open(path, "a")  # noqa: SIM115 - open for the rank's whole life

    def now(self):
        if not self.cuda or threading.current_thread() is not threading.main_thread():
            return super().now()
        torch.cuda.synchronize(self.device)
        h = time.perf_counter()
        ev = super().now()
        self.host[id(ev)] = (ev, h)
        return ev

    def seconds(self, ref, mark):
        s = super().seconds(ref, mark)
        if ref is not None and mark is not None and id(ref) in self.host and id(mark) in self.host:
            self._out.write(
                json.dumps({"events_s": s, "host_s": self.host[id(mark)][1] - self.host[id(ref)][1]}) + "\n"
            )
            self._out.flush()
        return s


def rank_marks(device, backend, synced=False):
    """The hook's entry point: bracketed marks, streams prepared."""
    m = BracketedMarks(device, backend)
    m.prepare()
    return m
