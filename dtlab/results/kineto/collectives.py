"""What each collective in a Kineto trace was: its normalized op, bytes, dtype, group, sequence number.

Newer traces put the metadata on the kernel itself ("Collective name", "In msg nelems", "dtype", "Group size",
"Process Group Name", "Seq"); older ones only on the CPU side: the `nccl:all_reduce` annotation around the launch
("Input Dims", "Input type"), or `record_param_comms`. The launch is found through the kernel's correlation id
(the runtime event with the same id), and the annotation is the innermost one around the launch on the same CPU
thread. gloo's collectives are CPU spans (`gloo:all_reduce`) with the same "Input Dims" and "Input type".

Sizes follow nccl-tests (dtlab's convention): nbytes is the full message n (all-reduce: the tensor; all-gather:
the output; reduce-scatter: the input). Pure.
"""

from __future__ import annotations

import bisect
import math
import re

#: element sizes (bytes) by the names traces use for dtypes
DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "f32": 4,
    "double": 8,
    "float64": 8,
    "f64": 8,
    "half": 2,
    "float16": 2,
    "f16": 2,
    "c10::half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "c10::bfloat16": 2,
    "int": 4,
    "int32": 4,
    "i32": 4,
    "long": 8,
    "int64": 8,
    "long int": 8,
    "i64": 8,
    "short": 2,
    "int16": 2,
    "byte": 1,
    "uint8": 1,
    "unsigned char": 1,
    "u8": 1,
    "char": 1,
    "int8": 1,
    "int8_t": 1,
    "signed char": 1,
    "i8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "c10::float8_e4m3fn": 1,
}

_OPS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "allgatherbase": "all_gather",
    "allgatherintotensor": "all_gather",
    "allgathercoalesced": "all_gather",
    "allgatherintotensorcoalesced": "all_gather",
    "reducescatter": "reduce_scatter",
    "reducescatterbase": "reduce_scatter",
    "reducescattertensor": "reduce_scatter",
    "reducescattertensorcoalesced": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoallv": "all_to_all",
    "alltoallbase": "all_to_all",
    "broadcast": "broadcast",
    "send": "send",
    "recv": "recv",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "allreducecoalesced": "all_reduce",
    "sendrecv": "send_recv",
}
_KERNEL = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")
_KERNEL_OPS = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
}  # SendRecv and Generic do not say which collective
COMM_KERNEL = re.compile(r"^nccl|ncclKernel|ncclDevKernel|^hccl")
ROWS = (
    "rank",
    "step",
    "op",
    "nbytes",
    "dtype",
    "nelems",
    "group_size",
    "pg",
    "seq",
    "t_start",
    "t_end",
    "kernel",
    "stream",
    "source",
)


def normalize_op(name: str | None) -> str | None:
    """'allreduce', 'nccl:all_reduce', 'c10d::allreduce_', 'gloo:all_reduce', '_allgather_base' -> the dtlab op
    name (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, ...); None if unknown."""
    if not name:
        return None
    base = name.split(":")[-1].lower()
    key = re.sub(r"[^a-z]", "", base)
    return _OPS.get(key)


def kernel_op(name: str) -> str | None:
    """The op an NCCL kernel's name says (ncclKernel_AllReduce_..., ncclDevKernel_AllGather_...); None for
    SendRecv and Generic kernels, which carry any collective."""
    m = _KERNEL.search(name)
    return _KERNEL_OPS.get(m.group(1)) if m else None


def dtype_bytes(dtype) -> int | None:
    """Bytes per element of a dtype as a trace writes it ('Float', 'c10::BFloat16', 'int', 'f32'); None if
    unknown."""
    if dtype is None:
        return None
    return DTYPE_BYTES.get(str(dtype).strip().lower())


def _elements(dims) -> int | None:
    """Elements of the first input of "Input Dims" ([[8, 1024]] or a TensorList [[[64], [32]]])."""
    if not dims:
        return None
    first = dims[0]
    if not first:
        return None
    if isinstance(first[0], list):  # a TensorList: the sum of its tensors
        return sum(math.prod(d) for d in first if isinstance(d, list))
    return math.prod(first)


def describe(meta: dict, name: str, world_size: int | None) -> dict:
    """Op, dtype, nelems, nbytes, group_size, pg, seq from one collective's metadata (kernel args or a CPU
    annotation's args) and the name of the event that carried it."""
    op = normalize_op(meta.get("Collective name")) or normalize_op(name)
    dtype = meta.get("dtype")
    group = meta.get("Group size")
    nelems = None
    if "In msg nelems" in meta:
        nelems = meta["Out msg nelems"] if op == "all_gather" and "Out msg nelems" in meta else meta["In msg nelems"]
    elif "Input Dims" in meta:
        nelems = _elements(meta["Input Dims"])
        types = meta.get("Input type") or []
        dtype = dtype or (types[0] if types else None)
        if op == "all_gather" and nelems is not None and (group or world_size):
            nelems *= int(group or world_size)  # the annotation shows the input; n is the output
    size = dtype_bytes(dtype)
    seq = meta.get("Seq", meta.get("seq"))
    return {
        "op": op,
        "dtype": None if dtype is None else str(dtype),
        "nelems": nelems,
        "nbytes": None if nelems is None or size is None else int(nelems) * size,
        "group_size": int(group) if group is not None else world_size,
        "pg": str(meta.get("Process Group Name", "")),
        "seq": int(seq) if seq is not None else None,
    }


def has_meta(meta: dict) -> bool:
    """True when an event's args describe a collective's size."""
    return "In msg nelems" in meta or "Input Dims" in meta


class Annotations:
    """The collective annotations of one rank, by CPU thread, for "the innermost annotation around a launch"."""

    def __init__(self, comm_cpu: list):
        self.by_tid: dict = {}
        for a in sorted(comm_cpu, key=lambda a: a[2]):
            self.by_tid.setdefault(a[1], []).append(a)
        self.starts = {tid: [a[2] for a in v] for tid, v in self.by_tid.items()}

    def around(self, tid: int, ts: float):
        """(name, args) of the innermost annotation with a collective's metadata that contains time `ts` on thread
        `tid`, else the innermost one with a collective's name; None if there is none."""
        rows = self.by_tid.get(tid)
        if not rows:
            return None
        i = bisect.bisect_right(self.starts[tid], ts)
        named = None
        for a in reversed(rows[max(0, i - 64) : i]):  # nesting is shallow: look back a few annotations
            if a[2] <= ts <= a[2] + a[3]:
                if has_meta(a[4]):
                    return a[0], a[4]
                if named is None and normalize_op(a[0]):
                    named = (a[0], a[4])
        return named
