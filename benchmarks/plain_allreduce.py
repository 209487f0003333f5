"""Independent all-reduce timing with plain torch.distributed (no dtlab code), for checking a profile.

    torchrun --nproc-per-node 2 benchmarks/plain_allreduce.py OUT.json 2097152 8388608 ...

Per size: 5 untimed all-reduces, then 20 timed ones, each after a barrier; the slowest rank per iteration,
then the median over iterations, is written to OUT.json by rank 0 as {nbytes: seconds}.
"""

import json
import sys
import time

import torch
import torch.distributed as dist


def main():
    out, sizes = sys.argv[1], [int(s) for s in sys.argv[2:]]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    result = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        for _ in range(5):
            dist.all_reduce(x)
        per_iter = []
        for _ in range(20):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # slowest rank for this iteration
            per_iter.append(float(t))
        per_iter.sort()
        result[nbytes] = per_iter[len(per_iter) // 2]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"world_size": world, "median_s": result}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
