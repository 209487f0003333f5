"""Every strategy on the optimizer path a GPU takes by default, forced on a CPU.

torch's AdamW runs its multi-tensor ('foreach') implementation by default on CUDA tensors and a per-parameter loop
on CPU tensors, so a CPU-only suite would never run the path every GPU run takes (on an H200 the tensor-parallel
run crashed there: a group mixing DTensors and plain tensors). Here every strategy trains with
`optimizer_impl='foreach'` (and tensor parallelism also with 'fused'), and:

- the run finishes and records the implementation it ran (`resolved["optimizer"]`);
- tp, pp (both schedules) and fsdp2 train like one process (`reference=True`: losses and gradients of an
  unparallelised copy with torch's plain AdamW, within dtlab.results.reference's tolerances);
- the asynchronous server trains to its end;
- ddp, zero3 and local SGD give the losses of the same run on the per-parameter loop
  (the implementations differ only in rounding: a parameter left out of the optimizer, or a wrong rate, moves the
  losses by far more than LOSS_TOL within three steps).
"""

import math

import pytest

import dtlab

#: Losses of the foreach and for-loop runs of one config may differ by this much (float32 rounding of the same
#: update in another order); measured differences are below 1e-6.
LOSS_TOL = 1e-4
SMALL = dict(batch_size=4, seq_len=32, steps=3, warmup=1, baseline_steps=0)
WITH_REFERENCE = {
    "tp": dict(strategy="tp", reference=True, dropout=0.0),
    "tp-fused": dict(strategy="tp", reference=True, dropout=0.0),
    "pp-gpipe": dict(strategy="pp", microbatches=2, reference=True, dropout=0.0),
    "pp-1f1b": dict(strategy="pp", microbatches=2, pp_schedule="1f1b", reference=True, dropout=0.0),
    "fsdp2": dict(strategy="fsdp2", reference=True, dropout=0.0),
}
AGAINST_LOOP = {
    "ddp": dict(strategy="ddp"),
    "zero3": dict(strategy="zero3"),
    "local-sgd": dict(strategy="ddp", local_sgd=2),
}
#: The asynchronous server applies pushes in arrival order, so two runs need not give the same losses: it is
#: checked to train to the end on the forced path.
ALONE = {"async": dict(strategy="async", nproc=3)}


def _impl(name: str) -> str:
    return "fused" if name.endswith("fused") else "foreach"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every config above on the forced implementation, and the AGAINST_LOOP ones also on the loop; two at a time
    (two cores)."""
    out = tmp_path_factory.mktemp("optim")
    jobs = [(n, _impl(n), kw) for n, kw in {**WITH_REFERENCE, **ALONE}.items()]
    jobs += [(n, impl, kw) for n, kw in AGAINST_LOOP.items() for impl in ("foreach", "for-loop")]
    done = {}
    for i in range(0, len(jobs), 2):
        handles = [
            (n, impl, dtlab.launch(dtlab.tiny(**{**SMALL, **kw}, optimizer_impl=impl, out=str(out / f"{n}-{impl}"))))
            for n, impl, kw in jobs[i : i + 2]
        ]
        for n, impl, h in handles:
            done[(n, impl)] = h.wait(progress=False)
    return done


@pytest.mark.parametrize("name", sorted(WITH_REFERENCE))
def test_model_parallel_strategies_train_like_one_process_on_the_gpu_optimizer_path(runs, name):
    run = runs[(name, _impl(name))]
    assert run.resolved["optimizer"] == {
        "impl": _impl(name),
        "runs": _impl(name),
        "why": "set explicitly (optimizer_impl)",
    }
    check = run.reference_check()
    assert check.ok, check.why
    assert len(check.steps) == 3


def _losses(run) -> list:
    s = run.steps.sort_values(["step", "rank"])
    return [float(x) for x in s["loss"] if not math.isnan(x)]


def test_the_asynchronous_server_trains_on_the_gpu_optimizer_path(runs):
    run = runs[("async", "foreach")]
    assert run.resolved["optimizer"]["runs"] == "foreach"
    assert len(run.updates) >= 3 and run.updates["applied"].any()


@pytest.mark.parametrize("name", sorted(AGAINST_LOOP))
def test_data_parallel_strategies_give_the_loop_losses_on_the_gpu_optimizer_path(runs, name):
    forced, loop = runs[(name, "foreach")], runs[(name, "for-loop")]
    assert forced.resolved["optimizer"]["runs"] == "foreach" and loop.resolved["optimizer"]["runs"] == "for-loop"
    a, b = _losses(forced), _losses(loop)
    assert len(a) == len(b) >= 3
    assert max(abs(x - y) for x, y in zip(a, b)) <= LOSS_TOL, (a, b)
    assert len(set(a)) > 1  # they trained: a loss curve that never moves would match trivially


def test_auto_records_torchs_default_for_the_device(tmp_path):
    run = dtlab.run(dtlab.tiny(steps=2, baseline_steps=0, out=str(tmp_path / "auto")), progress=False)
    assert run.resolved["optimizer"] == {"impl": "auto", "runs": "for-loop", "why": "torch's default for cpu tensors"}
