"""The communication levers on the tiny model with 2 gloo ranks: compression through torch's own DDP hooks
(bytes on the wire recorded per bucket) and gradient accumulation; bad combinations refused before launch."""

import types

import pytest

from dtlab.config.rules import levers
from dtlab.config.run import tiny
from dtlab.config.strategies import strategy_spec
from dtlab.model.compression import powersgd_wire_numel


def test_powersgd_wire_numel_by_hand():
    # 768 x 768 at rank 4: P and Q, (768 + 768) x 4; a bias travels whole; a 2 x 768 classifier is not worth
    # compressing at rank 1 ((2 + 768) x 1 x 2 >= 1536); a conv-like 4-D weight is viewed as n x (prod of the rest)
    assert powersgd_wire_numel([(768, 768)], 4) == 1536 * 4
    assert powersgd_wire_numel([(768,)], 4) == 768
    assert powersgd_wire_numel([(2, 768)], 1) == 1536
    assert powersgd_wire_numel([(64, 3, 8, 8)], 2) == (64 + 192) * 2
    assert powersgd_wire_numel([(768, 768), (768,)], 1) == 1536 + 768
    with pytest.raises(ValueError, match="rank"):
        powersgd_wire_numel([(4, 4)], 0)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(comm_hook="int8"), "comm_hook"),
        (dict(accumulate=0), "accumulate"),
        (dict(powersgd_rank=0), "powersgd_rank"),
        (dict(powersgd_start_iter=1), "powersgd_start_iter"),
        (dict(comm_hook="powersgd", strategy="zero3"), "comm_hook 'powersgd' applies to strategy 'ddp'"),
        (dict(accumulate=2, strategy="zero3"), "accumulate 2 applies to strategy 'ddp'"),
        (dict(comm_hook="fp16", record=False), "needs record=True"),
    ],
)
def test_bad_levers_are_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=field):
        tiny(**changes).validate(cuda_device_count=0)


def test_bf16_refused_for_gloo_on_cuda_tensors():
    cfg = tiny(comm_hook="bf16")
    levers(cfg, strategy_spec(cfg.strategy), types.SimpleNamespace(backend="gloo", device="cpu"))
    levers(cfg, strategy_spec(cfg.strategy), types.SimpleNamespace(backend="nccl", device="cuda"))
    with pytest.raises(ValueError, match="bf16"):
        levers(cfg, strategy_spec(cfg.strategy), types.SimpleNamespace(backend="gloo", device="cuda"))
