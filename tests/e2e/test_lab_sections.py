"""A failed run takes only its own section down: lab 10 with its tensor-parallel run made to fail still runs top to
bottom (Run All in JupyterLab stops at the first exception, so a NameError later would end the lab there).

The lab runs headless in quick mode from a copy whose first cell makes `dtlab.run` raise for the tensor-parallel
config only; the pipeline runs, the calibration and the planner run as usual. About 1.5 minutes on 2 shared cores.
"""

import os

import nbformat
import pytest
from labrun import LABS_DIR

FAIL_TP = """\
import dtlab as _dtlab
_real_run = _dtlab.run
def _failing_run(cfg, *args, **kwargs):   # the tensor-parallel run fails as a rank error would
    if cfg.strategy == "tp":
        raise RuntimeError("rank 1 failed: forced by the test")
    return _real_run(cfg, *args, **kwargs)
_dtlab.run = _failing_run
"""


def test_lab10_runs_on_when_its_tensor_parallel_run_fails(tmp_path, monkeypatch):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(LABS_DIR / "10_tensor_and_pipeline.ipynb", as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(FAIL_TP))
    monkeypatch.setenv("DTLAB_QUICK", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    except CellExecutionError as e:
        pytest.fail(f"a cell raised after the tensor-parallel run failed:\n{str(e)[-2000:]}")
    text = "\n".join(
        o.get("text", "") or o.get("data", {}).get("text/plain", "") for c in nb.cells for o in c.get("outputs", [])
    )
    assert "the tensor-parallel run failed: RuntimeError: rank 1 failed: forced by the test" in text
    assert "[lab10.q1] not checked" in text and "skipped: the tensor-parallel run failed above" in text
    assert "1f1b, M = 4: micro-batches held at once per stage" in text  # the pipeline section ran
    assert len(os.listdir(tmp_path / "runs")) == 3  # the three pipeline runs, no tensor-parallel one
