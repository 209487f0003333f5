"""Blocked time (exposed communication) on a ZeRO-3 rank: the union of the intervals it waited for collectives
(`blocked_seconds`) and the record of how they were measured (`blocked_recording`).

The intervals come from dtlab.rank.strategies.zero3.comm's `CollectiveRecorder`, recorded three ways (`how`):
- `wait`: an async collective's Work is handed back wrapped in `_TimedWork`, whose `wait()` is timed.
  CPU: wall clock before and after. GPU: a CUDA event on the compute stream before the wait (the moment
  the compute stream reached the wait) and one on the stream that waits after it (the moment the
  collective released it); the stall is max(0, after - before). DeepSpeed waits on all-gather handles
  inside its all-gather stream and then makes the compute stream wait for that stream, so the after-event
  is where the compute stream is released; no dependency is added.
- `blocking_call`: a collective called with async_op=False blocks for its whole duration. CPU: always.
  GPU: counted only when issued on the compute stream (one issued on a side stream stalls that stream;
  the compute stream meets it where it joins the side stream, see `stream_sync`).
- `stream_sync` (GPU only): DeepSpeed synchronises the host with its reduce_and_partition_stream after
  the last gradient bucket; `CollectiveRecorder.watch_stream` times the compute stream's stall there the
  same way.
"""

from __future__ import annotations

from dtlab.intervals import union_length


def blocked_seconds(blocked: list[dict], phase: str | None = None) -> float:
    """Length of the union of the blocked intervals (optionally of one phase): seconds the rank could not
    compute because it waited for collectives. A union, so nested or concurrent waits count once."""
    return union_length(
        (b["t_start"], b["t_end"])
        for b in blocked
        if b["t_start"] is not None and b["t_end"] is not None and (phase is None or b["phase"] == phase)
    )


def blocked_recording(cuda: bool, stream_watched: bool) -> dict:
    """How blocked time (exposed communication) was measured on this rank, and what it cannot see."""
    if not cuda:
        return {
            "clock": "wall clock (perf_counter) on the training thread",
            "intercepted": [
                "Work.wait() of every async collective issued through deepspeed.comm",
                "the whole of every blocking (async_op=False) collective",
            ],
            "not_intercepted": [
                "waits inside torch.distributed calls that bypass deepspeed.comm (none in ZeRO-3 training on 0.19.8)",
                "CPU time the backend's own threads take from compute on shared cores "
                "(it slows compute, it does not block)",
            ],
        }
    return {
        "clock": "CUDA events: a mark on the compute stream before each wait, one on the waiting stream after",
        "intercepted": [
            "Work.wait() of async collectives (all-gather handles, waited on the all-gather "
            "stream that the compute stream then joins)",
            "blocking collectives issued on the compute stream",
        ]
        + (
            ["reduce_and_partition_stream.synchronize() (host waits for the reduce-scatters)"] if stream_watched else []
        ),
        "not_intercepted": [
            "host waits on DeepSpeed's back-pressure events (__ongoing_fetch_events, "
            "param_reduce_events .synchronize()): the GPU only stalls there if its queue runs dry",
            "default_stream().wait_stream(reduce_and_partition_stream) in the fp16 overflow "
            "check (not reached in fp32)",
            "the all-gather stream's unpacking copies (torch.cat) after each wait",
        ]
        + ([] if stream_watched else ["reduce_and_partition_stream.synchronize() (could not be wrapped)"]),
    }
