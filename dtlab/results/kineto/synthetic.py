"""Synthetic Kineto traces whose answers are known: for tests, the docs and the benchmark.

`write_synthetic(folder, ...)` writes one trace per rank of a data-parallel job: per step, a compute kernel, then
one all-reduce per size in `sizes`, each rank arriving `delays[r]` late and every rank's kernel ending when the
last one has arrived plus the all-reduce's time on `link` (default :data:`LINK`: the ring's 2(p-1) alpha + 2(p-1)/p n
beta at alpha 20 us, 1/beta 50 GB/s). Each rank's clock is off by
`offsets[r]` (s). `layout='new'` puts the metadata on the kernel's arguments; `'old'` names every kernel
ncclKernel_SendRecv_..._int8_t and puts it on an `nccl:all_reduce` annotation around the launch, found through
the correlation id. Times are written as integers (`int_ts`) or floats. Pure.
"""

from __future__ import annotations

import gzip
import json
import os

from dtlab.model.link import Link, one_level

#: The link the synthetic all-reduces take by default: an NVLink-class ring, alpha 20 us, 1/beta 50 GB/s.
LINK = Link(alpha=20e-6, beta=1 / 50e9, source="synthetic traces' default: alpha 20 us, 1/beta 50 GB/s, ring")


def _x(cat, name, pid, tid, ts, dur, args) -> dict:
    """A complete ('X') event as Kineto writes it."""
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _events(rank, p, steps, sizes, link, delays, offset, compute_s, layout, prefix, int_ts, pad):
    """Yield one rank's events (dicts), times in microseconds on the rank's own clock."""
    corr = 0
    t = 1_000_000.0  # s -> us below; the job starts 1 s into the clock

    def allreduce_s(n):
        return float(link.time("all_reduce", n, p))

    step_s = compute_s + sum(allreduce_s(n) + max(delays) + 50e-6 for n in sizes) + 200e-6
    conv = (lambda x: round(x)) if int_ts else (lambda x: round(x, 3))

    def us(s):
        return conv((s + offset) * 1e6)

    for step in range(steps):
        s0 = 1.0 + step * step_s
        yield _x("user_annotation", f"ProfilerStep#{step}", 1, 1, us(s0), conv(step_s * 1e6 - 1), {})
        corr += 1
        yield _x("cuda_runtime", "cudaLaunchKernel", 1, 1, us(s0 + 1e-6), 2, {"correlation": corr})
        yield _x(
            "kernel",
            "ampere_sgemm_128x64_tn",
            0,
            7,
            us(s0 + 10e-6),
            conv(compute_s * 1e6),
            {"stream": 7, "correlation": corr, "pad": pad},
        )
        t = s0 + 10e-6 + compute_s
        for k, n in enumerate(sizes):
            arrive = t + delays[rank]
            end = t + max(delays) + allreduce_s(n)
            corr += 1
            meta = {
                "Collective name": "allreduce",
                "In msg nelems": n // 4,
                "Out msg nelems": n // 4,
                "Group size": p,
                "dtype": "Float",
                "Process Group Name": "0",
                "Process Group Ranks": str(list(range(p))),
                "Seq": step * len(sizes) + k,
            }
            if layout == "old":
                yield _x(
                    "user_annotation",
                    "nccl:all_reduce",
                    1,
                    1,
                    us(arrive - 20e-6),
                    15,
                    {"Input Dims": [[n // 4]], "Input type": ["float"]},
                )
                name, kargs = f"{prefix}_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)", {}
            else:
                name, kargs = f"{prefix}_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", meta
            yield _x("cuda_runtime", "cudaLaunchKernel", 1, 1, us(arrive - 10e-6), 2, {"correlation": corr})
            yield _x(
                "kernel",
                name,
                0,
                20,
                us(arrive),
                conv((end - arrive) * 1e6),
                {"stream": 20, "correlation": corr, **kargs},
            )
            t = end + 50e-6


def write_synthetic(
    folder: str,
    nproc: int = 2,
    steps: int = 3,
    sizes=(1 << 20, 4 << 20, 16 << 20),
    link: Link = LINK,
    delays=None,
    offsets=None,
    compute_s: float = 2e-3,
    layout: str = "new",
    prefix: str = "ncclDevKernel",
    int_ts: bool = False,
    rank_info: bool = True,
    gz: bool = False,
    pad: str = "",
) -> list[str]:
    """Write one trace per rank into `folder` (rank{r}.json or .json.gz) and return the paths. `link`: a Link (or a
    Profile) whose all-reduce prices every collective (alpha, beta, form); `delays[r]`: how late rank r arrives at
    every collective (s); `offsets[r]`: its clock's offset (s); `pad`: a string added to every compute kernel's
    arguments (to make big files for the benchmark)."""
    link = one_level(link)
    os.makedirs(folder, exist_ok=True)
    delays = list(delays) if delays is not None else [0.0] * nproc
    offsets = list(offsets) if offsets is not None else [0.0] * nproc
    paths = []
    for r in range(nproc):
        path = os.path.join(folder, f"rank{r}.json" + (".gz" if gz else ""))
        head = {"schemaVersion": 1, "deviceProperties": []}
        if rank_info:
            head["distributedInfo"] = {"backend": "nccl", "rank": r, "world_size": nproc}
        with gzip.open(path, "wt") if gz else open(path, "w") as f:
            f.write(json.dumps(head)[:-1] + ',\n  "traceEvents": [\n')
            first = True
            for e in _events(
                r, nproc, steps, list(sizes), link, delays, offsets[r], compute_s, layout, prefix, int_ts, pad
            ):
                f.write(("" if first else ",\n") + "  " + json.dumps(e))
                first = False
            f.write('\n  ],\n  "displayTimeUnit": "ms"\n}\n')
        paths.append(path)
    return paths
