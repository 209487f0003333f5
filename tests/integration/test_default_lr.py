"""The plain command learns: `dtlab run --model tiny --steps 200 --eval-every 50` with no --lr takes the default for a
randomly initialised tiny model, records it and prints it, and reaches held-out accuracy well above the majority class
(with the fine-tuning rate 2e-5 the same run stays at 0.534 from step 0 to 200). About 45 s on 2 quiet cores; its
own file, so pytest-xdist runs it beside the other files' launches."""

import subprocess
import sys

import dtlab
from dtlab.config.convergence import default_lr


def test_the_plain_tiny_command_learns_at_the_default_lr(tmp_path):
    out = tmp_path / "plain"
    cp = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtlab",
            "run",
            "--model",
            "tiny",
            "--steps",
            "200",
            "--eval-every",
            "50",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    run = dtlab.load_run(str(out))
    want = default_lr("tiny", pretrained=False)
    assert run.config.lr is None and run.resolved["lr"] == want and run.lr == want["value"]
    assert (run.steps["lr"] == want["value"]).all()  # what every optimizer step used
    assert f"  lr:    {want['value']:g}, default for a randomly initialised tiny model" in cp.stdout
    ev = run.evals
    assert list(ev["step"]) == [0, 50, 100, 150, 200]
    assert ev["accuracy"].iloc[0] < 0.6  # before training: about the majority class
    assert ev["accuracy"].iloc[-1] >= 0.85, ev[["step", "accuracy"]].to_dict("records")


# builds and saves models through transformers' DistilBERT classes: about 5 CPU-seconds of imports in a test process
def test_build_model_says_whether_its_weights_are_pretrained(tmp_path):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from dtlab.config.models import TINY_ARCH
    from dtlab.rank.data import build_model

    assert build_model("tiny", "random", None, 0).pretrained is False
    DistilBertForSequenceClassification(DistilBertConfig(num_labels=2, **TINY_ARCH)).save_pretrained(tmp_path)
    loaded = build_model("distilbert", "auto", str(tmp_path), 0)
    assert loaded.pretrained is True and loaded.model_source.startswith("pretrained")
