"""Strategy 'ps': a parameter server built from torch.distributed collectives, on DDP's own gradient buckets.

The strategy is DDP's (`dtlab.rank.strategies.ddp.DDPStrategy`, on the one training loop): same model, data,
buckets (`bucket_mb`), recorder, no-op baseline and events. Only the reduction of each bucket differs. DDP's
all-reduce is replaced by

1. divide the bucket by p on the compute stream and mark it ready (the recorder, exactly as for DDP);
2. `dist.reduce(bucket, dst=0)`: the sum arrives at rank 0, the server (the workers' push);
3. `dist.broadcast(bucket, src=0)`: every rank receives it back (the pull).

Rank 0 is both the server and worker 0 (colocated, as in a PS with one server on a worker's machine): it
trains on its own shard like every rank, and its own contribution never crosses a link. Every rank ends
with the same averaged gradients as DDP, so a 'ps' run's losses equal a 'ddp' run's with the same seed
(tests/integration/test_ps.py).

Order. Collectives must be issued in the same order on every rank; DDP calls the hook in bucket order, the
same on every rank, but the broadcast of a bucket may only start once its reduce has finished.
- NCCL: both are issued at once from the hook (`async_op=True`). A process group runs its collectives on one
  NCCL stream per device, in issue order, so the broadcast starts after the reduce by construction and the
  CPU never blocks. t_start = t_ready (as for DDP); t_reduced is an event after the reduce (recorded from
  its future's callback, as the recorder records t_end). Not run here: the CI machine has no GPU.
- gloo: ProcessGroupGloo runs queued collectives on a pool of worker threads, so a broadcast issued right
  after its reduce could run beside it and send a buffer not yet reduced. One dedicated thread per rank
  therefore takes the buckets from a FIFO queue and runs the blocking pair, bucket after bucket, then
  completes the `torch.futures.Future` the hook returned. The autograd thread never waits: backward goes on
  computing while the thread communicates, as with DDP's async all-reduce. Here t_start is when that thread
  issued the reduce (t_start - t_ready is the wait behind earlier buckets in dtlab's queue, where DDP's
  all-reduces wait in gloo's), t_reduced when the reduce returned, t_end when the broadcast returned. With
  gloo on CUDA tensors (two ranks sharing a GPU) the thread runs the pair on the hook's stream and the future
  carries the device; untested here. Its marks are the recorder's end marks (dtlab.rank.marks): events on a
  stream dtlab owns on the rank's GPU, recorded under its device guard, so they time the thread's progress.

Recorded per bucket, beside DDP's fields (`nbytes`: gradient bytes, `wire_bytes`: the message size of each of
its collectives, the same nbytes: no compression): `t_reduced`, and `server_bytes` = 2(p-1) x nbytes, the
bytes a parameter server's one link carries for this bucket (p-1 workers push nbytes in, then pull nbytes
out; the server's own share stays local). That is the PS *model's* traffic (dtlab.model.costmodel.ps_server);
the backends do not route everything through rank 0's link: gloo's reduce is a ring reduce-scatter plus a
gather into the root, its broadcast a binomial tree (dtlab.model.ps).
"""

from __future__ import annotations

import contextlib
import queue
import threading

import torch
import torch.distributed as dist

from dtlab.rank.strategies.ddp import DDPStrategy

SERVER_RANK = 0


def server_bytes(nbytes: int, world: int) -> int:
    """Bytes through a parameter server's link for one bucket of `nbytes` gradient bytes on `world` ranks
    (server colocated with a worker): (p-1) pushes in plus (p-1) pulls out, 2(p-1) x nbytes."""
    return 2 * (world - 1) * int(nbytes)


class _Pair:
    """The two Works of a bucket, so the recorder's backend_ms is their summed NCCL-measured duration."""

    def __init__(self, reduce_work, broadcast_work):
        self.works = (reduce_work, broadcast_work)

    def _get_duration(self) -> float:
        return sum(float(w._get_duration()) for w in self.works)  # raises on gloo: backend_ms None


class StreamOrderedPS:
    """NCCL: reduce and broadcast issued back to back, ordered by the process group's one NCCL stream."""

    def __init__(self, world: int):
        self.world = world

    def issue(self, buf, rec: dict, mark):
        """Issue the pair for a divided bucket; returns (future, value) as the recorder's transports do."""
        rec["server_bytes"] = server_bytes(rec["nbytes"], self.world)
        rec["_start"] = rec["_ready"]
        w_reduce = dist.reduce(buf, dst=SERVER_RANK, async_op=True)
        w_reduce.get_future().then(lambda f: rec.__setitem__("_t_reduced", mark()))
        w_bcast = dist.broadcast(buf, src=SERVER_RANK, async_op=True)
        rec["_work"] = _Pair(w_reduce, w_bcast)
        return w_bcast.get_future(), lambda f: buf

    def close(self) -> None:
        """Nothing to release."""


class OrderedThreadPS:
    """gloo: one thread per rank runs each bucket's blocking reduce then broadcast, in the hook's order."""

    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, device
        self.cuda = device.type == "cuda"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="dtlab-ps-comm", daemon=True)
        self._thread.start()

    def issue(self, buf, rec: dict, mark):
        """Queue a divided bucket; returns (future, value). The future completes from the thread."""
        rec["server_bytes"] = server_bytes(rec["nbytes"], self.world)
        rec["_work"] = None
        fut = torch.futures.Future(devices=[self.device]) if self.cuda else torch.futures.Future()
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        self._queue.put((buf, rec, mark, fut, stream))
        return fut, lambda f: f.value()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            buf, rec, mark, fut, stream = item
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    rec["_start"] = mark()
                    dist.reduce(buf, dst=SERVER_RANK)
                    rec["_t_reduced"] = mark()
                    dist.broadcast(buf, src=SERVER_RANK)
                    rec["_end"] = mark()
                    fut.set_result(buf)
            except BaseException as e:  # noqa: BLE001 - handed to DDP, which raises it in the training thread
                rec.setdefault("_start", rec["_ready"])
                fut.set_exception(e)

    def close(self) -> None:
        """Stop the thread once the queued buckets are done (it is idle between steps)."""
        self._queue.put(None)
        self._thread.join(timeout=60)


def make_transport(world: int, device: torch.device, backend: str):
    """The bucket transport for this rank: stream-ordered on NCCL, an ordered thread on gloo."""
    return StreamOrderedPS(world) if backend == "nccl" else OrderedThreadPS(world, device)


class PSStrategy(DDPStrategy):
    """DDP whose buckets are reduced to rank 0 and broadcast back (`make_transport`)."""

    def transport(self, device, backend):
        """The reduce-to-rank-0 + broadcast transport for this rank."""
        return make_transport(self.ctx.world, device, backend)
