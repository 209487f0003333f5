"""Checkpoint and resume inside a rank (strategy 'ddp'), with torch.distributed.checkpoint (DCP).

What a checkpoint holds: the model and AdamW state (`get_state_dict`, fully-qualified names), the number of
training steps done K, and every rank's RNG states (CPU, and CUDA on a GPU), gathered so that each rank saves the
same keys (DCP requires it) and DCP's de-duplication writes each replicated tensor once. The batch of a step depends
only on the step index (dtlab.rank.strategies.ddp), so the data position is K itself. Together these make a resumed
step compute exactly what the uninterrupted run computed (tests/integration/test_checkpoint.py checks the losses).

Complete or absent: DCP writes into checkpoints/.tmp-step-K-a<attempt>; DCP's save ends with a collective in which
rank 0 writes the metadata after every rank reported its files written, so when it returns on rank 0 the folder is
complete; after a barrier at which every rank has measured the bytes of its own files there (from the files:
torch 2.11's `dcp.save` returns no sizes), rank 0 renames it to checkpoints/step-K (a rename is atomic). Older ones
beyond the last `KEEP` are renamed away before they are deleted, so a half-deleted folder never carries a `step-K`
name.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import torch
import torch.distributed as dist

from dtlab.rank.compat import checkpoint_bytes_written

# torch.distributed.checkpoint (DCP) takes about a second to import: it is imported inside the methods that save or
# load, so that only a run that checkpoints (or resumes) pays for it.

KEEP = 2  # checkpoints kept: the newest, and one in case the newest turns out unreadable
_NAME = re.compile(r"^step-(\d+)$")


def current_attempt() -> int:
    """torchrun's restart count for this process group: 0 on the first attempt, 1 after the first restart, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(K, path) of every complete checkpoint under `root` (folders step-K holding DCP's .metadata), oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        if m and os.path.isfile(os.path.join(root, name, ".metadata")):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def _retire(path: str) -> None:
    """Rename out of the step-K namespace (atomic), then delete."""
    trash = os.path.join(os.path.dirname(path), f".trash-{os.path.basename(path)}-{os.getpid()}-{time.time_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


class Checkpointer:
    """Saves every `restarts.checkpoint_every` training steps, and resumes a restarted rank from the newest
    checkpoint."""

    def __init__(self, restarts, total_steps: int, run_dir: str, rank: int, world: int, device, writer):
        """`restarts`: the run's restarts group (`checkpoint_every`; 0: never); `total_steps`: its training steps
        (no checkpoint after the last)."""
        self.every, self.steps = restarts.checkpoint_every, total_steps
        self.root = os.path.join(run_dir, "checkpoints")
        self.rank, self.world, self.device, self.writer = rank, world, device, writer
        self.attempt = current_attempt()

    # ---- state ------------------------------------------------------------------------------------------
    def _rng_now(self) -> dict[str, torch.Tensor]:
        states = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.device)
        return states

    def _state(self, model, opt, done: int, rng: dict[str, torch.Tensor]) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)  # a fresh optimizer gets its state allocated (lr 0 step), for load
        return {"model": msd, "optim": osd, "progress": torch.tensor(done, dtype=torch.int64), "rng": rng}

    def _gathered_rng(self) -> dict[str, torch.Tensor]:
        """Every rank's RNG states as [world, n] byte tensors, the same on every rank."""
        mine = self._rng_now()
        every: list = [None] * self.world
        dist.all_gather_object(every, {k: v.numpy().tobytes() for k, v in mine.items()})
        return {k: torch.stack([torch.frombuffer(bytearray(e[k]), dtype=torch.uint8) for e in every]) for k in mine}

    # ---- save -------------------------------------------------------------------------------------------
    def after_step(self, step: int, model, opt) -> None:
        """Save when `step` completes a multiple of checkpoint_every training steps (never in baseline steps)."""
        done = step + 1
        if self.every and done <= self.steps and done % self.every == 0:
            self.save(done, model, opt)

    def save(self, done: int, model, opt) -> None:
        """Write checkpoint step-`done` (collective: every rank calls it) and record a `checkpoint` event with the
        seconds this rank spent (t_save, s) and the bytes it wrote (nbytes, B; rank 0 adds dir_bytes, the whole
        folder)."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        state = self._state(model, opt, done, self._gathered_rng())
        tmp = os.path.join(self.root, f".tmp-step-{done}-a{self.attempt}")
        dcp.save(state, checkpoint_id=tmp)  # returns when every rank's files and the metadata are written
        nbytes = checkpoint_bytes_written(tmp, self.rank)  # from the files: torch 2.11's metadata lacks the sizes
        dist.barrier()  # every rank has measured its files in the .tmp folder before rank 0 renames it
        dir_bytes = None
        if self.rank == 0:  # save returned on rank 0: every rank's files and the metadata are written
            final = os.path.join(self.root, f"step-{done}")
            if os.path.exists(final):
                _retire(final)
            os.rename(tmp, final)
            for _, old in complete_checkpoints(self.root)[:-KEEP]:
                _retire(old)
            dir_bytes = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
        self.writer.write(
            "checkpoint",
            rank=self.rank,
            step=done,
            name=f"step-{done}",
            t_save=time.perf_counter() - t0,
            nbytes=nbytes,
            dir_bytes=dir_bytes,
            time=time.time(),
        )

    # ---- resume -----------------------------------------------------------------------------------------
    def resume(self, model, opt) -> int:
        """The first step this attempt runs. 0 on the first attempt. On a restart (TORCHELASTIC_RESTART_COUNT > 0):
        the newest complete checkpoint is loaded into `model` and `opt`, the RNG states restored, a `restart` event
        written, and its K returned (0, from scratch, when there is none)."""
        if self.attempt == 0:
            return 0
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        choice = [None]
        if self.rank == 0:  # one decision for all ranks; leftovers of the attempt that died are removed first
            if os.path.isdir(self.root):
                for name in os.listdir(self.root):
                    if name.startswith((".tmp-", ".trash-")):
                        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            found = complete_checkpoints(self.root)
            choice = [found[-1] if found else None]
        dist.broadcast_object_list(choice, src=0)
        done, name = 0, None
        if choice[0] is not None:
            k, path = choice[0]
            shapes = {name: (self.world, now.numel()) for name, now in self._rng_now().items()}
            state = self._state(model, opt, 0, {name: torch.empty(s, dtype=torch.uint8) for name, s in shapes.items()})
            dcp.load(state, checkpoint_id=path)
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            done, name = int(state["progress"]), os.path.basename(path)
            if done != k:
                raise RuntimeError(f"checkpoint {path} holds {done} steps done, its name says {k}")
            torch.set_rng_state(state["rng"]["cpu"][self.rank].clone())  # last: nothing after it draws numbers
            if "cuda" in state["rng"]:
                torch.cuda.set_rng_state(state["rng"]["cuda"][self.rank].clone(), self.device)
        self.writer.write(
            "restart",
            rank=self.rank,
            attempt=self.attempt,
            resumed_from=done,
            checkpoint=name,
            t_load=time.perf_counter() - t0,
            time=time.time(),
        )
        return done
