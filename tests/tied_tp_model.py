"""A model whose output layer's weight is tied to a module no tensor-parallel pattern names (`aux`),
for tests/test_tp_ties.py: `shard vocab of "embed", "head"` divides `head.weight`, which `aux` reads
whole."""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from examples.llama_tp import LlamaTP, example_batch  # noqa: F401 (piper check --model reads it)


class TiedAux(LlamaTP):
    def __init__(self, **sizes):
        super().__init__(**sizes)
        self.aux = nn.Linear(self.head.in_features, self.head.out_features, bias=False)
        self.aux.weight = self.head.weight

    def forward(self, idx, targets):
        loss = super().forward(idx, targets)
        logits = self.aux(self.embed(idx))
        return loss + F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_model(seed: int = 0) -> TiedAux:
    import torch

    torch.manual_seed(seed)
    return TiedAux(stages=1)


def make_q_o_tied(seed: int = 0) -> LlamaTP:
    """Block 0's attention output weight tied to its query weight: columns divide the one along
    dimension 0, rows the other along dimension 1."""
    import torch

    torch.manual_seed(seed)
    model = LlamaTP(stages=1)
    model.blocks[0].attn.o.weight = model.blocks[0].attn.q.weight
    return model
