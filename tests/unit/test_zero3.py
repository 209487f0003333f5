"""Real 2-process DeepSpeed ZeRO-3 run of the tiny model on CPU/gloo: every byte accounted for, memory
against DDP, and ZeRO-specific bad input refused before launch."""

import pytest

import dtlab


def test_launch_refuses_bad_zero_config_before_starting(tmp_path):
    out = tmp_path / "bad"
    with pytest.raises(ValueError, match=r"zero\.reduce_bucket_size"):
        dtlab.launch(dtlab.tiny(strategy="zero3", out=str(out), zero=dtlab.ZeroConfig(reduce_bucket_size=0)))
    assert not out.exists()


def test_ds_config_follows_zero_config():
    from dtlab.config.run import ZeroConfig
    from dtlab.rank.strategies.zero3.engine import ds_config

    cfg = dtlab.tiny(
        strategy="zero3",
        zero=ZeroConfig(
            reduce_bucket_size=1234, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0, overlap_comm=False
        ),
    )
    z = ds_config(cfg, 2, hidden=768)["zero_optimization"]
    assert z["stage"] == 3 and z["reduce_bucket_size"] == 1234 and z["overlap_comm"] is False
    assert z["stage3_max_reuse_distance"] == 0 and z["stage3_prefetch_bucket_size"] == 0
    assert z["stage3_param_persistence_threshold"] == 7680  # the one knob left to auto: 10 x 768
    with pytest.raises(ValueError, match="zero.stage3_max_reuse_distance"):
        cfg.replace(zero=ZeroConfig(stage3_max_reuse_distance=-1)).validate(cuda_device_count=0)


def test_ds_config_auto_knobs_follow_the_hidden_size():
    from dtlab.config.run import ZeroConfig
    from dtlab.rank.strategies.zero3.engine import ds_config

    cfg = dtlab.tiny(strategy="zero3")
    assert cfg.zero == ZeroConfig() and cfg.zero.reduce_bucket_size is None
    cfg.validate(cuda_device_count=0)  # None (auto) is a valid value
    z = ds_config(cfg, 2, hidden=768)["zero_optimization"]  # DistilBERT
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (
        589_824,
        530_841,
        7_680,
    )
    with pytest.raises(ValueError, match="hidden size"):
        ds_config(cfg, 2)
    for field in ZeroConfig.AUTO_FIELDS:
        with pytest.raises(ValueError, match=f"zero.{field} must be an integer >= .* or None"):
            ZeroConfig(**{field: -5}).validate()
