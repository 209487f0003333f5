"""Parameter server vs ring all-reduce: the alpha-beta forms side by side, and what the collectives really do.

Pure (numpy, pandas). Units: alpha in seconds, beta in seconds per byte, n (`nbytes`) the gradient bytes every
worker contributes, p workers (`nproc`), results in seconds.

dtlab's strategy 'ps' (dtlab.rank.strategies.ps) reduces each gradient bucket to rank 0 and broadcasts it back, through
torch.distributed's `reduce` and `broadcast`: rank 0 is the server, colocated with worker 0. Four ways to
price that, all at p = 1 free (no peer):

- textbook, per worker (`parameter_server`): alpha + beta n. One message of n per worker, the server never the
  bottleneck: flat in p.
- at the server link (`ps_server`): 2 alpha + 2(p-1) n beta. p-1 workers push n through one link, then pull n back:
  linear in p.
- gloo's reduce + broadcast (`ps_gloo`): (p + L) alpha + (2(p-1)/p + L) n beta, L = ceil(log2 p). What torch's gloo
  backend does.
- NCCL's reduce + broadcast (`ps_nccl`): 2(p-1) alpha + 2 n beta. Pipelined rings (large n).

beside the ring all-reduce, 2(p-1) alpha + 2(p-1)/p n beta (textbook alpha (p-1) + beta n / p).

The textbook and server forms are the teaching model: bandwidth PS / ring = p in both families (n against
n / p; 2(p-1) n against 2(p-1)/p n). The implementations are not that model. gloo's `reduce` (gloo/reduce.cc)
is itself a ring reduce-scatter ((p-1) steps of n/p per rank) followed by a gather of the p-1 reduced chunks
into the root (one step, (p-1)/p n into rank 0): the incast of a real server never happens; its `broadcast`
(gloo/broadcast.cc) is a binomial tree, ceil(log2 p) rounds each carrying the full n. So on gloo PS costs about
one all-reduce plus a log2(p)-deep tree of full copies: PS / ring tends to (2(p-1)/p + L) / (2(p-1)/p), 2 at
p = 2, and grows only like log2 p. NCCL runs both as pipelined rings (nccl-tests: busbw = algbw for reduce
and broadcast), about n beta each for large n, so its PS / ring is p / (p-1): 2 at p = 2, falling towards 1.
A through-one-link server (the incast) needs point-to-point sends to one rank, which these collectives
avoid by design. On a CPU machine with fewer cores than ranks every form is further off: loopback "links"
are memory copies by the same cores that compute (see docs/parameter-server.md).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtlab.model import costmodel
from dtlab.model.link import one_level

FORMS = (
    "ring all-reduce",
    "ring all-reduce (textbook)",
    "ps per worker (textbook)",
    "ps at the server link",
    "ps as gloo runs it",
    "ps as NCCL runs it",
)


def _log2ceil(p: np.ndarray) -> np.ndarray:
    return np.ceil(np.log2(np.maximum(p, 1.0)))


def ps_gloo(link, nbytes, nproc):
    """PS as torch's gloo backend runs it, in seconds: reduce to rank 0 then broadcast from it, on `link` (a Link
    or a Profile: its alpha, s, and beta, s/B).

    gloo's reduce: a ring reduce-scatter, (p-1) alpha + (p-1)/p n beta, then the p-1 reduced chunks gathered
    into the root, alpha + (p-1)/p n beta (the root's link takes them one after another); gloo's broadcast: a
    binomial tree, ceil(log2 p) rounds of alpha + n beta. Total (p + L) alpha + (2(p-1)/p + L) n beta with
    L = ceil(log2 p); 0 for p = 1. Sources: facebookincubator/gloo gloo/reduce.cc, gloo/broadcast.cc; torch's
    ProcessGroupGloo calls gloo::reduce and gloo::broadcast for CPU tensors.
    """
    lk = one_level(link)
    p = costmodel.check_nproc(nproc)
    n = costmodel.check_nbytes(nbytes)
    L = _log2ceil(p)
    t = (p + L) * lk.alpha + (2 * (p - 1) / p + L) * n * lk.beta
    return costmodel.scalar_or_array(np.where(p > 1, t, 0.0))


def ps_nccl(link, nbytes, nproc):
    """PS as NCCL runs it (large messages), in seconds: 2(p-1) alpha + 2 n beta, on `link` (a Link or a Profile).

    NCCL's reduce and broadcast are pipelined rings: each costs about (p-1) alpha + n beta once the pipeline is
    full (nccl-tests, doc/PERFORMANCE.md: busbw = algbw for both). Not measured here (no GPU on the CI
    machine). 0 for p = 1.
    """
    lk = one_level(link)
    p = costmodel.check_nproc(nproc)
    n = costmodel.check_nbytes(nbytes)
    t = 2 * (p - 1) * lk.alpha + 2 * n * lk.beta
    return costmodel.scalar_or_array(np.where(p > 1, t, 0.0))


def forms_table(link, nbytes, nproc) -> pd.DataFrame:
    """Every form of this module for each (nbytes, p), all with `link`'s alpha and beta (a Link or a Profile; its
    own form is not used: each column is one form): one row per pair, columns nbytes (B), nproc, one column of
    seconds per entry of FORMS, and `ps_over_ring_*` ratios (textbook over textbook, server over ring, gloo over
    ring, NCCL over ring)."""
    lk = one_level(link)
    alpha, beta = lk.alpha, lk.beta
    n, p = np.broadcast_arrays(
        np.atleast_1d(np.asarray(nbytes, dtype=float)), np.atleast_1d(np.asarray(nproc, dtype=float))
    )
    n, p = n.ravel(), p.ravel()
    cols = {
        "ring all-reduce": costmodel.ring_allreduce(alpha, beta, n, p),
        "ring all-reduce (textbook)": costmodel.textbook_allreduce(alpha, beta, n, p),
        "ps per worker (textbook)": costmodel.parameter_server(alpha, beta, n, p),
        "ps at the server link": costmodel.ps_server(alpha, beta, n, p),
        "ps as gloo runs it": ps_gloo(lk, n, p),
        "ps as NCCL runs it": ps_nccl(lk, n, p),
    }
    df = pd.DataFrame(
        {"nbytes": n.astype(int), "nproc": p.astype(int), **{k: np.asarray(v, dtype=float) for k, v in cols.items()}}
    )
    ring = df["ring all-reduce"].replace(0.0, np.nan)
    df["ps_over_ring_textbook"] = df["ps per worker (textbook)"] / df["ring all-reduce (textbook)"].replace(0.0, np.nan)
    df["ps_over_ring_server"] = df["ps at the server link"] / ring
    df["ps_over_ring_gloo"] = df["ps as gloo runs it"] / ring
    df["ps_over_ring_nccl"] = df["ps as NCCL runs it"] / ring
    return df
