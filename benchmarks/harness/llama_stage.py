"""Torch's pipeline stages of a Hugging Face Llama (`examples.train_hf.CausalLM`), built from the
library's own modules: the torch side of the `hf-llama` family and of the FSDP2 x pipelining baseline.
"""
from __future__ import annotations

import torch


class LlamaStage(torch.nn.Module):
    """Stage `stage` of `examples.train_hf.CausalLM` over a Hugging Face Llama, for `PipelineStage`.

    It reuses the library's own modules (embedding, decoder layers, rotary
    embedding, norm, head) and calls them as `LlamaModel.forward` does for a
    batch without padding: positions 0..T-1 and a causal mask."""

    def __init__(self, causal_lm, stage: int, stages: int):
        super().__init__()
        inner = causal_lm.m.model
        layers = list(inner.layers)
        per = len(layers) // stages
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.layers = torch.nn.ModuleList(layers[stage * per:(stage + 1) * per])
        if self.last:
            self.norm, self.lm_head = inner.norm, causal_lm.m.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.first else x
        t = h.shape[1]
        positions = torch.arange(t, device=h.device).unsqueeze(0)
        rotary = self.rotary_emb(h, positions)
        # An additive causal mask, which both the eager and the SDPA attention of transformers take.
        mask = torch.full((t, t), float("-inf"), device=h.device, dtype=h.dtype).triu(1)[None, None]
        for layer in self.layers:
            out = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            h = out[0] if isinstance(out, tuple) else out
        if self.last:
            h = self.lm_head(self.norm(h))
        return h
