"""Same inputs in every process, same losses in every launch.

Python salts str hashes per process (PYTHONHASHSEED), so anything keyed on the built-in hash() differs between
ranks and between runs. These tests run the code in separate processes with different salts, so they fail if any
per-process state leaks into tokenization or training.
"""

import json
import os
import subprocess
import sys

import dtlab

_TOKENIZE = """
import json, sys
from dtlab.rank.data import HashingTokenizer, offline_sentences
sents, _ = offline_sentences(16, seed=3)
ids = HashingTokenizer()(sents + ["Zürich naïve café", "the film is dull"], max_length=24)["input_ids"]
print(json.dumps(ids.tolist()))
"""


def _tokenize_in_subprocess(hashseed: str) -> list:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    out = subprocess.run(
        [sys.executable, "-c", _TOKENIZE], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout)


def test_hashing_tokenizer_is_the_same_in_every_process():
    a, b = _tokenize_in_subprocess("1"), _tokenize_in_subprocess("2")
    assert a == b
    # and it is a real mapping: different words get different ids, every id inside the vocabulary
    flat = {i for row in a for i in row}
    assert len(flat) > 20
    assert max(flat) < 30522 and min(flat) >= 0


def test_distilbert_source_names_the_reason(tmp_path):
    """The run table once said 'distilbert-base-uncased: OSError'; the source must say why in words. Run in a
    fresh process with an empty Hugging Face cache, so a cache on the developer's machine cannot change it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "empty-hf-home"))
    code = (
        "from dtlab.rank.data import build_model; print(build_model('distilbert', 'auto', None, seed=0).model_source)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=300
    ).stdout
    assert "random init" in out
    assert "not in the local Hugging Face cache" in out
    assert "HF_HUB_OFFLINE is set" in out


def _start_methods(run) -> set:
    """How the run's ranks were started, from their start events: (start method, agent forked from a warm server)."""
    import glob
    import json

    out = set()
    for path in glob.glob(f"{run.path}/events/rank*.jsonl"):
        with open(path) as f:
            out |= {
                (e.get("start_method"), e.get("warm_agent")) for e in map(json.loads, f) if e.get("kind") == "start"
            }
    return out


def _losses(run) -> dict:
    df = run.steps.sort_values(["rank", "step"])
    return {int(r): g["loss"].tolist() for r, g in df.groupby("rank")}


def test_same_seed_runs_in_separate_launches_have_bit_identical_losses(tmp_path, monkeypatch, tiny_run):
    """Three launches of one tiny config, each with its own hash salt: ranks spawned as fresh interpreters, ranks
    forked from a torchrun agent started afresh, and ranks forked from an agent that a warm server forked (the
    default on CPU): every rank's every loss is equal bit for bit (on CPU with gloo; see RunConfig.deterministic
    for CUDA). A different seed (the shared tiny run's, seed 0) must change them, or the test would pass for a run
    that ignored its data."""
    runs = []
    for salt, method, warm in (("11", "spawn", "0"), ("22", "fork", "0"), ("33", "fork", "1")):
        monkeypatch.setenv("PYTHONHASHSEED", salt)
        monkeypatch.setenv("DTLAB_START_METHOD", method)
        monkeypatch.setenv("DTLAB_WARM_AGENT", warm)
        cfg = dtlab.tiny(out=str(tmp_path / f"r{salt}"), steps=3, warmup=1, baseline_steps=0, seed=5)
        runs.append(dtlab.run(cfg, progress=False))
    a, b, w = (_losses(r) for r in runs)
    assert [_start_methods(r) for r in runs] == [{("spawn", False)}, {("fork", False)}, {("fork", True)}]
    assert a == w
    c = {r: v[:3] for r, v in _losses(tiny_run).items()}
    assert tiny_run.config.seed != 5
    assert set(a) == {0, 1} and all(len(v) == 3 for v in a.values())
    assert a == b  # exact float equality, every rank, every step
    assert a[0] != a[1]  # the ranks see different data
    assert a != c  # the seed matters
    assert "bit-identical" in runs[0].resolved["determinism"]


def test_interleaved_baseline_steps_leave_the_training_bit_identical(tmp_path):
    """Baseline steps run between the training steps (dtlab.config.baseline), with dropout on: every rank's every
    loss, and every held-out evaluation, equal bit for bit those of the same run without baseline steps. Fails for
    a baseline step that steps the optimizer or the schedule, keeps its gradients, or draws dropout masks from the
    training steps' generator without giving its state back."""
    cfg = dict(steps=6, warmup=1, seed=5, eval_every=2, dropout=0.1)
    paired = dtlab.run(dtlab.tiny(out=str(tmp_path / "paired"), baseline_steps=4, **cfg), progress=False)
    plain = dtlab.run(dtlab.tiny(out=str(tmp_path / "plain"), baseline_steps=0, **cfg), progress=False)
    assert _losses(paired) == _losses(plain) and set(_losses(paired)) == {0, 1}
    assert list(paired.evals["loss"]) == list(plain.evals["loss"]) and len(plain.evals) == 4
    b = paired.baseline_steps.sort_values(["rank", "step"])
    assert list(b["paired_step"]) == [2, 3, 4, 5] * 2 and list(b["step"]) == [6, 7, 8, 9] * 2
    assert (b["loss"].to_numpy() != 0).all()
