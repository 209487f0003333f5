"""The GPU rules that CPU can check: where ranks are placed on machines with 0, 1 or many GPUs (pure), and the
DDP hook's order of operations (divide, then "ready", then issue; end in the completion callback), which is
one code path for gloo and NCCL."""

import dtlab


def test_ddp_run_records_ddp_timer_beside_its_own(tiny_run):
    """The real 2-rank run writes DDP's own per-step timer for the measured steps, and dtlab's span of the
    same rank-steps lands near it (two clocks on the same events: a 50% band catches a unit or step mix-up,
    e.g. nanoseconds read as seconds or step k paired with step k-1)."""
    st = tiny_run.ddp_stats
    assert set(st["rank"]) == {0, 1}
    measured = set(range(tiny_run.warmup, tiny_run.config.steps))
    assert measured - {tiny_run.config.steps - 1} <= set(st["step"])
    row = tiny_run.crosscheck().set_index("quantity").loc["backward communication span vs DDP's timer"]
    assert row["pairs"] >= 2 and abs(row["median_rel_diff"]) < 0.5


def test_emulated_nodes_run_gloo():
    """Nodes emulated on one machine share its GPUs and talk over gloo's sockets (the emulated link)."""
    from dtlab.launching.emulate import Emulation

    em = Emulation(2)
    assert em.prepare(dtlab.RunConfig(nproc=1, out="/tmp/x"), "runs/x").backend == "gloo"
    assert em.prepare(dtlab.RunConfig(nproc=1, backend="nccl", out="/tmp/x"), "runs/x").backend == "nccl"
