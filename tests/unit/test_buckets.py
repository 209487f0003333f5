import math

import numpy as np
import pytest

from dtlab.model import buckets as bk


def test_mb_to_bytes_is_mib():
    assert bk.mb_to_bytes(25) == 25 * 1024 * 1024
    assert bk.mb_to_bytes(0.5) == 524288
    with pytest.raises(ValueError, match="bucket_mb"):
        bk.mb_to_bytes(0)


def test_layout_first_bucket_cap_and_oversized():
    sizes = [40, 70, 30, 30, 500, 10, 20]
    # first cap 100: 40+70=110 >= 100 closes bucket 0
    # cap 100 afterwards: 30+30=60, +500=560 >= 100 closes; then 10+20 left over
    layout = bk.bucket_layout(sizes, bucket_cap_bytes=100, first_bucket_cap_bytes=100)
    assert layout == [[0, 1], [2, 3, 4], [5, 6]]
    # a small first cap makes the first bucket a single tensor
    layout = bk.bucket_layout(sizes, bucket_cap_bytes=100, first_bucket_cap_bytes=10)
    assert layout == [[0], [1, 2], [3, 4], [5, 6]]


def test_layout_oversized_tensor_alone_and_exact_fill():
    # 200 > cap alone in its bucket; 50+50 == cap closes exactly at the cap
    layout = bk.bucket_layout([200, 50, 50, 1], bucket_cap_bytes=100, first_bucket_cap_bytes=100)
    assert layout == [[0], [1, 2], [3]]


def test_layout_conserves_bytes_and_order():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 5_000_000, size=200)
    layout = bk.bucket_layout(sizes, bk.mb_to_bytes(1))
    flat = [i for b in layout for i in b]
    assert flat == list(range(len(sizes)))
    assert bk.bucket_sizes(sizes, layout).sum() == sizes.sum()
    assert bk.bucket_layout([], 100) == []


def test_queue_queueing():
    # bucket 1 is ready at 1.5 while bucket 0 runs until 3: it waits
    start, end = bk.simulate_queue([1.0, 1.5, 10.0], [2.0, 1.0, 0.5])
    assert np.allclose(start, [1.0, 3.0, 10.0])
    assert np.allclose(end, [3.0, 4.0, 10.5])


def test_all_overlap():
    # fwd 1, bwd compute 1..5; comm finishes at 3.5 < 5
    r = bk.predict_step(1.0, 4.0, 0.5, ready=[2.0, 3.0], durations=[0.5, 0.5])
    assert r["exposed"] == 0.0
    assert r["t_comm"] == pytest.approx(1.0)
    assert r["t_comm_end"] == pytest.approx(3.5)
    assert r["t_step"] == pytest.approx(5.5)
    assert r["t_comp"] == pytest.approx(5.5)
    assert r["overlap"] == pytest.approx(1.0)


def test_no_overlap():
    # all buckets ready when backward ends at 5: comm 5..5.5..6.5..7
    r = bk.predict_step(1.0, 4.0, 0.5, ready=[5.0, 5.0, 5.0], durations=[0.5, 1.0, 0.5])
    assert r["exposed"] == pytest.approx(2.0)
    assert r["t_step"] == pytest.approx(5.0 + 2.0 + 0.5)
    assert r["overlap"] == pytest.approx(0.0)


def test_partial_overlap():
    # fwd 1, bwd 1..5, ready 3,4,5, durations 1.5,1.5,1
    # b0: 3.0-4.5; b1: max(4,4.5)=4.5-6.0; b2: max(5,6)=6.0-7.0
    # exposed = 7-5 = 2; t_comm = 4; overlap = 1 - 2/4 = 0.5
    # t_step = 1 + max(4, 7-1) + 0.5 = 7.5
    r = bk.predict_step(1.0, 4.0, 0.5, ready=[3.0, 4.0, 5.0], durations=[1.5, 1.5, 1.0])
    assert np.allclose(r["start"], [3.0, 4.5, 6.0])
    assert np.allclose(r["end"], [4.5, 6.0, 7.0])
    assert r["exposed"] == pytest.approx(2.0)
    assert r["t_comm"] == pytest.approx(4.0)
    assert r["overlap"] == pytest.approx(0.5)
    assert r["t_step"] == pytest.approx(7.5)
    assert r["t_step"] == pytest.approx(r["t_comp"] + r["exposed"])


def test_no_buckets_overlap_nan():
    r = bk.predict_step(1.0, 2.0, 0.5, ready=[], durations=[])
    assert r["t_comm"] == 0.0 and r["exposed"] == 0.0
    assert r["t_step"] == pytest.approx(3.5)
    assert math.isnan(r["overlap"])


def test_queue_bad_input():
    with pytest.raises(ValueError, match="same length"):
        bk.simulate_queue([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="durations"):
        bk.simulate_queue([1.0], [-1.0])
    with pytest.raises(ValueError, match="t_fwd"):
        bk.predict_step(-1.0, 1.0, 1.0, [1.0], [1.0])


def test_whatif_ready_times():
    # bytes 1,1,2 of 4: ready at 1 + 4*[0.25, 0.5, 1.0]
    assert np.allclose(bk.whatif_ready_times(1.0, 4.0, [1, 1, 2]), [2.0, 3.0, 5.0])
    with pytest.raises(ValueError, match="bucket_nbytes"):
        bk.whatif_ready_times(1.0, 4.0, [0, 0])


def test_distilbert_layout_matches_a_measured_ddp_run():
    # Bucket bytes of a steady step of `dtlab run --model distilbert --bucket-mb 25` (torch 2.13, gloo):
    # DDP given bucket_cap_mb uses the cap for the first bucket too.
    from dtlab.model.whatif import distilbert_param_nbytes

    sizes = list(reversed(distilbert_param_nbytes()))
    cap = bk.mb_to_bytes(25)
    layout = bk.bucket_layout(sizes, cap, first_bucket_cap_bytes=cap)
    assert list(bk.bucket_sizes(sizes, layout)) == [28357640] + [28351488] * 5 + [97704960]
