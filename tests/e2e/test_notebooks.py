"""What each lab printed and recorded, top to bottom in quick mode (tiny model, few steps).

Each lab is executed once per test session by tests/labrun.py: in JupyterLab with a real browser when one is
available (tests/test_browser.py checks the page of the same run), headless otherwise. Here: every graded
question of the rubric was checked (no key in its record), every claim the lab printed follows from its
own numbers (dtlab.course.claims), and each lab's own outputs are there. A new lab needs no line here to be
run and checked; its own output checks are one entry in OUTPUT_CHECKS.
"""

import re

import nbformat
import pytest
from labrun import ANSWERED, LABS, LABS_DIR, drive, error_outputs, outputs_text

from dtlab.course.checks import parse_answers
from dtlab.course.claims import consistent, parse_claims


def rubric(lab):
    """{qid: points} of one lab, from the rubric's tables in labs/README.md."""
    rows = re.findall(r"^\| `(lab\d\d\.\w+)` \| (\d+) \|", (LABS_DIR / "README.md").read_text(), flags=re.M)
    return {q: int(pts) for q, pts in rows if q.startswith(lab + ".")}


def assert_unanswered_and_expected(path, lab, answered=()):
    """Every graded question of the rubric was checked and none raised; no record holds its key; an unanswered
    one says so with 0 points."""
    got = {a["qid"]: a for a in parse_answers(path)}
    want = rubric(lab)
    assert want, f"no rubric rows for {lab} in labs/README.md"
    assert set(got) == set(want), f"recorded {sorted(got)}, rubric {sorted(want)}"
    for qid, a in got.items():
        assert a["max_points"] == want[qid], (qid, a)
        assert "expected" not in a, (qid, a)  # the autograder computes keys itself: dtlab.course.rubric
        if qid in answered:
            continue
        assert a["answer"] in (None, "not implemented") and a["ok"] is None and a["points"] == 0, (qid, a)
        assert "not answered yet" in a["verdict"] or "not implemented" in a["verdict"], (qid, a)
        if a["kind"] == "number":
            assert a["tolerance"] >= 0 and a["tol_source"], (qid, a)
        elif a["kind"] == "choice":
            assert a["choices"], (qid, a)
        elif a["kind"] == "exercise":  # a stub: not implemented, so not answered
            assert a["feedback"], (qid, a)
        else:
            assert a["kind"] == "formula", (qid, a)
    return got


def lab00(run, text):
    assert "dtlab doctor" in text and "where each lab's ranks run" in text
    assert "GPUs: none visible to torch" in text  # this suite runs on CPU machines
    assert "all_reduce of 1,048,576 bytes" in text and "placement: gloo on CPU" in text


def lab01(run, text):
    assert "T_comm" in text and "gradient bytes per rank and step" in text
    assert "all-reduced bytes per rank and step: 4,045,448 B" in text  # formatted, not a list of numpy ints
    assert "trace written" in text and list((run.folder / "runs").glob("*/trace.json"))  # the Perfetto link
    got = {a["qid"]: a for a in parse_answers(run.path)}
    q1, q2 = got["lab01.q1"], got["lab01.q2"]  # the answers typed in by labrun.STUDENT_ANSWERS
    assert q1["ok"] is True and q1["points"] == q1["max_points"] == 2 and q1["answer"] > 0
    assert q2["ok"] is False and q2["answer"] == 1000 and q2["points"] == 0
    assert "never splits a tensor" in text
    assert "The same job on one NVIDIA H200" in text and "DDP, yours" in text  # the recorded run beside this one


def lab02(run, text):
    assert "alpha" in text and "prediction error" in text and "ratios textbook/ring" in text
    assert list((run.folder / "profiles").glob("*/profile.json"))
    assert "The same calibration on one NVIDIA H200" in text and "alpha, H200" in text


def lab03(run, text):
    assert "replay_t_step_ms" in text and "whatif_t_step_ms" in text
    assert len(list((run.folder / "runs" / "lab03-sweep").iterdir())) == 5  # five bucket caps, small to one bucket
    assert "ranks modelled: [2, 4, 8, 16, 64]" in text and "GPUs" in text  # the model's table over GPU counts


def lab04(run, text):
    assert "ZeRO-3 / DDP per rank" in text and "reduce-scatter expected" in text and "ZeRO-3 step communication" in text
    assert "ZeRO-3, yours" in text and "ZeRO-3, H200" in text and "535,640,088" in text  # the recorded runs beside


def lab05(run, text):
    """Three levers run once each in quick mode (three times, interleaved, in full mode), and PowerSGD once; the
    explorer starts from the measured r."""
    assert "powersgd r=1" in text and "largest relative loss difference" in text
    assert "measured: powersgd hook" in text
    assert "times: 1 run(s) per configuration, one run each, in the order none fp16 accumulate 4" in text
    assert len(list((run.folder / "runs").iterdir())) == 4


def lab06(run, text):
    """A straggler beside a reference, ps beside the ring (interleaved), a PS/ring calibration, a crash resumed
    from a checkpoint; numbers formatted with their units."""
    diff = re.search(r"largest loss difference ps vs ring: (\S+)", text)
    assert diff and float(diff.group(1)) < 1e-5  # the server and the ring average the same gradients
    assert "restart: attempt 1 resumed from step 2" in text and "Young's optimum" in text
    assert "exposed " not in text and "overlap " not in text  # the crash run's noisy breakdown is not printed
    assert "bytes per rank-step 4,045,448 B" in text and "np.int64" not in text
    t_step = re.search(r"status finished, T_step ([\d.]+) ms", text)  # the T_step Young's line uses
    young = re.search(r"t_step = ([\d.]+) ms: the T_step printed with the restart above", text)
    assert t_step and young and abs(float(t_step.group(1)) - float(young.group(1))) < 0.1, (t_step, young)


def lab07(run, text):
    """Two emulated nodes make one run; both levels calibrated (the shaped link where this machine permits it)."""
    assert "one job: 2 ranks on 2 nodes (1 per node" in text and "between nodes (" in text and "inside a node:" in text
    assert "np.int64" not in text and "1 ranks" not in text
    from dtlab.launching.emulate import shaping_unavailable

    if shaping_unavailable() is None:  # root with namespaces (CI): the shaped link really was used
        assert "shaped by tc tbf to 1gbit" in text


def lab08(run, text):
    """As committed, lab 8's exercises are stubs: both checks say so, nothing raises, the profile still
    prices the ring."""
    assert "comm_hook: not implemented yet" in text and "ring_allreduce: not implemented yet" in text
    assert "all_reduce, ring form: alpha" in text and "the model with your profile predicts" in text
    assert list((run.folder / "profiles").glob("*/profile.json")) and not (run.folder / "runs").exists()


def lab09(run, text):
    """Four lever runs with held-out accuracy, a calibration; every lever's bytes and steps in one table, the
    asynchronous server's staleness, the model's times, the explorer."""
    assert "held-out split: dtlab's held-out generated sentences (872" in text and "majority" in text
    assert "reached 0.9: baseline at step" in text  # the tiny model learns within quick mode
    assert "every pushed gradient was taken once" in text and "updates applied" in text
    assert "time to target model (s)" in text and "T_step model (ms)" in text
    runs = sorted(p.name for p in (run.folder / "runs").iterdir())
    assert len(runs) == 4 and sum(r.startswith("async") for r in runs) == 1, runs
    assert list((run.folder / "profiles").glob("*/profile.json"))


def lab10(run, text):
    """A tensor-parallel run that trains like one process, three pipeline runs with their bubbles, 1F1B holding P
    micro-batches, the planner against the runs."""
    assert "blocks: run.resolved['n_layers'] = 2; layout {'dp': 1, 'tp': 2, 'pp': 1}" in text
    assert "agreement with one process: equal: every step's loss within" in text
    assert "1f1b, M = 4: micro-batches held at once per stage: {0: 2, 1: 1}" in text
    assert "gpipe, M = 4: micro-batches held at once per stage: {0: 4, 1: 4}" in text
    assert "compute: measured: every stage's forwards and backwards" in text and "interconnect: this machine" in text
    assert len(list((run.folder / "runs").iterdir())) == 4 and list((run.folder / "profiles").glob("*/profile.json"))


def lab12(run, text):
    """A run priced with the example table (its source and date on screen), the scaling table from this lab's
    calibration, C and R from a crash, the spot plan, and a run interrupted three times (fewer only as its records
    explain) with each interruption's cost beside the model's."""
    import dtlab

    assert "price: CPU at $2.00 per machine-hour on-demand" in text and "dated 2026-11-27" in text
    assert (
        "an example price, not a market price" in text and "These are CPU figures, priced as if they were GPUs" in text
    )
    # no answer, no reveal: the bill and the plan wait for questions 1, 2 and 5; the table follows 3 and 4's answers
    assert "answer first: the bill is shown here" in text and "answer first: the plan is shown here" in text
    assert "to accuracy 0.9:" not in text and "spot, exact optimum" not in text
    assert "model: T_step" in text and "at 1 GPU" in text and "all-reduced per step and rank: 4,045,448 B" in text
    assert "model's band:" in text and "cost(p) / cost(1) against 1 / efficiency(p)" in text
    assert "devices: the bill above billed 1 device(s) for this 2-rank run" in text
    assert "on the interrupter's clock (training time only)" in text and "the spot model expects" not in text
    assert "restart: attempt 1 resumed from step 2" in text
    kills = re.search(r"(\d+) kills at Poisson moments", text)
    n = int(kills.group(1)) if kills else 0
    assert n >= 1 and f"this one stopped after {n} kills" in text, text[-2000:]
    # fewer than the 3 planned only when the records show the run reached its last steps before the next was due
    assert n == 3 and "the most it allows (3)" in text or "it reached them first" in text, text[-2000:]
    runs = sorted(p.name for p in (run.folder / "runs").iterdir())
    assert len(runs) == 3, runs
    hit = [r for r in runs if (run.folder / "runs" / r / "checkpoints").exists()]
    restarts = {r: dtlab.load_run(str(run.folder / "runs" / r)).restarts["attempt"].nunique() for r in hit}
    assert sorted(restarts.values()) == sorted([1, n]), restarts  # the crash (1 restart) and the interrupted run


OUTPUT_CHECKS = {
    "00_setup_check.ipynb": lab00,
    "01_ddp_breakdown.ipynb": lab01,
    "02_collectives_alpha_beta.ipynb": lab02,
    "03_buckets_and_gpu_count.ipynb": lab03,
    "04_zero3_vs_ddp.ipynb": lab04,
    "05_shrinking_comm.ipynb": lab05,
    "06_stragglers_ps_faults.ipynb": lab06,
    "07_beyond_one_machine.ipynb": lab07,
    "08_build_it_yourself.ipynb": lab08,
    "09_does_it_still_learn.ipynb": lab09,
    "10_tensor_and_pipeline.ipynb": lab10,
    "12_what_does_it_cost.ipynb": lab12,
}
#: claims each lab must print (ids): the statements about outcomes its text relies on


CLAIMS = {
    "00_setup_check.ipynb": {"lab00.sizes"},
    "01_ddp_breakdown.ipynb": {"lab01.exposed"},
    "03_buckets_and_gpu_count.ipynb": {"lab03.contention", "lab03.whatif"},
    "05_shrinking_comm.ipynb": {"lab05.fp16_bytes", "lab05.accumulate", "lab05.fp16_time"},
    "06_stragglers_ps_faults.ipynb": {"lab06.straggler_wait", "lab06.ps_vs_ring"},
    "07_beyond_one_machine.ipynb": {"lab07.levels", "lab07.backward"},
    "09_does_it_still_learn.ipynb": {
        "lab09.local_bytes",
        "lab09.staleness",
        "lab09.powersgd_later",
        "lab09.composition",
    },
    "10_tensor_and_pipeline.ipynb": {"lab10.tp_allreduces", "lab10.bubble_falls", "lab10.bubble_theory"},
    "12_what_does_it_cost.ipynb": {"lab12.interruptions"},
}


@pytest.mark.parametrize("name", LABS)
def test_lab_runs_top_to_bottom(name):
    run = drive(name)
    errors = error_outputs(run.nb)
    assert not errors, f"{name}: error output:\n" + "\n".join(errors)
    lab = "lab" + name[:2]
    assert_unanswered_and_expected(run.path, lab, answered=ANSWERED.get(name, ()))  # typed in by labrun
    OUTPUT_CHECKS.get(name, lambda run, text: None)(run, outputs_text(run.nb))
    print(f"{name}: ran in {run.seconds:.0f} s ({'browser' if run.browser else 'headless'})")


@pytest.mark.parametrize("name", LABS)
def test_no_printed_claim_contradicts_its_own_numbers(name):
    """Every claim a lab printed: its outcome follows from its numbers, one that does not hold says why, and
    the lab printed the claims its text relies on."""
    run = drive(name)
    claims = parse_claims(run.path)
    assert {c["cid"] for c in claims} >= CLAIMS.get(name, set()), f"{name}: claims {[c['cid'] for c in claims]}"
    problems = [p for c in claims for p in consistent(c)]
    assert not problems, "\n".join(problems)
    text = outputs_text(run.nb)
    assert not re.search(r"\bnan\b", text, flags=re.I), f"{name}: 'nan' in an output"
    for c in claims:  # the sentence on screen is the record's own
        assert f"Outcome: {c['outcome'].upper()}" in text and c["says"] in text, c["cid"]
    decided = [c["cid"] for c in claims if c["unit"] == "s" and c["outcome"] != "inconclusive" and c["ratios"]["n"] < 3]
    assert not decided, f"{name}: claims about time decided from fewer than 3 repeats: {decided}"


def _number_keys(run, lab) -> dict:
    """{answer variable: key} of the lab's number questions, computed by the rubric from the lab's own recordings
    (a question whose sources are not there is left out)."""
    from dtlab.course import rubric
    from dtlab.course.recordings import Recordings

    rec = Recordings(str(run.folder), replay_mode=False)
    sources = rubric.lab_module(lab).sources(rec)
    keys = {}
    for q in rubric.questions(lab):
        if not set(q.needs) <= set(sources):
            continue
        try:
            key = q.key(**{n: sources[n]() for n in q.needs})
        except Exception:  # noqa: BLE001 - a key this test cannot compute is not what it checks
            continue
        if key.kind == "number" and key.expected is not None:
            keys[q.var] = float(key.expected)
    return keys


@pytest.mark.parametrize("name", LABS)
def test_what_a_lab_prints_reads_right(name):
    """No value rounded away to a decimal zero, no doubled word, no key printed before its question
    (dtlab.course.screen)."""
    from dtlab.course.screen import doubled_words, keys_before_questions, notebook_text, rounded_away

    run = drive(name)
    text = notebook_text(run.nb)
    assert not rounded_away(text), f"{name}: values rounded away to a decimal zero: {rounded_away(text)}"
    assert not doubled_words(text), f"{name}: doubled words: {doubled_words(text)}"
    early = keys_before_questions(run.nb, _number_keys(run, name.removesuffix(".ipynb")))
    assert not early, f"{name}: " + "; ".join(early)


def test_notebooks_are_committed_without_outputs():
    for path in list(LABS_DIR.glob("*.ipynb")) + list((LABS_DIR.parent / "instructor").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.outputs and c.execution_count is None, f"{path.name} has stored outputs"
