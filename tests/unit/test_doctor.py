"""`dtlab doctor` on this CPU machine, and what it would say on GPU machines (pure placement per lab)."""

import pathlib

import pytest

from dtlab.cli.doctor import lab_files, lab_placements
from dtlab.course.labs import LABS

LABS_DIR = pathlib.Path(__file__).resolve().parents[2] / "labs"


NOTEBOOKS = sorted(p.stem for p in LABS_DIR.glob("[0-9][0-9]_*.ipynb"))


def test_every_lab_notebook_is_described():
    """A lab added to labs/ without saying what it runs would be reported as unknown by the doctor."""
    assert len(NOTEBOOKS) >= 9 and lab_files(str(LABS_DIR)) == NOTEBOOKS
    assert {n[:2] for n in NOTEBOOKS} <= set(LABS)


def test_an_undescribed_lab_is_reported_as_unknown(tmp_path):
    for stem in ("01_ddp_breakdown", "42_new_lab"):
        (tmp_path / f"{stem}.ipynb").write_text("{}")
    got = lab_placements(0, None, labs_dir=str(tmp_path))
    assert list(got) == ["01 DDP breakdown", "42_new_lab"]
    assert "not described" in got["42_new_lab"]["label"]


def _parts(ngpu, nccl, lab):
    key = next(k for k in lab_placements(ngpu, nccl) if k.startswith(lab))
    return {p["what"]: p for p in lab_placements(ngpu, nccl)[key]["parts"]}


@pytest.mark.parametrize("nccl", ["2.28.9", "2.27.5"])
def test_one_gpu_with_older_nccl(nccl):
    """torch 2.11's NCCL: every lab's ranks share the GPU over gloo, ZeRO-3 included; nothing refused."""
    everything = lab_placements(1, nccl)
    assert len(everything) == len(NOTEBOOKS)
    for lab, p in everything.items():
        for q in p["parts"]:
            assert not q["label"].startswith("cannot run"), (lab, q)
    z3 = _parts(1, nccl, "04")["ZeRO-3 run"]
    assert z3["label"].startswith("gloo on CUDA tensors, 2 ranks on 1 GPU") and "over gloo" in z3["note"]
    assert "CUDA events" in z3["timing"] and "host memory" in z3["timing"]
    assert "gloo on CUDA tensors" in _parts(1, nccl, "01")["DDP run"]["label"]
    assert _parts(1, nccl, "08")["exercises (2 ranks on CPU tensors, by design)"]["label"].startswith("gloo on CPU")
    emulated = next(q for w, q in _parts(1, nccl, "07").items() if w.startswith("2 emulated nodes"))
    assert emulated["label"].startswith("gloo on CUDA tensors")


def test_doctor_says_how_to_get_an_nccl_that_shares_a_gpu():
    from dtlab.cli.doctor import report

    base = {
        "python": "3.12.3",
        "torch": "2.11.0+cu130",
        "cuda_build": "13.0",
        "cpu_cores": 16,
        "gpus": [{"name": "NVIDIA H200", "memory_gib": 139.8}],
        "labs": {},
    }
    old = report({**base, "nccl": "2.28.9"})
    assert "pip install 'nvidia-nccl-cu13>=2.30'" in old and "DTLAB_NCCL_LIBRARY=/path/to/libnccl.so.2" in old
    assert "(ncclGetVersion)" in old and "torch.cuda.nccl.version() cannot tell" in old  # the header, not the library
    assert "requires the NCCL 2.28.9" in old
    assert "pip install" not in report({**base, "nccl": "2.30.1"})  # nothing to do: ranks already share it
    assert "pip install" not in report({**base, "gpus": [], "nccl": None})  # no GPU: no NCCL advice
    assert "nvidia-nccl-cu12>=2.30" in report({**base, "cuda_build": "12.8", "nccl": "2.27.5"})


def test_one_gpu_with_nccl_230_and_eight_gpus():
    assert _parts(1, "2.30.1", "01")["DDP run"]["label"].startswith("NCCL, 2 ranks sharing 1 GPU")
    assert _parts(1, "2.30.1", "04")["ZeRO-3 run"]["label"].startswith("NCCL, 2 ranks sharing 1 GPU")
    assert _parts(8, "2.28.9", "03")["DDP runs"]["label"] == "NCCL, 8 ranks, one GPU each"
    assert _parts(8, "2.28.9", "03")["sweep at 2 ranks"]["label"] == "NCCL, 2 ranks, one GPU each"
    assert _parts(8, "2.28.9", "00")["2-rank all-reduce"]["label"] == "NCCL, 2 ranks, one GPU each"
    assert _parts(8, "2.28.9", "04")["ZeRO-3 run"]["label"] == "NCCL, 8 ranks, one GPU each"


def test_the_gpu_docs_say_what_the_code_does():
    """docs/gpus.md's lab table and timing words are what dtlab.course.labs and dtlab.config.placement say (a changed
    placement or timing that the page does not follow fails here)."""
    import re

    from dtlab.cli.doctor import doc_blocks

    text = (LABS_DIR.parent / "docs" / "gpus.md").read_text()
    for name, block in doc_blocks().items():
        m = re.search(rf"<!-- {name}: begin -->\n(.*?)\n<!-- {name}: end -->", text, re.S)
        assert m and m.group(1) == block, f"docs/gpus.md's {name} is stale: paste dtlab.cli.doctor.doc_blocks()"
    for machine in ("CPU machine", "One GPU, NCCL 2.28.9", "One GPU, NCCL >= 2.30", "Several GPUs"):
        assert f"**{machine}.**" in text
