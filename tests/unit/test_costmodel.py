import numpy as np
import pytest

from dtlab.model import costmodel as cm
from dtlab.model.link import Link

A, B, N, P = 1e-5, 1e-9, 1e6, 4  # alpha s, beta s/B, bytes, processes


def test_textbook_allreduce_hand():
    # 1e-5*3 + 1e-9*1e6/4 = 3e-5 + 2.5e-4
    assert cm.textbook_allreduce(A, B, N, P) == pytest.approx(2.8e-4)


def test_textbook_zero3_hand():
    # 1e-5*3 + 2*1e-9*1e6/4 = 3e-5 + 5e-4
    assert cm.textbook_zero3(A, B, N, P) == pytest.approx(5.3e-4)


def test_parameter_server_hand():
    # 1e-5 + 1e-9*1e6 = 1.01e-3, independent of p
    assert cm.parameter_server(A, B, N, P) == pytest.approx(1.01e-3)
    assert cm.parameter_server(A, B, N, 64) == pytest.approx(1.01e-3)


def test_textbook_compressed_hand():
    # 1e-5*3 + 1e-9*0.25*1e6/4 = 3e-5 + 6.25e-5
    assert cm.textbook_compressed_allreduce(A, B, N, P, ratio=0.25) == pytest.approx(9.25e-5)
    with pytest.raises(ValueError, match="ratio"):
        cm.textbook_compressed_allreduce(A, B, N, P, ratio=0)


def test_ring_hand():
    # all_reduce: 2*3*1e-5 + 2*3/4*1e6*1e-9 = 6e-5 + 1.5e-3
    assert cm.ring_allreduce(A, B, N, P) == pytest.approx(1.56e-3)
    # reduce_scatter / all_gather: 3*1e-5 + 3/4*1e6*1e-9 = 3e-5 + 7.5e-4
    assert cm.ring_reduce_scatter(A, B, N, P) == pytest.approx(7.8e-4)
    assert cm.ring_all_gather(A, B, N, P) == pytest.approx(7.8e-4)


def test_ring_allreduce_is_rs_plus_ag():
    p = np.array([2, 3, 8, 64])
    n = np.array([1e3, 1e5, 1e7, 1e9])
    assert np.allclose(
        cm.ring_allreduce(A, B, n, p), cm.ring_reduce_scatter(A, B, n, p) + cm.ring_all_gather(A, B, n, p)
    )


def test_single_process_is_free():
    for fn in (
        cm.textbook_allreduce,
        cm.textbook_zero3,
        cm.parameter_server,
        cm.ring_allreduce,
        cm.ring_reduce_scatter,
        cm.ring_all_gather,
    ):
        assert fn(A, B, N, 1) == 0.0
    for op in cm.OPS:
        for form in cm.FORMS:
            assert cm.coefficients(op, form, 1) == (0.0, 0.0)


def test_coefficients_and_collective_time():
    assert cm.coefficients("all_reduce", "ring", 4) == pytest.approx((6.0, 1.5))
    assert cm.coefficients("all_gather", "ring", 4) == pytest.approx((3.0, 0.75))
    assert cm.coefficients("reduce_scatter", "textbook", 4) == pytest.approx((3.0, 0.25))
    assert cm.collective_time("all_reduce", "textbook", A, B, N, P) == pytest.approx(2.8e-4)
    a, b = cm.coefficients("all_reduce", "ring", np.array([1, 2, 4]))
    assert np.allclose(a, [0, 2, 6]) and np.allclose(b, [0, 1, 1.5])


def test_vectorised_returns_array_scalar_returns_float():
    out = cm.ring_allreduce(A, B, np.array([0.0, N]), P)
    assert isinstance(out, np.ndarray) and np.allclose(out, [6e-5, 1.56e-3])
    assert isinstance(cm.ring_allreduce(A, B, N, P), float)


def test_bad_arguments():
    with pytest.raises(ValueError, match="op"):
        cm.coefficients("broadcast", "ring", 4)
    with pytest.raises(ValueError, match="form"):
        cm.coefficients("all_reduce", "tree", 4)
    with pytest.raises(ValueError, match="nproc"):
        cm.ring_allreduce(A, B, N, 0)
    with pytest.raises(ValueError, match="nproc"):
        cm.ring_allreduce(A, B, N, 2.5)
    with pytest.raises(ValueError, match="nbytes"):
        cm.ring_allreduce(A, B, -1, 4)
    with pytest.raises(ValueError, match="seconds"):
        cm.algbw(N, 0)


def test_bandwidths_hand():
    # algbw = 1e6 / 1e-3 = 1e9 B/s
    assert cm.algbw(N, 1e-3) == pytest.approx(1e9)
    # all_reduce busbw = 1e9 * 2*3/4 = 1.5e9; others 1e9 * 3/4
    assert cm.busbw("all_reduce", N, 1e-3, 4) == pytest.approx(1.5e9)
    assert cm.busbw("all_gather", N, 1e-3, 4) == pytest.approx(7.5e8)
    assert cm.busbw("reduce_scatter", N, 1e-3, 4) == pytest.approx(7.5e8)
    assert cm.busbw("all_reduce", N, 1e-3, 1) == 0.0


def test_busbw_of_ring_prediction_is_link_bandwidth():
    # with alpha=0 the ring moves data at 1/beta bytes/s on every link
    for op in cm.OPS:
        t = cm.collective_time(op, "ring", 0.0, B, N, 8)
        assert cm.busbw(op, N, t, 8) == pytest.approx(1 / B)


def test_zero3_step_comm_hand():
    # ring, P=1e6 params bytes with 2e5 persistent, G=1e6 grads, p=4
    # all_gather of 8e5: 3e-5 + 0.75*8e5*1e-9 = 3e-5 + 6e-4 = 6.3e-4 (twice)
    # reduce_scatter of 1e6: 3e-5 + 7.5e-4 = 7.8e-4
    d = cm.zero3_step_comm(Link(alpha=A, beta=B), 1e6, 1e6, P, persistent_bytes=2e5)
    assert d["all_gather_fwd"] == pytest.approx(6.3e-4)
    assert d["all_gather_bwd"] == pytest.approx(6.3e-4)
    assert d["reduce_scatter"] == pytest.approx(7.8e-4)
    assert d["total"] == pytest.approx(2 * 6.3e-4 + 7.8e-4)
    # textbook, no persistent: each part 3e-5 + 1e6*1e-9/4 = 2.8e-4, total 8.4e-4
    d = cm.zero3_step_comm(Link(alpha=A, beta=B, form="textbook"), 1e6, 1e6, P)
    assert d["total"] == pytest.approx(8.4e-4)
    with pytest.raises(ValueError, match="persistent_bytes"):
        cm.zero3_step_comm(Link(alpha=A, beta=B), 1e6, 1e6, P, persistent_bytes=2e6)
