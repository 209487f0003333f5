"""Strategy 'pp': DistilBERT's layers split into P stages, one per rank of a replica, run by
torch.distributed.pipelining (PipelineStage with ScheduleGPipe or Schedule1F1B).

The batch is cut into M micro-batches (`microbatches`). GPipe (Huang et al., 2019) runs every forward, then every
backward; 1F1B (Narayanan et al., "PipeDream", 2019; the flush variant of Megatron-LM, 2021) runs one forward, one
backward once the pipeline is full, so at most P micro-batches' activations are held instead of M. Both leave
the same bubble: each stage idles for (P - 1) of the M + P - 1 slots of a step, (P - 1) / (M + P - 1).

What a rank records, besides dtlab's step events:
- `microbatch`: every forward and backward this stage computed, per micro-batch (stage.forward_one_chunk and
  backward_one_chunk, wrapped on this stage object), seconds from the step's start;
- `collective`: every send and receive of activations (forward) and their gradients (backward), with bytes,
  from the schedule's p2p helpers (`_batch_p2p` issues, `_wait_batch_p2p` waits: the module-level functions of
  torch 2.11 to 2.14, wrapped by dtlab.rank.strategies.pp_p2p.P2PRecorder whether the backend returns one Work
  per op or one per batch; if a later torch renames them, nothing is recorded and `p2p_recorded` says so); the
  replicas' gradient all-reduce (dp_degree > 1); `blocked`: every wait for a transfer;
- step events carry t_pipe, the time from the step's start to the end of this stage's schedule. Every stage
  starts a step together (a barrier before the clock starts), so dtlab.results.pipeline measures the bubble on
  one clock: 1 - sum over stages of busy time / (P x the longest t_pipe).

The schedules use batch_isend_irecv, reported to hang on gloo (github.com/pytorch/pytorch/issues/132644); with
torch 2.13 on gloo they run (tested). t_fwd is the time until this stage's last forward ended, t_bwd from there to
the end of its schedule and the gradient average (1F1B interleaves backwards before the last forward), t_opt the
optimizer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from dtlab.config.parallel import split_layers
from dtlab.config.run import RunConfig
from dtlab.rank.loop import Step
from dtlab.rank.optim import adamw
from dtlab.rank.recorder import Mark, local_bytes
from dtlab.rank.strategies.bases import SplitStrategy
from dtlab.rank.strategies.pp_p2p import ACTIVE, install_p2p_recording
from dtlab.rank.strategies.stages import make_stage, stage_param_names


class ComputeTimeline:
    """Wraps a PipelineStage's forward_one_chunk and backward_one_chunk to time each micro-batch on the rank's
    marks (dtlab.rank.marks: on CUDA, events on the compute stream around the chunk's kernels)."""

    def __init__(self, stage, index: int, marks):
        self.index, self.marks, self.spans, self._ref = index, marks, [], None
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(chunk, *a, **k):
            t0 = marks.now()
            out = fwd(chunk, *a, **k)
            self.spans.append(("forward", int(chunk), t0, marks.now()))
            return out

        def backward_one_chunk(chunk, *a, **k):
            t0 = marks.now()
            out = bwd(chunk, *a, **k)
            self.spans.append(("backward", int(chunk), t0, marks.now()))
            return out

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk

    def begin(self, ref) -> None:
        """A new step whose start is the mark `ref`."""
        self.spans, self._ref = [], ref

    def flush(self, writer, rank: int, step: int) -> float:
        """Write this step's spans (after the step's clock was read); return the end of the last forward (s from
        the step start)."""
        last = 0.0
        for kind, mb, a, b in self.spans:
            ta, tb = self.marks.seconds(self._ref, a), self.marks.seconds(self._ref, b)
            writer.write(
                "microbatch", rank=rank, step=step, stage=self.index, microbatch=mb, phase=kind, t_start=ta, t_end=tb
            )
            if kind == "forward":
                last = max(last, tb)
        return last


class Pipeline(SplitStrategy):
    """This rank's stage of the replica's pipeline and its schedule (see the module docstring)."""

    align = True  # every stage starts the step together, so the bubble is measured from one start

    def split(self, replica) -> dict:
        """Cut the model into this rank's stage, make the schedule and the recorders; the stages' facts."""
        cfg = self.ctx.cfg
        model = replica.model.to(replica.device)
        model.train()
        self.mesh = replica.mesh
        pp_mesh = replica.mesh["pp"]
        P, s = pp_mesh.size(), pp_mesh.get_local_rank()
        self.P, self.s = P, s
        stage_mod = make_stage(model, P, s)
        names = stage_param_names(model, stage_mod)
        self.mine = [(n, p) for n, p in model.named_parameters() if n in names]  # the stage's, named as in the model
        n_layers = int(model.config.n_layers)
        replica.model = model = None  # the other stages' layers are not this rank's: let them go
        stage = PipelineStage(stage_mod, s, P, replica.device, group=pp_mesh.get_group())
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.parallel.schedule]
        self.sched = schedule(stage, n_microbatches=cfg.parallel.microbatches, loss_fn=F.cross_entropy)
        self.marks.prepare(
            [pp_mesh.get_group()] + ([replica.mesh.get_group("dp")] if replica.degrees["dp"] > 1 else [])
        )
        self.timeline = ComputeTimeline(stage, s, self.marks)
        recorded = install_p2p_recording() if cfg.record else False
        self.params = list(stage_mod.parameters())
        self.opt = adamw(self.params, cfg.lr, cfg.optimizer_impl)
        self.stage_grad_bytes = local_bytes(self.params)
        ACTIVE["recorder"] = self.rec if recorded else None
        return _facts(cfg, replica, P, n_layers, recorded)

    def ready_fields(self) -> dict:
        """The stage, its parameters and their gradients' bytes."""
        return {"stage": self.s, "stage_params": len(self.mine), "stage_grad_bytes": self.stage_grad_bytes}

    def named(self):
        """The stage's parameters, named as in the whole model."""
        return self.mine

    def compute(self, batch):
        """This stage's part of the schedule, every micro-batch timed; returns the last stage's losses."""
        losses: list = []
        self.timeline.begin(self.clock.start)
        _schedule_step(self.sched, self.s, self.P, batch, losses, {"attention_mask": batch["attention_mask"]})
        self.clock.mark(Mark.PIPE)
        return losses

    def step_fields(self, step: int, t: dict, losses) -> Step:
        """The micro-batches' records; forward ends with this stage's last forward, t_pipe with its schedule."""
        ctx = self.ctx
        t_f = self.timeline.flush(ctx.writer, ctx.rank, step)
        loss = float(torch.stack([x.detach() for x in losses]).mean()) if losses else None
        fields = {
            "t_pipe": t[Mark.PIPE],
            "loss": loss,
            "stage": self.s,
            "dp_rank": self.replica.dp_rank,
            "microbatches": ctx.cfg.parallel.microbatches,
        }
        return Step(t, fields, t_fwd=t_f)

    def finish(self) -> None:
        """The wrapped p2p helpers report to no recorder any more."""
        ACTIVE["recorder"] = None


def _facts(cfg: RunConfig, replica, P: int, n_layers: int, recorded: bool) -> dict:
    """What rank 0 adds to config.json: the stages, one micro-batch's activation bytes and the traffic expected."""
    M = cfg.parallel.microbatches
    act = (cfg.batch_size // M) * cfg.seq_len * replica.facts["hidden"] * 4  # one micro-batch's activations, fp32
    p2p = replica.degrees["dp"] * (P - 1) * 2 * M * act  # over all ranks per step: each boundary, both ways, every one
    return {
        **replica.facts,
        "stages": P,
        "stage_layers": [list(r) for r in split_layers(n_layers, P)],
        "microbatch_activation_bytes": act,
        "p2p_recorded": recorded,
        "pp_schedule": cfg.parallel.schedule,
        "expected_bytes_per_step": {"send": p2p, "recv": p2p} if recorded else {},
        "pipeline_recording": "stage.forward_one_chunk / backward_one_chunk wrapped per micro-batch; sends and "
        "receives from torch.distributed.pipelining.schedules' p2p helpers",
    }


def _schedule_step(sched, s: int, P: int, batch: dict, losses: list, kwargs: dict) -> None:
    """One step of the schedule on stage `s` of `P`: the first stage feeds the tokens, the last the labels."""
    if s == 0 and s == P - 1:
        sched.step(batch["input_ids"], target=batch["labels"], losses=losses, **kwargs)
    elif s == 0:
        sched.step(batch["input_ids"], **kwargs)
    elif s == P - 1:
        sched.step(target=batch["labels"], losses=losses, **kwargs)
    else:
        sched.step(**kwargs)
