"""A small character-level GPT (after nanoGPT), annotated for Piper: each `PP` region is a pipeline stage.

The forward pass is cut into `n_regions` `with piper.annotate("PP"):` blocks, in
order: region 0 also holds the embeddings, the last region also holds the final
LayerNorm, the lm head and the loss. It trains on examples/data/corpus.txt.

With `layer_regions=True` each block (and the embeddings, and the head with
the loss) is also its own `L` region nested in its stage. A region is the
unit ZeRO shards, gathers and frees, so ZeRO-3 then holds one block's full
parameters at a time instead of a whole stage's (FSDP's per-layer wrapping).

    python examples/gpt.py                  # 200 AdamW steps on one CPU, prints the loss
    piper run ... --model examples/gpt.py:small_gpt
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

import piper

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    n_regions: int = 4
    dtype: torch.dtype = torch.float32
    layer_regions: bool = False          # every block its own `L` region inside its `PP` stage

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_regions"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig: {name}={getattr(self, name)} must be at least 1; pass a positive {name}.")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                             f"make n_embd a multiple of n_head (e.g. n_embd={self.n_head * 16}).")
        if self.n_layer < self.n_regions:
            raise ValueError(f"GPTConfig: n_layer={self.n_layer} is less than n_regions={self.n_regions}, "
                             "so some region would hold no block; "
                             f"use n_layer >= {self.n_regions} or n_regions <= {self.n_layer}.")
        if not self.dtype.is_floating_point:
            raise ValueError(f"GPTConfig: dtype={self.dtype} is not a floating-point type; "
                             "use torch.float32, torch.float64 or torch.bfloat16.")

    @property
    def region_blocks(self) -> tuple[range, ...]:
        """Block indices per region, as even as possible, extra blocks to the first regions.

        GPTConfig(vocab_size=61, n_layer=6, n_regions=4).region_blocks
            == (range(0, 2), range(2, 4), range(4, 5), range(5, 6))
        """
        per, extra = divmod(self.n_layer, self.n_regions)
        starts = [r * per + min(r, extra) for r in range(self.n_regions + 1)]
        return tuple(range(a, b) for a, b in zip(starts, starts[1:]))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no dropout: runs must be deterministic
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class StagedLM(nn.Module):
    """What the example language models share (this GPT, examples/moe.py's MoE transformer): token and
    position embeddings, `cfg.n_layer` blocks made by `block(cfg)`, a final LayerNorm and an lm head,
    with GPT-2's initialisation; and a forward in `cfg.region_blocks` PP regions, the embeddings in the
    first and the head and loss in the last, each piece its own `L` region with `cfg.layer_regions`."""

    def __init__(self, cfg, block):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        # Not tied to wte (nanoGPT ties them): Piper does not yet support a parameter used by two regions.
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)   # the leaves in the same order as a walk of self.modules()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        last = self.cfg.n_regions - 1
        layer = self._layer
        for region, blocks in enumerate(self.cfg.region_blocks):
            with piper.annotate("PP"):
                if region == 0:
                    with layer():
                        pos = torch.arange(idx.shape[1], device=idx.device)
                        x = self.wte(idx) + self.wpe(pos)
                for i in blocks:
                    with layer():
                        x = self.blocks[i](x)
                if region == last:
                    with layer():
                        logits = self.lm_head(self.ln_f(x))
                        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss

    def _layer(self):
        return piper.annotate("L") if self.cfg.layer_regions else contextlib.nullcontext()


class GPT(StagedLM):
    """`GPT(cfg)(idx, targets)` is the mean cross-entropy over all B*T tokens. Seed with torch.manual_seed first."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg, Block)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2: scale residual projections so the residual stream's variance does not grow with depth.
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        self.to(cfg.dtype)  # initialise in float32 so every dtype starts from the same weights


class CharTokenizer:
    """One token per distinct character of `text`, in sorted order.

        tok = CharTokenizer("hello"); tok.decode(tok.encode("hole")) == "hole"
    """

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise ValueError(f"CharTokenizer: characters {unknown} are not in the vocabulary; "
                             "build the tokenizer from a text that contains them.")
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, tokens) -> str:
        return "".join(self.chars[int(t)] for t in tokens)


def load_corpus() -> str:
    """The bundled corpus (about 120 KB of plain English; see examples/data/make_corpus.py)."""
    return CORPUS.read_text(encoding="ascii")


@functools.lru_cache(maxsize=1)
def _corpus_tokens() -> tuple[CharTokenizer, torch.Tensor]:
    tok = CharTokenizer(load_corpus())
    return tok, tok.encode(load_corpus())


def batches(
    tokens: torch.Tensor, batch_size: int, block_size: int, *, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (idx, targets) pairs of shape (batch_size, block_size) at random offsets; targets = idx shifted by one.

    The same seed gives the same stream; the global torch RNG is left alone.
    """
    if tokens.numel() <= block_size:
        raise ValueError(f"batches: {tokens.numel()} tokens cannot fill one window of block_size={block_size} "
                         "plus its target; pass a longer text or a smaller block_size.")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(block_size + 1)
    while True:
        starts = torch.randint(tokens.numel() - block_size, (batch_size, 1), generator=gen)
        window = tokens[starts + offsets]
        yield window[:, :-1], window[:, 1:]


def make_model(*, seed: int = 0, **overrides) -> tuple[GPT, GPTConfig]:
    """A GPT for the bundled corpus: `make_model(n_layer=2, n_regions=2)`. Seeds a forked RNG, not the global one."""
    cfg = GPTConfig(**{"vocab_size": _corpus_tokens()[0].vocab_size, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg), cfg


def small_gpt() -> GPT:
    """The default model (4 blocks in 4 PP regions, n_embd 64), for `--model examples/gpt.py:small_gpt`."""
    return make_model()[0]


def two_stage_gpt() -> GPT:
    """`small_gpt` cut into 2 PP regions, one per device of a 2-stage pipeline (`--model examples/gpt.py:two_stage_gpt`)."""
    return make_model(n_regions=2)[0]


def two_stage_layered_gpt() -> GPT:
    """`two_stage_gpt` with every block its own `L` region inside its stage: ZeRO-3 then gathers one block at a
    time (`--model examples/gpt.py:two_stage_layered_gpt`)."""
    return make_model(n_regions=2, layer_regions=True)[0]


def example_batch(batch_size: int = 8, *, block_size: int = GPTConfig.block_size, seed: int = 0):
    """One (idx, targets) batch from the corpus, shaped for `small_gpt()`."""
    return next(batches(_corpus_tokens()[1], batch_size, block_size, seed=seed))


def training_batches(batch_size: int, *, seed: int = 0):
    """Endless corpus batches shaped for `small_gpt()`; `piper run` trains on these."""
    return batches(_corpus_tokens()[1], batch_size, GPTConfig.block_size, seed=seed)


if __name__ == "__main__":
    model, cfg = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, (idx, targets) in zip(range(200), batches(_corpus_tokens()[1], 32, cfg.block_size, seed=0)):
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == 199:
            print(f"step {step:4d}  loss {loss.item():.4f}")
