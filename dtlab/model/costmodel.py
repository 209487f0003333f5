"""Alpha-beta cost formulas for collective communication.

Units everywhere: ``alpha`` in seconds (per-message latency), ``beta`` in
seconds per byte (inverse bandwidth), ``nbytes`` in bytes, results in seconds.

Message size follows the nccl-tests convention: ``nbytes`` is the *full*
message size -- the tensor for all_reduce, the (gathered) output for
all_gather, the (unreduced) input for reduce_scatter.

Two families are provided so that they can be shown side by side.

``textbook`` (the simplified forms many course texts teach)
    all_reduce:      T = alpha (p-1) + beta n / p
    ZeRO-3 step:     T = alpha (p-1) + 2 beta n / p
    parameter server T = alpha + beta n
    compressed:      T = alpha (p-1) + beta r n / p
    For reduce_scatter and all_gather this family uses the same per-op form
    as its all_reduce, alpha (p-1) + beta n / p, so that one all-gather plus
    one reduce-scatter gives the ``2 beta n / p`` of the ZeRO-3 formula.

``ring`` (bandwidth-optimal ring; for op ``ps``, one server link)
    reduce_scatter:  T = (p-1) alpha + (p-1)/p n beta
    all_gather:      T = (p-1) alpha + (p-1)/p n beta
    all_reduce:      T = 2(p-1) alpha + 2(p-1)/p n beta
    ps:              T = 2 alpha + 2(p-1) n beta   (at the server: see ps_server)

Op ``ps`` (parameter server: reduce to rank 0, broadcast back) is per worker in
the textbook family (alpha + beta n, flat in p) and at the server's one link in
the other (2 alpha + 2(p-1) n beta, growing with p); in both, its bandwidth
term is p times the same family's all-reduce term. :mod:`dtlab.model.ps`
sets these beside what gloo's and NCCL's reduce + broadcast really do.

Where and why they differ: a ring all-reduce *is* a reduce-scatter followed
by an all-gather, so it pays both latency chains, 2(p-1) alpha rather than
(p-1) alpha, and every rank sends and receives 2(p-1)/p n bytes, which tends
to 2n as p grows. The textbook bandwidth term beta n / p counts only one
rank's share of the data and drops the factor 2, so it *shrinks* with p;
for large p the two bandwidth terms disagree by a factor of about 2p. The
ring form is what NCCL/Gloo actually approach on a single ring; the textbook
form is kept because it is what the course material states.

With one process (p = 1) both families return 0 seconds for every
collective: there is no peer to exchange data with, so nothing is
communicated. (A real library still spends a few microseconds on a 1-rank
call; :mod:`dtlab.model.fit` leaves p = 1 measurements out of the fit for this
reason.)
"""

from __future__ import annotations

import numpy as np

OPS = ("all_reduce", "reduce_scatter", "all_gather", "ps")
FORMS = ("textbook", "ring")


def scalar_or_array(x):
    """Return a Python float for 0-d results, else the ndarray unchanged."""
    x = np.asarray(x, dtype=float)
    return float(x) if x.ndim == 0 else x


def check_nproc(nproc) -> np.ndarray:
    p = np.asarray(nproc, dtype=float)
    if np.any(~np.isfinite(p)) or np.any(p < 1) or np.any(p != np.round(p)):
        raise ValueError(f"nproc must be an integer >= 1 (number of processes), got {nproc!r}")
    return p


def check_nbytes(nbytes) -> np.ndarray:
    n = np.asarray(nbytes, dtype=float)
    if np.any(~np.isfinite(n)) or np.any(n < 0):
        raise ValueError(f"nbytes must be finite and >= 0 (bytes), got {nbytes!r}")
    return n


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")


# ---------------------------------------------------------------- textbook


def textbook_allreduce(alpha, beta, nbytes, nproc):
    """Textbook all-reduce time in seconds: alpha (p-1) + beta n / p.

    alpha: seconds; beta: seconds per byte; nbytes: tensor size in bytes;
    nproc: number of processes p. Returns 0 for p = 1.
    """
    return collective_time("all_reduce", "textbook", alpha, beta, nbytes, nproc)


def textbook_zero3(alpha, beta, nbytes, nproc):
    """Textbook ZeRO-3 step communication in seconds: alpha (p-1) + 2 beta n / p.

    nbytes is the full (unsharded) parameter size in bytes. This is the seed
    text's shortcut (one gather plus one reduce-scatter, latency counted
    once); :func:`zero3_step_comm` gives the per-collective breakdown.
    Returns 0 for p = 1.
    """
    p = check_nproc(nproc)
    n = check_nbytes(nbytes)
    a, b = coefficients("all_reduce", "textbook", p)
    return scalar_or_array(alpha * a + 2.0 * beta * b * n)


def parameter_server(alpha, beta, nbytes, nproc):
    """Textbook parameter-server time in seconds, **per worker**: alpha + beta n.

    One message of n bytes over the worker's own link (the simplified textbook form;
    like its all-reduce form it counts the data once: push, with the pull
    not counted or overlapped). Assumes the server is never the bottleneck
    (its link is p-1 times faster, or the server is sharded), so it is flat
    in p while the textbook all-reduce beta n / p shrinks: the PS/ring
    bandwidth ratio is p. nproc is accepted for a uniform signature; 0 for
    p = 1 (no peer). Source: the simplified forms course texts teach; :func:`ps_server`
    gives the time at one server link.
    """
    return collective_time("ps", "textbook", alpha, beta, nbytes, nproc)


def ps_server(alpha, beta, nbytes, nproc):
    """Parameter-server time in seconds **at the server's one link**: 2 alpha + 2(p-1) n beta.

    Assumptions: one server with one full-duplex link of 1/beta bytes/s,
    colocated with worker 0 (its own n bytes never cross a link); the p-1
    other workers each push their n bytes of gradient through that link
    (the server receives (p-1) n), and after the sum each pulls n bytes
    back (the server sends (p-1) n); the pull starts when the push is done
    (synchronous SGD), one latency alpha per phase (the workers' messages
    arrive concurrently). Grows linearly with p; p times the ring
    all-reduce's 2(p-1)/p n beta. 0 for p = 1. Source: the standard
    incast argument, e.g. Li et al., "Scaling Distributed Machine Learning
    with the Parameter Server", OSDI 2014; Sergeev & Del Balso, "Horovod",
    2018, section 2.
    """
    return collective_time("ps", "ring", alpha, beta, nbytes, nproc)


def textbook_compressed_allreduce(alpha, beta, nbytes, nproc, ratio):
    """Textbook all-reduce with compression, in seconds: alpha (p-1) + beta r n / p.

    ratio r = compressed bytes / original bytes (> 0; e.g. 0.25 for fp32 to
    int8). Compression only shrinks the bandwidth term; the latency term and
    the (de)compression compute are not modelled. Returns 0 for p = 1.
    """
    r = np.asarray(ratio, dtype=float)
    if np.any(~np.isfinite(r)) or np.any(r <= 0):
        raise ValueError(f"ratio must be > 0 (compressed bytes / original bytes), got {ratio!r}")
    return textbook_allreduce(alpha, beta, r * check_nbytes(nbytes), nproc)


# -------------------------------------------------------------------- ring


def ring_allreduce(alpha, beta, nbytes, nproc):
    """Ring all-reduce time in seconds: 2(p-1) alpha + 2(p-1)/p n beta. 0 for p = 1."""
    return collective_time("all_reduce", "ring", alpha, beta, nbytes, nproc)


def ring_reduce_scatter(alpha, beta, nbytes, nproc):
    """Ring reduce-scatter time in seconds: (p-1) alpha + (p-1)/p n beta.

    nbytes is the input (unreduced, full) size in bytes. 0 for p = 1.
    """
    return collective_time("reduce_scatter", "ring", alpha, beta, nbytes, nproc)


def ring_all_gather(alpha, beta, nbytes, nproc):
    """Ring all-gather time in seconds: (p-1) alpha + (p-1)/p n beta.

    nbytes is the output (gathered, full) size in bytes. 0 for p = 1.
    """
    return collective_time("all_gather", "ring", alpha, beta, nbytes, nproc)


# ----------------------------------------------------------------- generic


def coefficients(op: str, form: str, nproc):
    """Return (A, B) such that T = alpha * A + beta * B * nbytes (seconds).

    A counts latency steps (dimensionless), B is the fraction of the full
    message each rank effectively moves (for op 'ps' in the 'ring' form: the
    bytes through the server link, 2(p-1)). Vectorised over nproc. Both are 0
    for p = 1. op: one of OPS; form: one of FORMS.
    """
    _check_op(op)
    _check_form(form)
    p = check_nproc(nproc)
    if op == "ps":  # per worker (textbook) or at the server's link (ring family): see ps_server
        one = np.where(p > 1, 1.0, 0.0)
        return (
            (scalar_or_array(one), scalar_or_array(one))
            if form == "textbook"
            else (scalar_or_array(2.0 * one), scalar_or_array(2.0 * (p - 1)))
        )
    if form == "ring":
        steps = 2.0 if op == "all_reduce" else 1.0
        a = steps * (p - 1)
        b = steps * (p - 1) / p
    else:
        a = p - 1
        # textbook n/p would leave a non-zero term at p = 1; force it to 0
        # so that a single process never "communicates".
        b = np.where(p > 1, 1.0 / p, 0.0)
    return scalar_or_array(a), scalar_or_array(b)


def collective_time(op: str, form: str, alpha, beta, nbytes, nproc):
    """Predicted time in seconds of collective `op` under `form`.

    alpha: seconds, beta: seconds per byte, nbytes: full message bytes
    (nccl-tests convention), nproc: processes. Vectorised (numpy broadcast).
    alpha/beta are not sign-checked so that a fitted negative value can
    still be evaluated and inspected.
    """
    n = check_nbytes(nbytes)
    a, b = coefficients(op, form, nproc)
    return scalar_or_array(np.asarray(alpha, dtype=float) * a + np.asarray(beta, dtype=float) * b * n)


def algbw(nbytes, seconds):
    """Algorithm bandwidth in bytes per second: nbytes / seconds."""
    n = check_nbytes(nbytes)
    t = np.asarray(seconds, dtype=float)
    if np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"seconds must be finite and > 0, got {seconds!r}")
    return scalar_or_array(n / t)


def busbw(op: str, nbytes, seconds, nproc):
    """Bus bandwidth in bytes per second (nccl-tests definition).

    algbw * 2(p-1)/p for all_reduce, algbw * (p-1)/p for reduce_scatter and
    all_gather; for 'ps' algbw * 2(p-1), the server link's bandwidth (it
    carries 2(p-1) n bytes). It is comparable to link bandwidth independent
    of p; it is 0 for p = 1 because no bytes cross a link.
    """
    _check_op(op)
    p = check_nproc(nproc)
    factor = 2.0 * (p - 1) if op == "ps" else (2.0 if op == "all_reduce" else 1.0) * (p - 1) / p
    return scalar_or_array(np.asarray(algbw(nbytes, seconds)) * factor)


def zero3_step_comm(link, param_bytes, grad_bytes, nproc, persistent_bytes=0) -> dict:
    """Communication seconds of one ZeRO-3 (FSDP full-shard) training step on `link` (a dtlab.model.link.Link:
    alpha, beta and form as one value).

    Parts: an all-gather of the sharded parameters in forward, the same
    all-gather again in backward (the gathered copy is freed after forward),
    and a reduce-scatter of the gradients. ``persistent_bytes`` are
    parameters kept unsharded on every rank (never gathered). All sizes in
    bytes, full (unsharded) sizes, per the nccl-tests convention.

    Returns a dict of seconds: ``all_gather_fwd``, ``all_gather_bwd``,
    ``reduce_scatter`` and ``total``. Note that with form="textbook" the
    total is 3 alpha (p-1) + beta (2 P' + G) / p, larger than the seed
    text's :func:`textbook_zero3` shortcut, which counts one gather, one
    reduce-scatter and the latency only once.
    """
    p_bytes = check_nbytes(param_bytes)
    pers = np.asarray(persistent_bytes, dtype=float)
    if np.any(pers < 0) or np.any(pers > p_bytes):
        raise ValueError(
            f"persistent_bytes must be between 0 and param_bytes ({param_bytes!r}), got {persistent_bytes!r}"
        )
    gathered = p_bytes - pers
    ag = link.time("all_gather", gathered, nproc)
    rs = link.time("reduce_scatter", grad_bytes, nproc)
    return {
        "all_gather_fwd": ag,
        "all_gather_bwd": ag,
        "reduce_scatter": rs,
        "total": scalar_or_array(np.asarray(ag) * 2 + np.asarray(rs)),
    }
