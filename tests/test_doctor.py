"""`dtlab doctor` on this CPU machine, and what it would say on GPU machines (pure placement per lab)."""

import subprocess
import sys

from dtlab.doctor import lab_placements


def test_doctor_cli_says_no_gpu_and_where_labs_run():
    cp = subprocess.run([sys.executable, "-m", "dtlab", "doctor", "--no-hub"], capture_output=True, text=True,
                        timeout=300)
    assert cp.returncode == 0, cp.stderr
    out = cp.stdout
    assert "GPUs: none visible to torch" in out and "CPU cores:" in out and "deepspeed" in out
    labs = [ln for ln in out.splitlines() if ln.startswith("    ")]
    assert len(labs) == 5 and all("gloo on CPU" in ln for ln in labs)


def test_lab_placements_on_gpu_machines():
    one_old = lab_placements(1, "2.27.5")
    assert "gloo on CUDA tensors" in one_old["01 DDP breakdown"]["label"]
    assert one_old["04 ZeRO-3 vs DDP"]["label"].startswith("NCCL, 1 rank")   # ZeRO-3 needs NCCL
    one_new = lab_placements(1, "2.30.1")
    assert one_new["01 DDP breakdown"]["label"].startswith("NCCL, 2 ranks sharing 1 GPU")
    eight = lab_placements(8, "2.27.5")
    assert eight["03 buckets and GPU count"]["label"] == "NCCL, 8 rank(s), one GPU each"
    assert eight["00 setup check (2-rank all-reduce)"]["label"] == "NCCL, 2 rank(s), one GPU each"
