"""Shared fixtures. Real runs use the tiny model on CPU with gloo and 2 ranks; nothing needs the hub."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never wait on the hub in tests


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One real 2-rank gloo DDP run of the tiny model, shared by the tests that only read it."""
    import dtlab
    out = tmp_path_factory.mktemp("runs") / "tiny"
    # 0.05 MiB buckets: the tiny model's 3.9 MB embedding gets its own bucket and the rest splits up.
    cfg = dtlab.tiny(out=str(out), steps=4, baseline_steps=2, bucket_mb=0.05)
    return dtlab.run(cfg, progress=False)
