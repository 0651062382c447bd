"""A small mixture-of-experts transformer for Piper: every block's feed-forward
is a `piper.nn.MoE` (a few experts, top-2, a shared expert), and the blocks
are cut into `n_regions` pipeline regions.

    .venv/bin/python examples/moe.py                       # train on one device, print the loss
    piper run examples/moe_dualpipev_ep.pps --model examples/moe.py:moe_four_regions --steps 20

Under `shard experts over dp` (stdlib `expert_parallel`) each data-parallel
replica holds `num_experts / size(dp)` experts of every block, and tokens
travel to their expert's device and back with all-to-alls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

import piper
import piper.nn
from examples.gpt import CausalSelfAttention, StagedLM, _corpus_tokens, batches


@dataclass
class MoEConfig:
    vocab_size: int = 65
    block_size: int = 32
    n_layer: int = 4
    n_regions: int = 2
    n_head: int = 2
    n_embd: int = 32
    hidden: int = 64
    num_experts: int = 4
    top_k: int = 2
    shared_hidden: int = 32
    layer_regions: bool = False        # every block its own nested `L` region inside its stage

    def __post_init__(self):
        if not 1 <= self.n_regions <= self.n_layer:
            raise ValueError(f"MoEConfig: n_regions={self.n_regions} must be between 1 and n_layer={self.n_layer}")

    @property
    def region_blocks(self) -> tuple[range, ...]:
        per, extra = divmod(self.n_layer, self.n_regions)
        starts = [r * per + min(r, extra) for r in range(self.n_regions + 1)]
        return tuple(range(a, b) for a, b in zip(starts, starts[1:]))


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.moe = piper.nn.MoE(cfg.n_embd, cfg.hidden, cfg.num_experts, cfg.top_k, shared_hidden=cfg.shared_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


class MoETransformer(StagedLM):
    """`MoETransformer(cfg)(idx, targets)`: the mean cross-entropy over all tokens."""

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg, MoEBlock)


def make_model(*, seed: int = 0, dtype=torch.float32, **overrides) -> MoETransformer:
    """A MoE transformer for the bundled corpus. Seeds a forked RNG, not the global one."""
    cfg = MoEConfig(**{"vocab_size": _corpus_tokens()[0].vocab_size, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoETransformer(cfg).to(dtype)


def moe_two_regions() -> MoETransformer:
    """4 blocks in 2 PP regions, 4 experts top-2 (`--model examples/moe.py:moe_two_regions`)."""
    return make_model(n_regions=2)


def moe_four_regions() -> MoETransformer:
    """4 blocks in 4 PP regions: two per device of a 2-stage V (DualPipeV, ZBV)."""
    return make_model(n_regions=4)


def example_batch(batch_size: int = 8, *, block_size: int = MoEConfig.block_size, seed: int = 0):
    return next(batches(_corpus_tokens()[1], batch_size, block_size, seed=seed))


def training_batches(batch_size: int, *, seed: int = 0):
    return batches(_corpus_tokens()[1], batch_size, MoEConfig.block_size, seed=seed)


if __name__ == "__main__":
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, (idx, targets) in zip(range(100), training_batches(16)):
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == 99:
            print(f"step {step:4d}  loss {loss.item():.4f}")
