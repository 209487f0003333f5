"""Strategy 'ddp': DistributedDataParallel with a recording comm hook, one rank per process. The same loop runs
local SGD (`local_sgd`: a plain model per rank, dtlab.rank.local_sgd) and evaluates between steps (`eval_every`,
dtlab.rank.evaluation)."""

from __future__ import annotations

import contextlib
import inspect
import time

from dtlab.config.run import RunConfig


def make_batches(cfg: RunConfig, tokenizer, sentences, labels, rank: int, world: int, device):
    """Tokenise this rank's share once, padded/truncated to exactly seq_len so every step has one shape."""
    import torch

    mine_s, mine_l = sentences[rank::world], labels[rank::world]
    enc = tokenizer(mine_s, padding="max_length", truncation=True, max_length=cfg.seq_len, return_tensors="pt")
    y = torch.tensor(mine_l, dtype=torch.long)
    out = []
    for i in range(0, len(mine_s) - cfg.batch_size + 1, cfg.batch_size):
        sl = slice(i, i + cfg.batch_size)
        out.append(
            {
                "input_ids": enc["input_ids"][sl].to(device),
                "attention_mask": enc["attention_mask"][sl].to(device),
                "labels": y[sl].to(device),
            }
        )
    return out


def build_everything(cfg: RunConfig, run_dir: str, rank: int, world: int, nccl_timing: bool = False):
    """Process group, model, tokenizer and batches, shared by the DDP and ZeRO-3 paths (`nccl_timing`: switch on
    NCCL's own per-collective timing, for a run that reads it)."""
    import torch

    from dtlab.rank.data import apply_dropout, build_model, load_sentences
    from dtlab.rank.lifecycle import setup_distributed
    from dtlab.rank.optim import settle_lr

    device, backend = setup_distributed(cfg, rank, world, nccl_timing=nccl_timing)
    torch.manual_seed(cfg.seed)
    built = build_model(cfg.model, cfg.model_source, cfg.model_path, cfg.seed)
    lr = settle_lr(cfg, built)  # cfg.lr: explicit, or the default for these weights
    apply_dropout(built.model, getattr(cfg, "dropout", None))
    # training steps only: a baseline step reuses the batch of the training step it is paired with, so the data (and
    # the losses) of a run do not depend on how many baseline steps it has
    sentences, labels, data_src = load_sentences(
        cfg.data, cfg.steps * cfg.accumulate * cfg.batch_size * world, cfg.seed
    )
    batches = make_batches(cfg, built.tokenizer, sentences, labels, rank, world, device)
    nparams = sum(p.numel() for p in built.model.parameters())
    sources = {
        "model_source": built.model_source,
        "tokenizer_source": built.tokenizer_source,
        "data_source": data_src,
        "lr": lr,
        "num_parameters": nparams,
        "grad_bytes": sum(p.numel() * p.element_size() for p in built.model.parameters() if p.requires_grad),
        # per-parameter gradient bytes in registration order: what-if bucket layouts are built from it
        "param_nbytes": [p.numel() * p.element_size() for p in built.model.parameters() if p.requires_grad],
    }
    return device, backend, built, batches, sources


def train(cfg: RunConfig, run_dir: str, rank: int, world: int, writer, make_transport=None) -> None:
    """The DDP training loop. `make_transport(world, device, backend)`, when given, builds how each divided
    bucket is reduced inside the recording hook (strategy 'ps': reduce to rank 0 + broadcast); None keeps
    DDP's all-reduce."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dtlab.config.baseline import run_order
    from dtlab.config.busy import snapshot
    from dtlab.config.convergence import lr_rule_text
    from dtlab.config.stragglers import straggler_plan
    from dtlab.rank.evaluation import Evaluator, TrainClock, eval_pause
    from dtlab.rank.lifecycle import maybe_inject_fault, record_resolved
    from dtlab.rank.local_sgd import LocalSGD, digest_due
    from dtlab.rank.marks import rank_marks
    from dtlab.rank.optim import Optimizer
    from dtlab.rank.recorder import (
        BucketRecorder,
        StepClock,
        optimizer_state_bytes,
        peak_memory,
        recorder_facts,
        tensor_bytes,
    )
    from dtlab.rank.restarts import Checkpointer
    from dtlab.rank.stragglers import Straggler, ddp_compute_s

    # NCCL's own timing of each bucket's collective (backend_ms) is read only when buckets are recorded
    device, backend, built, batches, sources = build_everything(
        cfg, run_dir, rank, world, nccl_timing=bool(cfg.record and not cfg.local_sgd)
    )
    marks = rank_marks(device, backend)  # every clock of this rank: steps, buckets, local SGD's average
    straggler = Straggler(cfg.straggler, rank, world, device)
    model = built.model.to(device)
    model.train()
    # local SGD: a plain model per rank, its parameters averaged every H steps (dtlab.rank.local_sgd)
    local = LocalSGD(model, cfg.local_sgd, world, device, marks) if cfg.local_sgd else None
    # broadcast_buffers=False: dtlab's models have one buffer, the constant position ids (512 int64, 4,096 B);
    # DDP would broadcast it at the start of every forward, a collective that T_fwd and T_comp would count as
    # compute. Nothing needs it: no buffer changes during training (no BatchNorm statistics). torch 2.13 renamed
    # the argument forward_sync_buffers (and warns on the old name); older versions only know broadcast_buffers.
    no_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP).parameters
        else {"broadcast_buffers": False}
    )
    ddp = (
        model
        if local
        else DDP(
            model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cfg.bucket_mb, **no_sync
        )
    )
    codec = None
    if cfg.comm_hook != "none":
        from dtlab.rank.compression import Codec

        codec = Codec(cfg.comm_hook, cfg.powersgd_rank, cfg.powersgd_start_iter, cfg.seed, serialize=backend == "gloo")
    transport = make_transport(world, device, backend) if make_transport is not None else None
    recorder = BucketRecorder(world, device, codec, transport, backend=backend, marks=marks)
    if (cfg.record or cfg.baseline_steps) and not local:  # the baseline needs the hook to switch to no-op
        ddp.register_comm_hook(None, recorder.hook)
    optim = Optimizer(cfg, ddp.parameters())  # AdamW, lr scaled and warmed up (dtlab.config.convergence)
    opt = optim.opt
    evaluator = Evaluator(cfg, built.tokenizer, sources["data_source"], device, active=rank == 0)
    if rank == 0:
        record_resolved(
            run_dir,
            cfg,
            backend,
            device,
            {
                **sources,
                "straggler": straggler_plan(cfg.straggler, world),
                **recorder_facts(recorder),
                **evaluator.facts,
                "lr_rule": lr_rule_text(cfg),
            },
            world,
        )
    writer.write("ready", rank=rank, time=time.time(), **sources)
    ckpt = Checkpointer(cfg, run_dir, rank, world, device, writer)
    first = ckpt.resume(ddp, opt)  # 0, or where a group restarted by torchrun goes on (dtlab.rank.restarts)
    optim.resume_at(first)
    train_clock = TrainClock()  # training time for the evaluations: evaluations excluded
    if first == 0:
        eval_pause(evaluator, model, 0, train_clock, writer, rank)

    clock = StepClock(device, marks)
    marks.seal()
    ddp_forwards: list[
        int | None
    ] = []  # per synchronised DDP forward in this process: its training step (None: baseline)
    optim_s = 0.0  # the last training step's optimizer time: a baseline step's t_opt (see below)
    # how busy the machine is while the steps run (dtlab.config.busy): this rank's CPU time, rank 0 the machine's
    writer.write("machine", rank=rank, phase="start", **snapshot(machine=rank == 0))
    from dtlab.rank.profiling import StepProfiler

    profiler = StepProfiler(cfg, run_dir, rank, device, run_order(cfg.steps, cfg.warmup, cfg.baseline_steps, first))
    for step, paired in run_order(cfg.steps, cfg.warmup, cfg.baseline_steps, first):
        profiler.begin(step, paired)  # cfg.profile: one ProfilerStep per step (dtlab.rank.profiling)
        maybe_inject_fault(rank, step)
        baseline = paired is not None  # a no-op hook step right after the training step it is paired with
        recorder.mode = "noop" if baseline else "allreduce"
        if baseline:
            t_baseline = time.perf_counter()  # not training time: left out of the evaluations' clock
            rng = rng_state(device)  # dropout draws from it: given back after the step
        else:
            train_clock.start()
        clock.mark("start")
        recorder.begin_step(clock.start)
        straggler.begin_step()
        slept = 0.0
        k_last = cfg.accumulate - 1
        data_step = paired if baseline else step  # a baseline step computes its training step's batch again
        for k in range(cfg.accumulate):  # micro-batches; only the last one communicates
            batch = batches[(data_step * cfg.accumulate + k) % len(batches)]
            with ddp.no_sync() if k < k_last and not local else contextlib.nullcontext():
                out = ddp(**batch)
                clock.mark(f"fwd{k}")
                if k == k_last:  # every bucket this rank issues is late by the delay (see dtlab.config.stragglers)
                    slept = straggler.pause()
                # DDP's hook fires per bucket in the last backward, which returns once all buckets are reduced
                (out.loss / cfg.accumulate if cfg.accumulate > 1 else out.loss).backward()
                clock.mark(f"bwd{k}")
        lr = optim.lr
        averaged = None
        if not baseline:
            optim.step()
            opt.zero_grad(set_to_none=False)
            if local:
                clock.mark("optim")
            averaged = local.after_step(step) if local else None  # inside the step, as t_opt
            clock.mark("opt")
        step_start = clock.start
        t = clock.read()  # the step's one sync point on GPU
        t_fwd = sum(t[f"fwd{k}"] - (t[f"bwd{k - 1}"] if k else 0.0) for k in range(cfg.accumulate))
        t_bwd_end = t[f"bwd{k_last}"]
        if baseline:
            # A baseline step does not step the optimizer: the model, the optimizer's state and the schedule stay
            # those of the training steps. Its optimizer time is the one its paired training step measured just
            # before (the optimizer communicates nothing), so its t_step is forward + backward + that time.
            t_opt, t_step = optim_s, t_bwd_end + optim_s
        else:
            t_opt, t_step = t["opt"] - t_bwd_end, t["opt"]
            optim_s = (t["optim"] if local else t["opt"]) - t_bwd_end
        rec = {
            "rank": rank,
            "step": step,
            "t_fwd": t_fwd,
            "t_bwd": t_bwd_end - t_fwd,
            "t_opt": t_opt,
            "t_step": t_step,
            "loss": float(out.loss.detach()),
            "micro_batches": cfg.accumulate,
            "straggle_s": slept,
            "lr": lr,
            "time": time.time(),
        }
        if baseline:
            rec["paired_step"] = paired
        writer.write("baseline_step" if baseline else "step", **rec)
        if averaged:
            writer.write("collective", rank=rank, step=step, **local.seconds(averaged, step_start))
        if local and not baseline and digest_due(step, cfg.local_sgd, cfg.steps - 1):  # ranks agree? (not timed)
            t0 = time.perf_counter()
            local.digest_event(writer, rank, step, averaged=averaged is not None)
            train_clock.exclude(time.perf_counter() - t0)
        buckets = recorder.collect() if not baseline and cfg.record else []
        for b in buckets:
            writer.write("bucket", rank=rank, step=step, **b)
        straggler.observe(step, ddp_compute_s(buckets, rec["t_opt"], slept))
        if not local:
            # DDP logs a forward's runtime stats in the next synchronised forward (these are the previous one's),
            # and only for its sampled iterations (<= 10 and every 100th): skip the logging-data call on the others.
            ddp_forwards.append(None if baseline else step)
            done = len(ddp_forwards) - 1  # DDP's count of finished iterations when this forward logged
            if done >= 1 and (done <= 10 or done % 100 == 0) and ddp_forwards[done - 1] is not None:
                _write_ddp_stats(ddp, writer, rank, ddp_forwards[done - 1], done)
        if baseline:
            opt.zero_grad(set_to_none=False)  # this rank's own gradients: never applied
            set_rng_state(device, rng)
            if world > 1:  # no collective aligned the ranks in this step: start the next training step together
                barrier(device)
            train_clock.exclude(time.perf_counter() - t_baseline)
            continue
        ckpt.after_step(step, ddp, opt)  # every checkpoint_every training steps, after the step's records
        # rank 0 evaluates when due, every rank waits: no step clock runs meanwhile
        eval_pause(evaluator, model, step + 1, train_clock, writer, rank)
        if step == 0:
            writer.write(
                "memory",
                rank=rank,
                params_bytes=tensor_bytes(model.parameters()),
                grads_bytes=tensor_bytes(p.grad for p in model.parameters()),
                optim_bytes=optimizer_state_bytes(opt),
                peak_bytes=None,
                peak_kind=None,
            )

    profiler.finish()
    writer.write("machine", rank=rank, phase="end", **snapshot(machine=rank == 0))
    recorder.transport.close()
    peak, kind = peak_memory(device)
    writer.write(
        "memory",
        rank=rank,
        params_bytes=tensor_bytes(model.parameters()),
        grads_bytes=tensor_bytes(p.grad for p in model.parameters()),
        optim_bytes=optimizer_state_bytes(opt),
        peak_bytes=peak,
        peak_kind=kind,
    )
    try:  # DDP's own view (bucket sizes, comm hook, ...), a free cross-check
        if local:
            return
        data = ddp._get_ddp_logging_data()
        writer.write(
            "ddp_logging",
            rank=rank,
            data={k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in data.items()},
        )
    except Exception as e:  # noqa: BLE001 - private API, may change between torch versions
        writer.write("ddp_logging", rank=rank, data={"error": repr(e)})


_DDP_STATS = (
    "backward_comm_time",
    "backward_compute_time",
    "backward_compute_comm_overlap_time",
    "forward_compute_time",
)


def rng_state(device) -> dict:
    """The random number generators a step draws from (dropout): the CPU's, and the GPU's on CUDA."""
    import torch

    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(device, state: dict) -> None:
    """Give back what `rng_state` took: a baseline step leaves the training steps' dropout masks as they were."""
    import torch

    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def barrier(device) -> None:
    """Every rank waits for the others (not timed); NCCL is told which GPU this rank uses."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def _write_ddp_stats(ddp, writer, rank: int, step: int, iteration: int) -> None:
    """DDP's own runtime stats for training `step`, logged by DDP when its finished-iteration count was `iteration`
    (its timers: CUDA events on GPU, wall clock on CPU; nanoseconds, written here in seconds): a cross-check of
    dtlab's events that costs nothing inside the step."""
    try:
        data = ddp._get_ddp_logging_data()
        if int(data.get("iteration", -1)) != iteration:  # DDP samples iterations <= 10 and every 100th only
            return
        writer.write(
            "ddp_stats",
            rank=rank,
            step=step,
            **{k: data[k] / 1e9 for k in _DDP_STATS if isinstance(data.get(k), (int, float))},
        )
    except Exception:  # noqa: BLE001 - private API, may change between torch versions
        pass
