"""What the synchronous data-parallel strategies share in a rank: DDP ('ddp', 'ps': dtlab.rank.strategies.ddp) and
local SGD (dtlab.rank.strategies.local_sgd). One whole replica per rank on its share of the global batch, trained
with AdamW and its lr rule (dtlab.rank.optim), with the injected straggler delay (dtlab.rank.stragglers),
checkpoints (dtlab.rank.restarts), evaluations between steps (dtlab.rank.evaluation), a bucket recorder whose
no-op mode is the compute baseline (dtlab.rank.recorder), and the machine's snapshots around the steps.

A step runs `accumulate` micro-batches (only the last one communicates) and marks (FWD, k) and (BWD, k) for each, so
the loop (dtlab.rank.loop) sums the forwards; a subclass says how the model is wrapped and what it records beside
the buckets.
"""

from __future__ import annotations

from dtlab.config.convergence import lr_rule_text
from dtlab.config.stragglers import straggler_plan
from dtlab.rank.build import build_replica
from dtlab.rank.compression import Codec
from dtlab.rank.evaluation import Evaluator, eval_pause
from dtlab.rank.loop import Setup, Step, Strategy
from dtlab.rank.marks import rank_marks
from dtlab.rank.optim import Optimizer
from dtlab.rank.recorder import BucketRecorder, Mark, StepClock, optimizer_state_bytes, recorder_facts, tensor_bytes
from dtlab.rank.restarts import Checkpointer
from dtlab.rank.stragglers import Straggler, ddp_compute_s


class DataParallel(Strategy):
    """One replica per rank (see the module docstring). A subclass wraps the model (`wrap`), may reduce buckets
    its own way (`transport`), and adds its records before (`sync_records`) and after (`backend_records`) the
    buckets'."""

    noop_baseline = True
    machine_snapshots = True
    #: NCCL's own timing of each bucket's collective (backend_ms), read only where buckets are recorded
    nccl_timing = True

    def wrap(self, model, device):
        """The model the steps run (DDP, or the plain model)."""
        raise NotImplementedError

    def transport(self, device, backend):
        """How a divided bucket is reduced inside the recording hook; None: DDP's all-reduce."""
        return None

    def sync_records(self, step: int, baseline: bool) -> None:
        """Records of the step's own synchronisation, written before its buckets (local SGD's average)."""

    def backend_records(self, step: int, baseline: bool) -> None:
        """Records written after the step's buckets (DDP's own statistics)."""

    def setup(self) -> Setup:
        """Build the replica, wrap it, the recorder, optimizer and evaluator; the facts rank 0 records."""
        cfg, rank, world = self.ctx.cfg, self.ctx.rank, self.ctx.world
        rep = build_replica(
            cfg, rank, world, shards=world, shard=rank, nccl_timing=bool(cfg.record and self.nccl_timing)
        )
        device, backend = rep.device, rep.backend
        self.device, self.batches = device, rep.batches
        self.marks = rank_marks(device, backend)  # every clock of this rank: steps, buckets, local SGD's average
        self.straggler = Straggler(cfg.stragglers.slow, rank, world, device)
        self.model = model = rep.model.to(device)
        model.train()
        self.ddp = self.wrap(model, device)
        codec = None
        comp = cfg.compression
        if comp.hook != "none":
            codec = Codec(
                comp.hook, comp.powersgd_rank, comp.powersgd_start_iter, cfg.seed, serialize=backend == "gloo"
            )
        transport = self.transport(device, backend)
        self.recorder = BucketRecorder(world, device, codec, transport, backend=backend, marks=self.marks)
        self.register_hook()
        self.optim = Optimizer(cfg, self.ddp.parameters())  # AdamW, lr scaled and warmed up (config.convergence)
        self.opt = self.optim.opt
        self.evaluator = Evaluator(cfg, rep.tokenizer, rep.facts["data_source"], device, active=rank == 0)
        facts = {
            **rep.facts,
            "straggler": straggler_plan(cfg.stragglers.slow, world),
            **recorder_facts(self.recorder),
            **self.evaluator.facts,
            "lr_rule": lr_rule_text(cfg),
        }
        return Setup(device, backend, facts, rep.facts)

    def register_hook(self) -> None:
        """Install the recording comm hook where the model has one (DDP)."""

    def start(self) -> int:
        """Resume from a checkpoint when a group was restarted, evaluate before the first step; the first step."""
        ctx = self.ctx
        self.ckpt = Checkpointer(ctx.cfg, ctx.run_dir, ctx.rank, ctx.world, self.device, ctx.writer)
        first = self.ckpt.resume(self.ddp, self.opt)  # 0, or where a group restarted by torchrun goes on
        self.optim.resume_at(first)
        if first == 0:
            eval_pause(self.evaluator, self.model, 0, ctx.train_clock, ctx.writer, ctx.rank)
        self.clock = StepClock(self.device, self.marks)
        self.marks.seal()
        return first

    def step(self, step: int, paired: int | None) -> Step:
        """Training step `step`, or (`paired` set) the no-op hook baseline step on its paired step's batch."""
        cfg, baseline = self.ctx.cfg, paired is not None
        self.recorder.mode = "noop" if baseline else "allreduce"
        self.clock.mark(Mark.START)
        self.recorder.begin_step(self.clock.start)
        self.straggler.begin_step()
        out, slept = self._micro_batches(paired if baseline else step)  # a baseline: its step's batch again
        lr = self.optim.lr
        if not baseline:
            self.optimizer_step(step)
        self.step_start = self.clock.start
        t = self.clock.read()  # the step's one sync point on GPU
        fields = {"loss": float(out.loss.detach()), "micro_batches": cfg.ddp.accumulate, "straggle_s": slept, "lr": lr}
        return Step(t, fields)

    def _micro_batches(self, data_step: int):
        """Forward and backward of the step's micro-batches (only the last one communicates), the injected
        straggler delay before the last backward; returns (the last output, seconds slept)."""
        cfg, clock = self.ctx.cfg, self.clock
        slept = 0.0
        k_last = cfg.ddp.accumulate - 1
        for k in range(cfg.ddp.accumulate):
            batch = self.batches[(data_step * cfg.ddp.accumulate + k) % len(self.batches)]
            with self.accumulating(k < k_last):
                out = self.ddp(**batch)
                clock.mark(Mark.FWD, k)
                if k == k_last:  # every bucket this rank issues is late by the delay (see dtlab.config.stragglers)
                    slept = self.straggler.pause()
                # DDP's hook fires per bucket in the last backward, which returns once all buckets are reduced
                (out.loss / cfg.ddp.accumulate if cfg.ddp.accumulate > 1 else out.loss).backward()
                clock.mark(Mark.BWD, k)
        return out, slept

    def accumulating(self, no_sync: bool):
        """The context a micro-batch runs in (DDP: `no_sync` for all but the last)."""
        raise NotImplementedError

    def optimizer_step(self, step: int) -> None:
        """A training step's optimizer; marks Mark.OPT when the optimizer phase is over."""
        self.optim.step()
        self.opt.zero_grad(set_to_none=False)
        self.clock.mark(Mark.OPT)

    def after_step(self, step: int, paired: int | None, rec: dict) -> None:
        """The step's own records, its buckets, the straggler's observation; then (training) a checkpoint and an
        evaluation when due, or (baseline) this rank's own gradients dropped."""
        cfg, writer, rank, baseline = self.ctx.cfg, self.ctx.writer, self.ctx.rank, paired is not None
        self.sync_records(step, baseline)
        buckets = self.recorder.collect() if not baseline and cfg.record else []
        for b in buckets:
            writer.write("bucket", rank=rank, step=step, **b)
        self.straggler.observe(step, ddp_compute_s(buckets, rec["t_opt"], rec["straggle_s"]))
        self.backend_records(step, baseline)
        if baseline:
            self.opt.zero_grad(set_to_none=False)  # this rank's own gradients: never applied
            return
        self.ckpt.after_step(step, self.ddp, self.opt)  # every checkpoint_every training steps, after the records
        # rank 0 evaluates when due, every rank waits: no step clock runs meanwhile
        eval_pause(self.evaluator, self.model, step + 1, self.ctx.train_clock, writer, rank)

    def memory(self, final: bool) -> dict:
        """The replica's parameters, gradients and optimizer state."""
        params = list(self.model.parameters())
        return {
            "params_bytes": tensor_bytes(params),
            "grads_bytes": tensor_bytes(p.grad for p in params),
            "opt_bytes": optimizer_state_bytes(self.opt),
        }

    def finish(self) -> None:
        """The transport's thread stops."""
        self.recorder.transport.close()
