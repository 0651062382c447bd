"""Model families that are not the example GPT, for `benchmarks/suites/families.py`.

Each family builds a model whose forward is cut into `regions` `piper.annotate("PP")`
scopes and returns the loss, the same computation as standalone stage modules
for `torch.distributed.pipelining` (each stage reuses the model's own
submodules), the schedule's loss function, and global batches:

    family = FAMILIES["mha-gpt"]
    model = family.make(family.quick, regions=2)           # same weights for every call (seeded)
    stage = family.stage(model, 0)                         # torch's stage 0 (no loss)
    batches = family.batches(family.quick, count=4)

A family defined elsewhere (a Hugging Face Llama once Hugging Face models can be
captured, a MoE model once expert parallelism exists) joins with
`register(Family(...))`; every part of the suite then runs it. Its `make`
must cut the model into `regions` PP regions, and `stage` must give the
matching torch stage module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import piper


def _cut(n_blocks: int, regions: int, r: int) -> range:
    """The blocks of region `r` when `n_blocks` are cut into `regions` even runs."""
    return range(r * n_blocks // regions, (r + 1) * n_blocks // regions)


# -- the GPT of issue 17: nn.MultiheadAttention, nn.LayerNorm, a GELU MLP in nn.Sequential ----------

class MHABlock(nn.Module):
    """A pre-norm transformer block from stock modules, written as a user would (default `need_weights`)."""

    def __init__(self, d: int, heads: int, t: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("mask", torch.triu(torch.ones(t, t, dtype=torch.bool), 1), persistent=False)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask)[0]
        return x + self.mlp(self.ln2(x))


class MHAGPT(nn.Module):
    def __init__(self, *, d: int, layers: int, heads: int, t: int, vocab: int, regions: int):
        super().__init__()
        self.n_regions, self.vocab = regions, vocab
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(t, d) * 0.02)
        self.blocks = nn.ModuleList(MHABlock(d, heads, t) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def region(self, r: int, x):
        if r == 0:
            x = self.emb(x) + self.pos
        for i in _cut(len(self.blocks), self.n_regions, r):
            x = self.blocks[i](x)
        if r == self.n_regions - 1:
            x = self.head(self.ln(x))
        return x

    def region_parts(self, r: int) -> list:
        parts = [self.emb, self.pos] if r == 0 else []
        parts += [self.blocks[i] for i in _cut(len(self.blocks), self.n_regions, r)]
        return parts + ([self.ln, self.head] if r == self.n_regions - 1 else [])

    def forward(self, idx, targets):
        x = idx
        for r in range(self.n_regions):
            with piper.annotate("PP"):
                x = self.region(r, x)
                if r == self.n_regions - 1:
                    x = token_loss(x, targets)
        return x


def token_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _mha_batches(cfg: dict, count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shape = (cfg["batch"], cfg["t"])
    return [(torch.randint(0, cfg["vocab"], shape, generator=g), torch.randint(0, cfg["vocab"], shape, generator=g))
            for _ in range(count)]


# -- an MLP-Mixer over patch sequences --------------------------------------------------------------

class MixerBlock(nn.Module):
    """Token mixing (an MLP across the patches) then channel mixing (an MLP across features)."""

    def __init__(self, patches: int, d: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.tokens = nn.Sequential(nn.Linear(patches, 2 * patches), nn.GELU(), nn.Linear(2 * patches, patches))
        self.ln2 = nn.LayerNorm(d)
        self.channels = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.tokens(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.ln2(x))


class Mixer(nn.Module):
    def __init__(self, *, patches: int, patch_dim: int, d: int, layers: int, classes: int, regions: int):
        super().__init__()
        self.n_regions = regions
        self.embed = nn.Linear(patch_dim, d)
        self.blocks = nn.ModuleList(MixerBlock(patches, d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def region(self, r: int, x):
        if r == 0:
            x = self.embed(x)
        for i in _cut(len(self.blocks), self.n_regions, r):
            x = self.blocks[i](x)
        if r == self.n_regions - 1:
            x = self.head(self.ln(x).mean(dim=1))
        return x

    def region_parts(self, r: int) -> list:
        parts = [self.embed] if r == 0 else []
        parts += [self.blocks[i] for i in _cut(len(self.blocks), self.n_regions, r)]
        return parts + ([self.ln, self.head] if r == self.n_regions - 1 else [])

    def forward(self, x, y):
        for r in range(self.n_regions):
            with piper.annotate("PP"):
                x = self.region(r, x)
                if r == self.n_regions - 1:
                    x = F.cross_entropy(x, y)
        return x


def _mixer_batches(cfg: dict, count: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(cfg["batch"], cfg["patches"], cfg["patch_dim"], generator=g),
             torch.randint(0, cfg["classes"], (cfg["batch"],), generator=g)) for _ in range(count)]


# -- the registry ---------------------------------------------------------------------------------

class Stage(nn.Module):
    """Region `r` of a family model as a torch pipeline stage: the model's own region code and
    submodules (only those of this region are registered, so `parameters()` is the stage's), no loss."""

    def __init__(self, model: nn.Module, r: int):
        super().__init__()
        object.__setattr__(self, "_model", model)     # not a submodule: its other regions are not ours
        self.r = r
        parts = model.region_parts(r)
        self.modules_ = nn.ModuleList(p for p in parts if isinstance(p, nn.Module))
        self.params_ = nn.ParameterList(p for p in parts if isinstance(p, nn.Parameter))

    def forward(self, x):
        return self._model.region(self.r, x)


@dataclass(frozen=True)
class Family:
    name: str
    describe: Callable[[dict], str]
    build: Callable[..., nn.Module]                 # build(**cfg without "batch", regions=R)
    make_batches: Callable[[dict, int], list]       # (cfg, count) -> [(input, target), ...]
    loss: Callable                                  # torch's loss_fn on the last stage's output
    quick: dict                                     # small config (also the CI smoke size)
    full: dict                                      # the measured config
    stage: Callable[[nn.Module, int], nn.Module] = Stage

    def make(self, cfg: dict, *, regions: int, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.build(**{k: v for k, v in cfg.items() if k != "batch"}, regions=regions)

    def batches(self, cfg: dict, count: int, seed: int = 1) -> list:
        return self.make_batches(cfg, count, seed)


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family to every part of the families suite (the hook for Llama and MoE models)."""
    FAMILIES[family.name] = family
    return family


register(Family(
    "mha-gpt",
    lambda c: (f"GPT from nn.MultiheadAttention d={c['d']} layers={c['layers']} heads={c['heads']} T={c['t']} "
               f"vocab={c['vocab']}, batch {c['batch']}, float32"),
    MHAGPT, _mha_batches, token_loss,
    quick=dict(d=48, layers=4, heads=4, t=16, vocab=64, batch=16),
    full=dict(d=192, layers=8, heads=6, t=64, vocab=256, batch=16)))

register(Family(
    "mlp-mixer",
    lambda c: (f"MLP-Mixer patches={c['patches']} patch_dim={c['patch_dim']} d={c['d']} layers={c['layers']} "
               f"classes={c['classes']}, batch {c['batch']}, float32"),
    Mixer, _mixer_batches, F.cross_entropy,
    quick=dict(patches=16, patch_dim=24, d=48, layers=4, classes=10, batch=16),
    full=dict(patches=64, patch_dim=48, d=192, layers=8, classes=100, batch=32)))


from . import families_more  # noqa: E402,F401 - registers moe-gpt and hf-llama, which build on the above
