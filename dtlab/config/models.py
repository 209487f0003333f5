"""The models a run may name, and where their weights can come from on this machine."""

from __future__ import annotations

import os
import socket

HUB_ID = "distilbert-base-uncased"


DISTILBERT_PARAMS = 66_955_010  # with the 2-label head; comm volume is 4 bytes each in fp32


# Tiny but structurally identical to DistilBERT (same module types, same vocabulary), so bucketing and hooks
# behave the same way while a step costs milliseconds on a CPU.
TINY_ARCH = dict(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=512)
#: DistilBertConfig()'s defaults: the distilbert-base-uncased architecture.
DISTILBERT_ARCH = dict(vocab_size=30522, dim=768, n_layers=6, n_heads=12, hidden_dim=3072, max_position_embeddings=512)


def model_arch(model: str) -> dict:
    """The DistilBertConfig fields of a `RunConfig.model` ('distilbert' or 'tiny'): what a split of the model over
    ranks (heads and FFN columns for tensor parallelism, layers for a pipeline) is checked against."""
    archs = {"distilbert": DISTILBERT_ARCH, "tiny": TINY_ARCH}
    if model not in archs:
        raise ValueError(f"model must be one of {', '.join(map(repr, archs))}, got {model!r}")
    return dict(archs[model])


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
