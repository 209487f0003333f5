"""Instructor version of lab 08: reference solutions of the two "build it yourself" exercises.

Not for students: the lab's notebook carries only the stubs. `tests/test_exercises.py` checks both with
dtlab.course.exercises, so a change to the harness that would fail a correct solution is caught.
Each function is self-contained (the checks ship its source to the ranks; only modules it names are imported).
"""

import torch
import torch.distributed as dist


def my_allreduce_hook(state, bucket):
    """DDP comm hook: average one gradient bucket over all ranks; return a Future whose value is the bucket."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())  # average, not sum: each rank's loss is already a mean over its own batch
    work = dist.all_reduce(buf, async_op=True)  # async: DDP keeps computing later buckets' gradients meanwhile
    return work.get_future().then(lambda fut: fut.value()[0])


def my_ring_allreduce(tensor):
    """Sum `tensor` over all ranks in place with a ring: p-1 reduce-scatter steps, then p-1 all-gather steps,
    each sending one of p chunks to the right neighbour and receiving one from the left."""
    rank, p = dist.get_rank(), dist.get_world_size()
    if p == 1:
        return tensor
    chunks = list(tensor.view(-1).tensor_split(p))  # views into tensor; sizes differ by at most 1 element
    right, left = (rank + 1) % p, (rank - 1) % p
    # reduce-scatter: at step s, send the chunk accumulated last step, add the one arriving from the left.
    # After p-1 steps this rank holds the full sum of chunk (rank + 1) % p.
    for s in range(p - 1):
        send_i, recv_i = (rank - s) % p, (rank - s - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        req = dist.isend(chunks[send_i], right)  # isend then recv: no rank waits in a circle
        dist.recv(incoming, left)
        req.wait()
        chunks[recv_i].add_(incoming)
    # all-gather: pass the finished chunks around the ring, overwriting instead of adding.
    for s in range(p - 1):
        send_i, recv_i = (rank - s + 1) % p, (rank - s) % p
        incoming = torch.empty_like(chunks[recv_i])
        req = dist.isend(chunks[send_i], right)
        dist.recv(incoming, left)
        req.wait()
        chunks[recv_i].copy_(incoming)
    return tensor
