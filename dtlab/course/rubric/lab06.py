"""Lab 6 (stragglers, the parameter server, faults): growth of rank 0's wait under a 2x straggler, the wait in the
three-worker synchronous-step example, a dedicated server link's bytes as a formula, steps redone after a restart."""

from __future__ import annotations

from dtlab.course.rubric import Question
from dtlab.course.verdicts import Key
from dtlab.model import costmodel
from dtlab.model.restarts import measured_costs
from dtlab.results.stragglers import run_waits, sync_step_model, wait_summary

LAB = "06_stragglers_ps_faults"
EXAMPLE_S = (1.0, 1.2, 1.1)  # three workers' compute per step (s), the lab's synchronous-step example


def sources(rec) -> dict:
    """The reference run, the straggler run (`straggler="1:2"`) and the crashed run (checkpoints every 2 steps,
    one restart)."""

    def cfg():
        return rec.lab_config()

    return {
        "ref": lambda: rec.run(cfg(), "lab 6's reference run"),
        "slow": lambda: rec.run(cfg().replace(straggler="1:2"), "lab 6's straggler run (straggler='1:2')"),
        "crashed": lambda: rec.run(
            cfg().replace(checkpoint_every=2, max_restarts=1),
            "lab 6's crashed and resumed run (checkpoint_every=2, max_restarts=1)",
        ),
    }


def _wait0(run) -> float:
    return float(wait_summary(run_waits(run)).set_index("rank").loc[0, "wait_s"])


def _growth(ref, slow) -> Key:
    return Key(
        "lab06.q1",
        "number",
        1e3 * (_wait0(slow) - _wait0(ref)),
        points=2,
        rel_tol=0.5,
        unit="ms",
        tol_source="50%: the injected delay is (F-1) x rank 1's compute estimated from its last 3 steps, and "
        "compute on shared CPU cores varies from step to step by tens of percent",
        hint="rank 0 finishes its step, then waits for rank 1's extra compute: (2 - 1) x rank 1's compute per "
        "step in the reference run",
    )


def _reference_table(ref) -> list[float]:
    """What the lab prints of the reference run above the question, in ms: each rank's compute and wait per step,
    the inputs of the prediction ((2 - 1) x rank 1's compute), not readings of the straggler run's outcome."""
    w = wait_summary(run_waits(ref))
    return [1e3 * float(v) for v in (*w["t_comp_s"], *w["wait_s"])]


def _example(*_) -> Key:
    seed = sync_step_model(list(EXAMPLE_S))
    return Key(
        "lab06.q2",
        "number",
        1e3 * float(seed.loc[0, "wait_s"]),
        abs_tol=1.0,
        unit="ms",
        tol_source="derived from the synchronous-step model (dtlab.sync_step_model): exact; 1 ms for rounding",
        hint="wait_i = max_j T_comp,j - T_comp,i: the slowest worker sets the pace",
    )


def server_bytes(p, n):
    """Bytes through a dedicated parameter server's link per step (p workers, none on the server's machine):
    costmodel.ps_server's beta term with the server as one more rank that has no gradients of its own."""
    return costmodel.ps_server(0.0, 1.0, n, p + 1)


def _server(*_) -> Key:
    return Key(
        "lab06.q3",
        "formula",
        server_bytes,
        points=2,
        tol_source="exact formula, compared at every point of a grid",
        explanation="all p workers' n bytes cross the link in, and the sum goes back out to each of "
        "them; colocated with worker 0, one of the p pushes and pulls stays on the machine",
        hint="count who pushes n bytes in and who pulls n bytes back out when no worker shares the server's machine",
    )


def _redone(crashed) -> Key:
    return Key(
        "lab06.q4",
        "number",
        int(measured_costs(crashed)["lost_steps"]),
        abs_tol=0,
        unit="steps",
        tol_source="counted from the run's records (run.lost): exact",
        hint="the restart resumes from the newest complete checkpoint: steps after it are trained again",
    )


QUESTIONS = (
    Question("lab06.q1", 2, "my_wait_growth_ms", ("ref", "slow"), _growth, _reference_table, ("ref",)),
    Question("lab06.q2", 1, "my_seed_wait_ms", (), _example),
    Question("lab06.q3", 2, "my_server_bytes", (), _server),
    Question("lab06.q4", 1, "my_steps_redone", ("crashed",), _redone),
)
