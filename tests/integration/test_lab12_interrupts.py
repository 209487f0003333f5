"""Lab 12's interrupted run: ranks killed from outside (SIGKILL) at seeded random moments while they train, torchrun
restarting the group from its newest checkpoint each time, and what each interruption cost read back from the
records."""

import dtlab
from dtlab.course.claims import lab12


def test_kills_from_outside_restart_the_group_and_are_priced(tmp_path):
    cfg = dtlab.tiny(out=str(tmp_path), steps=60, baseline_steps=0, checkpoint_every=10, max_restarts=3)
    run, log = lab12.interrupted_run(cfg, kills=2, mean_gap_s=0.4, seed=3)
    assert run.status.get("state") == "finished"
    assert [k["attempt"] for k in log] == [0, 1] and len({k["pid"] for k in log}) == 2  # each kill a live rank
    assert lab12.count_line(run, log, 2, 0.4, 3).endswith("the most it allows (2)")
    assert sorted(run.restarts["attempt"].unique()) == [1, 2]
    assert sorted(run.steps["step"].unique()) == list(range(60))  # every step on the final timeline, once
    costs = lab12.interruption_costs(run, log)
    assert len(costs) == 2 and (costs["resumed_from"] % 10 == 0).all()
    t_step = float(run.summary().set_index("quantity").loc["T_step", "value"])
    cycle = 10 * t_step + float(run.checkpoints["t_save"].max())
    for row in costs.itertuples():
        assert row.cost_s == row.lost_s + row.restart_s
        assert 0 <= row.lost_s < 3 * cycle, (row, cycle)  # at most a cycle of work, and a step's jitter
        assert row.restart_s > 0
