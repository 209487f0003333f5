"""The reference check gathers a sharded gradient through host memory (dtlab.rank.reference.full_tensor), not with
DTensor.full_tensor(), whose gloo path crashed ranks holding CUDA tensors. Four gloo ranks on a 2 x 2 mesh check
that the two agree for every placement the strategies make and some they could: even and uneven shards, a shard on
each mesh dimension, a shard on both (the innermost gathered first), replicas and partial sums."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dtlab.rank.reference import full_tensor

CASES = ("S0,S0", "S0,S1", "R,S1", "S1,R", "P,S0", "R,R")


def _placement(code):
    return {"R": Replicate(), "P": Partial()}.get(code) or Shard(int(code[1]))


def _worker(rank: int, world: int, init: str, out: str) -> None:
    # a rank that never arrives fails the test in minutes, not after gloo's default 30
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=180))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    results = {}
    for case in CASES:
        placements = [_placement(c) for c in case.split(",")]
        g = torch.Generator().manual_seed(7)
        whole = torch.randn(7, 5, generator=g)  # 7 rows: uneven shards over 2 and over 4
        if "P" in case:  # each rank's local part of a partial sum: distribute a replica, then mark it partial
            local = distribute_tensor(whole, mesh, [_placement("R"), placements[1]]).to_local() * (rank + 1)
            dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=whole.shape, stride=whole.stride())
        else:
            dt = distribute_tensor(whole, mesh, placements)
        ours, torchs = full_tensor(dt), dt.full_tensor()
        results[case] = (ours.shape == torchs.shape and torch.equal(ours, torchs), tuple(ours.shape))
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def test_host_gather_matches_dtensor_full_tensor_for_every_placement(tmp_path):
    out = str(tmp_path / "results.pt")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # forked, as dtlab forks CPU ranks: each starts with torch and DTensor imported (spawned, each imported them
    # afresh: about 4 CPU-seconds a rank)
    mp.start_processes(_worker, args=(4, f"file://{tmp_path / 'pg'}", out), nprocs=4, join=True, start_method="fork")
    results = torch.load(out)
    assert set(results) == set(CASES)
    bad = {case: shape for case, (same, shape) in results.items() if not same}
    assert not bad, f"host gather differs from DTensor.full_tensor for {bad}"
    assert all(shape == (7, 5) for _, shape in results.values())


def test_plain_tensors_pass_through_unchanged():
    t = torch.arange(6.0)
    assert full_tensor(t) is t
