"""A small Llama-style model written for tensor parallelism, and its plans.

Grouped-query attention with separate q/k/v projections reshaped with `-1` (so each device runs
its heads), RMSNorm, a SwiGLU MLP, a token embedding and an output layer: every piece
Megatron-LM's plan divides. `TP_PLAN` is that plan as `piper.strategy` lines
(`examples/llama_tp_1f1b.pps` is the script form):

    shard columns of "blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v",
                     "blocks.*.mlp.gate", "blocks.*.mlp.up" over tp
    shard rows of "blocks.*.attn.o", "blocks.*.mlp.down" over tp
    shard vocab of "embed", "head" over tp
    shard sequence over tp
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import piper

COLUMNS = ["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.mlp.gate", "blocks.*.mlp.up"]
ROWS = ["blocks.*.attn.o", "blocks.*.mlp.down"]
VOCAB = ["embed", "head"]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.n_heads, self.n_kv_heads = heads, kv_heads
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaTP(nn.Module):
    """`forward(idx, targets)` -> the mean next-token loss, with `stages` `PP` regions of
    consecutive blocks (the embedding joins the first, the head the last); `stages=layers` makes
    each block a region of its own, and so a unit of its own (its gradients and ZeRO shards), and
    `block_regions=True` does that inside each stage (an `L` region per block nested in its `PP`
    region: ZeRO-3 gathers and frees each block on its own, as FSDP wraps each block)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, kv_heads: int = 2, hidden: int = 64,
                 layers: int = 2, stages: int = 2, block_regions: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.stages = stages
        self.block_regions = block_regions

    def forward(self, idx, targets):
        x = self.embed(idx)
        per = len(self.blocks) // self.stages
        for s in range(self.stages):
            with piper.annotate("PP"):
                for block in self.blocks[s * per:(s + 1) * per]:
                    if self.block_regions:
                        with piper.annotate("L"):
                            x = block(x)
                    else:
                        x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_model(dtype=torch.float64, seed: int = 0, **sizes) -> LlamaTP:
    torch.manual_seed(seed)
    return LlamaTP(**sizes).to(dtype)


def batches(count: int = 3, batch: int = 4, seq: int = 8, vocab: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(count)]


def example_batch(batch_size: int):
    """One global batch for `piper check --model` / `piper tune --model examples/llama_tp.py:make_model`."""
    return batches(count=1, batch=batch_size)[0]


def tensor_parallel(s, *, axis: str = "tp", sequence: bool = False, vocab: bool = True) -> None:
    """Megatron-LM's plan for this model, as `piper.strategy` lines on `s`."""
    s.shard("columns", of=COLUMNS, over=axis)
    s.shard("rows", of=ROWS, over=axis)
    if vocab:
        s.shard("vocab", of=VOCAB, over=axis)
    if sequence:
        s.shard("sequence", over=axis)
