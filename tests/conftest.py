"""Shared fixtures and the tiers. Real runs use the tiny model on CPU with gloo and 2 ranks; nothing needs the hub.

Tiers, one folder each, marked by folder (select with -m):
- tests/unit: no launch, no torchrun, no notebook kernel; the whole tier in under a minute
  (`pytest tests/unit -n auto`);
- tests/integration: real torchrun launches on gloo (the tiny model, 2-4 ranks);
- tests/e2e: notebooks executed in JupyterLab and Chromium, grading, the GPU runbook's dry run, the docs build;
- tests/gpu: needs a CUDA GPU; skips with the reason on a machine without one.
"""

import os
import pathlib
import re
import sys

import pytest

# nbformat validates notebooks with jsonschema, which imports rfc3987-syntax (installed by jupyter-events) for its
# "iri" format checker; that package builds an Earley grammar at import, which took about 4 s of collecting
# tests/unit in a process that holds torch (8.4 s with it, 4.1 s without). No schema the tests validate uses that
# format; the graders do the same (dtlab.course.grader.without_iri_grammar).
sys.modules.setdefault("rfc3987_syntax", None)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never wait on the hub in tests
# Every process a test starts (notebook kernels, graders, the command line, torchrun's ranks) imports the dtlab of
# this checkout, not whichever copy happens to be installed in the environment.
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _ROOT]
)

TIERS = ("unit", "integration", "e2e", "gpu")
HERE = pathlib.Path(__file__).resolve().parent


#: Files whose tests share one execution of each lab (tests/labrun.py caches it per process): with pytest-xdist
#: every lab's tests go to the worker of its lab group (`_lab_group`: two groups), which runs its labs one after
#: another in one JupyterLab and one browser. Paths from tests/ (a unit file may share an integration file's name).
LAB_FILES = ("e2e/test_notebooks.py", "e2e/test_browser.py", "e2e/test_export.py", "e2e/test_no_key.py")

#: Files whose tests are marked slow: every lab executed in a browser (and the checks of that run), assigning and
#: grading whole batches, the sandbox drills, the GPU runbook's dry run, multi-node and Slurm jobs, the convergence
#: and determinism runs, a dying launcher, the warm agent server's drills and the straggler runs. The README's test
#: command leaves them out (`-m "not slow"`) to stay within 8 minutes on 2 cores; CI runs them as a leg of their own
#: in the same environment (`-m slow`). Paths from tests/: the unit tests of the same names are not slow.
SLOW_FILES = LAB_FILES + (
    "e2e/test_assign_grade.py",
    "e2e/test_sandbox_drills.py",
    "e2e/test_lab_sections.py",
    "e2e/test_runbook.py",
    "integration/test_multinode.py",
    "integration/test_slurm_emulate.py",
    "integration/test_convergence.py",
    "integration/test_default_lr.py",
    "integration/test_determinism.py",
    "integration/test_launcher_death.py",
    "integration/test_warm_agent.py",
    "integration/test_stragglers.py",
    "integration/test_lab12_interrupts.py",
    "e2e/test_monitor_browser.py",
)

#: The labs' tests are two groups, so two workers run the labs side by side, each in its own JupyterLab and
#: Chromium: these labs in one, the others (a new lab too) in the other, about even by their time in a browser.
#: A lab's tests always share its group: tests/labrun.py runs each lab once per worker.
LABS_A = ("00", "03", "04", "08", "09", "11")


def _lab_group(nodeid: str) -> str:
    """'labs-a' or 'labs-b' for a lab file's test, by the lab number in its parameter or its name."""
    m = re.search(r"\[(\d\d)_|::test_lab(\d\d)_", nodeid)
    number = next((g for g in m.groups() if g), None) if m else None
    return "labs-a" if number in LABS_A else "labs-b"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the xdist_group marks into node ids
def pytest_collection_modifyitems(config, items):
    """Mark every test with its folder's tier (a test outside the tier folders is an error, not a silent extra) and
    with the group pytest-xdist keeps on one worker (`--dist loadgroup`): a lab's tests in its lab group (two
    groups for all the labs), else a file's (so a module's shared runs are made once); the slow files' tests
    are marked slow."""
    missing = [f for f in SLOW_FILES if not (HERE / f).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW_FILES names files that are not there: {missing}")
    for item in items:
        rel = pathlib.Path(str(item.path)).resolve().relative_to(HERE)
        tier = rel.parts[0] if len(rel.parts) > 1 else None
        if tier not in TIERS:
            raise pytest.UsageError(f"tests/{rel}: every test lives in one of tests/{', tests/'.join(TIERS)}")
        item.add_marker(getattr(pytest.mark, tier))
        path = rel.as_posix()
        if path in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        own = item.get_closest_marker("xdist_group")
        if path in LAB_FILES and own is not None:
            raise pytest.UsageError(
                f"{item.nodeid}: a lab test names its own xdist group {own.args}: it would run its "
                "lab a second time on another worker; a lab's tests share their lab's group (_lab_group)"
            )
        if own is None:
            item.add_marker(pytest.mark.xdist_group(_lab_group(item.nodeid) if path in LAB_FILES else str(rel)))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One real 2-rank gloo DDP run of the tiny model, shared by the tests that only read it."""
    import dtlab

    out = tmp_path_factory.mktemp("runs") / "tiny"
    # 0.05 MiB buckets: the tiny model's 3.9 MB embedding gets its own bucket and the rest splits up.
    cfg = dtlab.tiny(out=str(out), steps=4, baseline_steps=2, bucket_mb=0.05)
    return dtlab.run(cfg, progress=False)
