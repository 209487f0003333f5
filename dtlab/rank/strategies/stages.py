"""DistilBERT cut into pipeline stages: the first stage holds the embeddings, every stage a run of consecutive
transformer blocks (dtlab.config.parallel.split_layers), the last stage the classification head. A stage's
forward takes the hidden states (the first: the token ids) and, as a keyword argument, the micro-batch's 2-D
attention mask, which every stage has (all ranks of a replica read the same batch): each stage builds the model's
own attention mask from it with the function DistilBertModel uses, so no mask travels between stages and only
activations (micro-batch x seq_len x hidden) do.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask

from dtlab.config.parallel import split_layers


class Stage(nn.Module):
    """Blocks [start, stop) of `model` (a DistilBertForSequenceClassification), with the embeddings when `first`
    and the head when `last`. The modules are the model's own (no copy): its parameter names stay valid."""

    def __init__(self, model, start: int, stop: int, first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        self.start = start
        self.embeddings = model.distilbert.embeddings if first else None
        self.blocks = nn.ModuleList(model.distilbert.transformer.layer[start:stop])
        if last:
            self.pre_classifier, self.dropout, self.classifier = model.pre_classifier, model.dropout, model.classifier

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embeddings(x) if self.first else x
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=attention_mask)
        for block in self.blocks:
            h = block(h, mask)
        if not self.last:
            return h
        pooled = torch.relu(self.pre_classifier(h[:, 0]))  # as DistilBertForSequenceClassification does
        return self.classifier(self.dropout(pooled))


def make_stage(model, stages: int, index: int) -> Stage:
    """Stage `index` of `stages`."""
    start, stop = split_layers(int(model.config.n_layers), stages)[index]
    return Stage(model, start, stop, first=index == 0, last=index == stages - 1)


def stage_param_names(model, stage: Stage) -> set:
    """The model's parameter names that `stage` holds."""
    mine = {id(p) for p in stage.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in mine}
