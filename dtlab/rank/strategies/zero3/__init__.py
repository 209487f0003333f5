"""Strategy 'zero3': DeepSpeed ZeRO stage 3, one rank per process, every collective recorded.

What a rank writes (times in seconds from the step's start, on the step's clock; sizes in bytes):

- `ready`, then per step a `step` event (forward = `engine(**batch)`, backward = `engine.backward(loss)`,
  optimizer = `engine.step()`), followed by the step's `collective` events; collectives issued inside
  `deepspeed.initialize` are written once with step -1 and phase "init" (times from the start of initialize).
  Step events also carry `allgather_expected_{fwd,bwd,opt}_bytes`: what the engine had to gather in that
  phase, read from the parameters' ZeRO status when the phase began (no communication, no sync), so the
  recorded all-gather bytes can be checked whatever the ZeRO settings.
- `memory` after step 0 (no peak) and after the last step, from the tensors the rank holds.
- `blocked`: each interval during which the rank waited for a collective (`how`: wait, blocking_call,
  stream_sync; `seq` names the collective waited for, matching the collective record's `seq`). Step events
  carry their union, `t_blocked` (and per phase `t_blocked_{fwd,bwd,opt}`): the measured exposed
  communication. See dtlab.rank.strategies.zero3.blocked for how each kind is timed on CPU and on GPU.

Definitions (ZeRO-3 has no no-op-hook baseline, and DeepSpeed overlaps its collectives with compute on side
streams, so T_step - T_comm is not compute time):
- T_comm: the union of the step's [t_start, t_end] in-flight intervals (a union, not a sum: prefetched
  all-gathers overlap each other and compute).
- exposed: t_blocked, the time the training thread (CPU) or the compute stream (GPU) was blocked waiting for
  collectives. Measured, not inferred.
- T_comp: T_step - t_blocked ("measured: T_step - time blocked on collectives").
- overlap: 1 - exposed / T_comm.

How the collectives are recorded (wrapped deepspeed.comm backend methods) and their byte convention:
dtlab.rank.strategies.zero3.comm; how blocked time is timed and summed: dtlab.rank.strategies.zero3.blocked;
DeepSpeed's import and config: dtlab.rank.strategies.zero3.engine; the traffic and memory read from the engine:
dtlab.rank.strategies.zero3.facts.

CPU path (tested): DS_ACCELERATOR=cpu before deepspeed is imported, gloo, and DeepSpeed's shared-memory comm
op build patched out. GPU paths (DS_ACCELERATOR=cuda; NCCL, or gloo on CUDA tensors where NCCL cannot place the
ranks, e.g. 2 ranks on one GPU before NCCL 2.30; LOCAL_RANK set to the rank's GPU index, CUDA events): written
to the same contract but NOT run in the session that wrote them (no GPU was available); tests/gpu/test_gpu.py and
tools/gpu_runbook.py are their first run.
"""

from __future__ import annotations

import os
import time

from dtlab.rank.build import build_replica
from dtlab.rank.loop import Setup, Step, Strategy
from dtlab.rank.marks import rank_marks
from dtlab.rank.optim import adamw
from dtlab.rank.recorder import Mark, StepClock
from dtlab.rank.strategies.zero3.blocked import blocked_recording, blocked_seconds
from dtlab.rank.strategies.zero3.comm import COLLECTIVE_RECORDING, CollectiveRecorder
from dtlab.rank.strategies.zero3.engine import (
    ds_config,
    import_deepspeed,
    model_hidden_size,
    remap_local_rank,
    zero_auto,
)
from dtlab.rank.strategies.zero3.facts import memory_record, nonresident_bytes, zero_facts


class Zero3(Strategy):
    """DeepSpeed's ZeRO-3 engine with every collective and every wait for one recorded."""

    def setup(self) -> Setup:
        """Build, initialize DeepSpeed with the recorder installed (its collectives written with step -1)."""
        cfg, rank, world = self.ctx.cfg, self.ctx.rank, self.ctx.world
        deepspeed = import_deepspeed(self.ctx.placed.device)  # DeepSpeed's accelerator follows the device
        # the replica's process group suits DeepSpeed: init_distributed finds torch.distributed initialised and only
        # builds its backend object around it (for nccl it binds device_id just as DeepSpeed would).
        rep = build_replica(self.ctx, shards=world, shard=rank)
        device, backend = rep.device, rep.backend
        self.device, self.batches = device, rep.batches
        local_rank = remap_local_rank(device)  # before DeepSpeed reads LOCAL_RANK (engine, partitioning)
        deepspeed.init_distributed(dist_backend=backend)
        self.marks = marks = rank_marks(device, backend)  # every clock of this rank: steps, collectives, waits
        self.recorder = recorder = CollectiveRecorder(device, backend, marks=marks)
        wrapped = recorder.install()

        hidden = model_hidden_size(rep.model)
        conf = ds_config(cfg, world, hidden)
        model = rep.model
        model.train()
        opt = adamw(model.parameters(), cfg.lr, cfg.optimizer_impl)
        recorder.begin(-1, "init", recorder.now())
        t0 = time.perf_counter()
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
        t_initialize = time.perf_counter() - t0
        self._write_recorded()
        watched = recorder.watch_stream(
            getattr(self.engine.optimizer, "reduce_and_partition_stream", None), "reduce_and_partition_stream"
        )
        facts = {
            **rep.facts,
            **zero_facts(self.engine, world),
            "ds_config": conf,
            "zero_auto": zero_auto(cfg, hidden),
            "blocked_recording": blocked_recording(marks.cuda, watched),
            "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
            "deepspeed_initialize_s": t_initialize,
            "collective_recording": COLLECTIVE_RECORDING,
            "wrapped_methods": wrapped,
            "deepspeed_local_rank": local_rank,
            "collective_timing": {"path": recorder.marks.path, "end_stream": recorder.marks.stream_how},
            "timing_method": marks.facts(),
        }  # the owned streams of the groups met in initialize are made
        if device.type == "cuda":
            facts["zero3_note"] = (
                "the ZeRO-3 GPU path (CUDA events; NCCL, or DeepSpeed's CUDA accelerator over "
                "gloo) was written without a GPU to test it"
            )
        self.expected_opt = facts["expected_allgather_bytes_optimizer"]
        return Setup(device, backend, facts, facts)

    def before_steps(self) -> int:
        """The step clock; no stream is made after this."""
        self.params = list(self.engine.module.parameters())
        self.clock = StepClock(self.marks)
        self.marks.seal()
        return 0

    def step(self, step: int, paired: int | None) -> Step:
        """One timed step of the engine (forward, backward, optimizer) and its time blocked per phase."""
        engine, recorder, clock, world = self.engine, self.recorder, self.clock, self.ctx.world
        batch = self.batches[step % len(self.batches)]
        expect_fwd = nonresident_bytes(self.params, world)
        clock.mark(Mark.START)
        recorder.begin(step, "forward", clock.start)
        out = engine(**batch)
        clock.mark(Mark.FWD)
        expect_bwd = nonresident_bytes(self.params, world)  # forward's leftovers decide backward's gathers
        recorder.phase = "backward"
        engine.backward(out.loss)
        clock.mark(Mark.BWD)
        recorder.phase = "optimizer"
        engine.step()
        clock.mark(Mark.OPT)
        recorder.phase = "between_steps"
        t = clock.read()  # the step's one sync point on GPU
        self.blocked = recorder.collect_blocked()
        in_step = [b for b in self.blocked if b["step"] == step and b["phase"] != "between_steps"]
        fields = {
            "loss": float(out.loss.detach()),
            "allgather_expected_fwd_bytes": expect_fwd,
            "allgather_expected_bwd_bytes": expect_bwd,
            "allgather_expected_opt_bytes": self.expected_opt,
            "t_blocked": blocked_seconds(in_step),
            **{
                f"t_blocked_{k}": blocked_seconds(in_step, ph)
                for k, ph in (("fwd", "forward"), ("bwd", "backward"), ("opt", "optimizer"))
            },
            "n_blocked": len(in_step),
        }
        return Step(t, fields)

    def after_step(self, step: int, paired: int | None, rec: dict) -> None:
        """The step's collectives and waits."""
        self._write_recorded(self.blocked)

    def _write_recorded(self, blocked=None) -> None:
        """The recorder's collectives, then the waits (`blocked`, or those it holds now)."""
        writer, rank = self.ctx.writer, self.ctx.rank
        for r in self.recorder.collect():
            writer.write("collective", rank=rank, **r)
        for b in self.recorder.collect_blocked() if blocked is None else blocked:
            writer.write("blocked", rank=rank, **b)

    def memory(self, final: bool) -> dict:
        """The bytes the rank holds, counted from the engine's tensors (zero3.facts.memory_record)."""
        return memory_record(self.engine)
