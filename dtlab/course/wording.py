"""The labs' sentences that depend on where the ranks run: one text per placement, chosen from the placement the
lab's own config gets (dtlab.config.placement, the one `dtlab doctor` reports), so no CPU sentence reaches a GPU
machine and no GPU sentence a laptop.

Four kinds of placement (:func:`kind`):

- ``cpu``: gloo on CPU ranks; every figure is a CPU figure;
- ``host_staged``: gloo on CUDA tensors (ranks share a GPU): compute is GPU compute, every collective is staged
  through host memory and TCP loopback;
- ``nccl_shared``: NCCL with ranks sharing a GPU (no link is crossed);
- ``nccl``: NCCL, one GPU per rank: the real thing.

`text(key, placement)` returns a lab's passage (Markdown) for that kind; `show(key)` displays it for the lab's own
placement. Where a passage needs a number of this machine ({cores}, {ranks}, ...), :func:`facts` gives it.

On a host-staged placement a lab also says what the same communication would cost over NCCL:
:func:`nccl_estimate` prices a run's buckets with :data:`NCCL_REFERENCE`, an estimate from NCCL's own tuning model
and nccl-tests' published bus bandwidths, labelled as such wherever it is shown.
"""

from __future__ import annotations

import os

from dtlab.course import outputs
from dtlab.course.labs import lab_config
from dtlab.model.costmodel import ring_allreduce
from dtlab.units import fmt_time

KINDS = ("cpu", "host_staged", "nccl_shared", "nccl")

#: Reference links for an estimate of NCCL's ring all-reduce (ring form: 2(p-1) alpha + 2(p-1)/p n / busbw).
#: alpha: a ring step's latency, from NCCL's tuning model (src/graph/tuning.cc: base latency about 6.6 us LL to
#: 8.4 us Simple, plus a per-hop 0.6 to 3.4 us on NVLink), about 5 us a step, i.e. about 10 us for 2 ranks;
#: busbw: nccl-tests' bus bandwidth on 8 x H100 over NVLink (ring, about 370 GB/s) and on PCIe systems (20 to 35 GB/s).
NCCL_REFERENCE = {
    "NVLink": {"alpha_s": 5e-6, "busbw": 370e9},
    "PCIe": {"alpha_s": 5e-6, "busbw": 25e9},
}
NCCL_REFERENCE_SOURCE = (
    "an estimate, not a run: NCCL's tuning model (about 5 us per ring step) and nccl-tests' bus "
    "bandwidths (NVLink about 370 GB/s, PCIe about 25 GB/s)"
)


def kind(placement) -> str:
    """The kind of a placement (a dtlab.config.placement.Placement, or its dict as a run records it)."""
    get = placement.get if isinstance(placement, dict) else (lambda k, d=None: getattr(placement, k, d))
    if get("device") != "cuda":
        return "cpu"
    if get("backend") == "gloo":
        return "host_staged"
    return "nccl_shared" if int(get("ranks_per_gpu") or 1) > 1 else "nccl"


def lab_placement():
    """The placement of the lab's default config on this machine (the one `dtlab doctor` reports)."""
    return lab_config().placement()


def facts(placement=None) -> dict:
    """The numbers the passages may name: cores (this machine's CPU cores), ranks_per_gpu, gpus."""
    get = placement.get if isinstance(placement, dict) else (lambda k, d=None: getattr(placement, k, d))
    return {
        "cores": os.cpu_count() or 1,
        "ranks_per_gpu": int(get("ranks_per_gpu") or 1) if placement else 1,
        "gpus": int(get("gpus") or 0) if placement else 0,
    }


_HOST = (
    "gloo copies every bucket from the GPU to host memory, adds it over TCP loopback and copies it back, so "
    "T_comm here is a host-memory figure (lab 2 measured its alpha and bandwidth): NCCL between two GPUs over "
    "NVLink runs the same all-reduce about 100x faster"
)

#: key -> {kind or "gpu" (every CUDA kind) or "any": Markdown}
TEXTS = {
    "lab01.same_job": {
        "cpu": "## The same job on a GPU\n\nOn a CPU every number above is a CPU figure. dtlab ships this lab's job "
        "(DistilBERT, 2 ranks, batch 8 x 64 tokens per rank, 25 MiB buckets: what the lab runs in full mode "
        'on a CPU) recorded on one NVIDIA H200: `dtlab.recorded_run("h200-ddp")`. There the two ranks '
        "shared the GPU and talked through gloo (torch 2.11's NCCL cannot put two ranks on one GPU): compute "
        "is real GPU compute, every all-reduce is staged through host memory. The table sets it beside your "
        "run, with where each ran; below it, your run's own buckets are priced over NCCL on two reference "
        "links (an estimate from NCCL's tuning model and nccl-tests, labelled so).",
        "host_staged": "## What this run would cost over NCCL\n\nYour ranks share one GPU and talk through gloo: "
        f"compute above is real GPU compute, but {_HOST}. The cell below prices your run's own buckets "
        "on two reference links with NCCL's ring all-reduce (an estimate from NCCL's tuning model "
        "and nccl-tests, labelled so), beside what gloo took here.",
        "gpu": "## The same job recorded elsewhere\n\nYour ranks ran with NCCL on GPUs: the numbers above are the "
        "real thing. dtlab also ships this job recorded on one NVIDIA H200 (two ranks sharing it through "
        "gloo); the cell below says where the record is.",
    },
    "lab01.questions": {
        "any": "## Question\n\n1. Which bucket's all-reduce is **not** hidden behind backward compute, and why can it "
        "never be? (The timeline draws the end of backward where the rank waits for its all-reduces as a "
        "wait, not as compute.)\n2. Compare your predictions with the check above. Where did the number of "
        "buckets differ from `ceil(grad_bytes / bucket cap)`, and why? (Hint: DDP closes a bucket once it "
        "reaches the cap, and the word-embedding matrix is a single tensor.)\n3. {q3}",
        "cpu_q3": "On this CPU, T_comp from the no-op baseline can be *smaller* than the compute inside a real step. "
        "What competes with backward compute for the {cores} cores?",
        "host_staged_q3": "Here {ranks_per_gpu} ranks share one GPU and gloo stages every all-reduce through host "
        "memory. What competes with one rank's backward compute on the GPU, and what does the "
        "host's copy of each bucket cost that NCCL would not?",
        "nccl_shared_q3": "Here {ranks_per_gpu} ranks share one GPU under NCCL. What do NCCL's kernels and the other "
        "rank's backward compete for on the GPU, and why is T_comm not a network figure?",
        "nccl_q3": "NCCL's all-reduce kernels run on the same GPU as backward compute. What do they compete for "
        "(streaming multiprocessors, memory bandwidth), and how would you see it in T_comp?",
    },
    "lab03.exercises": {
        "any": "Exercises: (a) set the slider's bandwidth to a 100 Gb/s network (12.5 GB/s) and alpha to 10 us: "
        "which bucket size is best for 64 GPUs with this model's gradients? (b) {b}",
        "cpu_b": "rerun the sweep on a GPU machine and compare the overlap with these CPU numbers.",
        "host_staged_b": "gloo staged this sweep through host memory. Set the sliders to NCCL over NVLink (alpha "
        "about 5 us, 1/beta about 370 GB/s: nccl-tests' bus bandwidth, an estimate): where does the "
        "best bucket cap move, and does a small cap still pay?",
        "gpu_b": "rerun the sweep with `lab_config(nproc=...)` at every GPU count this machine has and compare the "
        "overlap with the explorer's prediction at the same counts.",
    },
    "lab02.reduce_scatter": {
        "cpu": "## Honesty about gloo: its reduce-scatter\n\nOn gloo, `reduce_scatter_tensor` is implemented as an "
        "all-reduce followed by keeping one chunk: it moves about twice the data of a real reduce-scatter. "
        "Compare the fitted per-byte costs: if reduce-scatter were the real thing, its ring beta term "
        "(p-1)/p n beta would make it about half an all-reduce.",
        "host_staged": "## Honesty about gloo: its reduce-scatter\n\nYour ranks talk through gloo, on CUDA tensors "
        "staged through host memory. On gloo, `reduce_scatter_tensor` is implemented as an all-reduce "
        "followed by keeping one chunk: it moves about twice the data of a real reduce-scatter. "
        "Compare the fitted per-byte costs: if reduce-scatter were the real thing, its ring beta term "
        "(p-1)/p n beta would make it about half an all-reduce.",
        "gpu": "## Reduce-scatter on NCCL\n\nNCCL runs a real ring reduce-scatter: its beta term (p-1)/p n beta "
        "makes it about half an all-reduce of the same n. Compare the fitted per-byte costs below. (On gloo, "
        "the backend of a machine without GPUs, it is an all-reduce followed by keeping one chunk: twice the "
        "data.)",
    },
    "lab02.q4": {
        "cpu": "On this CPU, compare reduce-scatter and all-reduce at the largest size. Does gloo's reduce-scatter "
        "look like half an all-reduce? What does that mean for ZeRO-3 on a CPU (lab 4)?",
        "host_staged": "Compare reduce-scatter and all-reduce at the largest size. Does gloo's reduce-scatter, staged "
        "through host memory, look like half an all-reduce? What does that mean for ZeRO-3 on this "
        "machine (lab 4)?",
        "gpu": "Compare reduce-scatter and all-reduce at the largest size. Is NCCL's reduce-scatter about half an "
        "all-reduce, as the ring form says? What does that mean for ZeRO-3's communication (lab 4)?",
    },
    "lab09.intro_time": {
        "cpu": "it reaches the target within its steps on this machine's {cores} CPU cores",
        "gpu": "it reaches the target within its steps on this GPU machine",
    },
    "lab09.model_off": {
        "cpu": "on {cores} CPU cores: ranks that share cores with each other and with gloo's threads, a server that "
        "shares them with its workers",
        "host_staged": "ranks that share one GPU, every message staged through host memory by gloo, a server that "
        "shares the host with its workers",
        "gpu": "ranks whose kernels share the GPUs with NCCL's, a server that waits on the host",
    },
    # lab 12 (what does it cost?)
    "lab12.figures": {
        "cpu": "**These are CPU figures, priced as if they were GPUs.** Your ranks run on CPU cores, and the bill "
        "below prices the CPU machine at the price table's `CPU` row (the example table prices it like a GPU, "
        "which no provider does) in machine-hours, one machine for all its ranks: the arithmetic is the real "
        "one, the numbers are not a GPU's. Run the lab on a GPU machine for real figures.",
        "host_staged": "**Real GPU compute, host-staged communication.** Your ranks share one GPU and talk through "
        "gloo, which copies every bucket through host memory: the compute is a GPU's, the all-reduce is far "
        "slower than NCCL's. The bill prices the GPU the run used at the price table's row for its kind.",
        "gpu": "**Real figures.** Your ranks ran with NCCL on GPUs: the bill prices the GPUs the run used at the "
        "price table's row for their kind (an example price unless you set your own).",
    },
    "lab12.restart": {
        "cpu": "On this CPU machine a restart takes a second or two: dtlab's warm agent keeps torch imported, and the "
        "tiny checkpoint loads from a local disk. On a cloud GPU a spot restart means a new instance, an image, "
        "the data and a checkpoint of gigabytes: minutes (exercise b tries R = 300 s).",
        "gpu": "A restart here reuses this machine. A spot restart on a cloud means a new instance, an image, the "
        "data and the checkpoint: minutes. Try R = 300 s in the plan below.",
    },
}


def text(key: str, placement=None) -> str:
    """Passage `key` for `placement` (a Placement or its dict; default: the lab's own placement), with this
    machine's facts filled in. KeyError naming the known keys when `key` has none."""
    if key not in TEXTS:
        raise KeyError(f"no passage {key!r}; known: {sorted(TEXTS)}")
    placement = lab_placement() if placement is None else placement
    k = kind(placement)
    entry, values = TEXTS[key], facts(placement)
    for part in ("q3", "b"):  # a passage with a placement-dependent slot
        for choice in (f"{k}_{part}", f"gpu_{part}" if k != "cpu" else None, f"any_{part}"):
            if choice and choice in entry:
                values[part] = entry[choice].format(**values)
                break
    for choice in (k, "gpu" if k != "cpu" else None, "any"):
        if choice and choice in entry:
            return entry[choice].format(**values)
    raise KeyError(f"passage {key!r} has no text for placement kind {k!r}")


def show(key: str, placement=None) -> None:
    """Display passage `key` as Markdown (printed outside IPython)."""
    body = text(key, placement)
    if not outputs.display_bundle({"text/markdown": body, "text/plain": body}):  # the plain text is what a test reads
        print(body)


def nccl_estimate(run) -> dict:
    """A DDP run's communication priced over NCCL on the reference links (:data:`NCCL_REFERENCE`): {link: seconds
    of all-reduce a step}, the buckets of the run's median measured step (rank 0) each priced alone with the ring
    form, summed. An estimate from published figures, not a measurement (:data:`NCCL_REFERENCE_SOURCE`)."""
    b = run.buckets
    if b is None or b.empty:
        return {}
    b = b[(b["rank"] == b["rank"].min()) & (b["step"] >= int(getattr(run, "warmup", 0) or 0))]
    if b.empty:
        return {}
    col = "wire_bytes" if "wire_bytes" in b and b["wire_bytes"].notna().all() else "nbytes"
    step = int(b["step"].max())
    sizes = [float(n) for n in b.loc[b["step"] == step, col]]
    p = int(run.nproc)
    return {
        link: float(sum(ring_allreduce(ref["alpha_s"], 1.0 / ref["busbw"], n, p) for n in sizes))
        for link, ref in NCCL_REFERENCE.items()
    }


def nccl_beside(run) -> str:
    """One line per reference link: the run's measured T_comm beside the NCCL estimate for its buckets (text)."""
    est = nccl_estimate(run)
    if not est:
        return "no buckets recorded: nothing to price over NCCL"
    t_comm = float(run.summary().set_index("quantity").loc["T_comm", "value"])
    lines = [f"T_comm per step, measured here (gloo through host memory): {fmt_time(t_comm)}"]
    for link, t in est.items():
        lines.append(
            f"  the same buckets over NCCL on {link}: {fmt_time(t)} (1/{t_comm / t:,.0f} of it)"
            if t > 0
            else f"  the same buckets over NCCL on {link}: n/a"
        )
    lines.append(f"  ({NCCL_REFERENCE_SOURCE}; each bucket priced alone, ring form, {run.nproc} ranks)")
    return "\n".join(lines)
