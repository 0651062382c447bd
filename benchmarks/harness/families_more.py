"""Two more model families for suite 9 (`benchmarks/harness/families.py` registers them): a mixture of experts
in a GPT (`piper.nn.MoE` in place of the MLP), and a Hugging Face Llama as the library builds it
(registered when `transformers`, the test extra, is installed)."""
from __future__ import annotations

import importlib.util

import torch.nn as nn

import piper
import piper.nn

from .families import MHABlock, MHAGPT, Family, _mha_batches, register, token_loss


# -- a GPT whose blocks route each token to top-k of E experts -------------------------------------

class MoEBlock(MHABlock):
    """The MHA block with `piper.nn.MoE` (dropless top-k SwiGLU experts) as its MLP."""

    def __init__(self, d: int, heads: int, t: int, experts: int, top_k: int):
        super().__init__(d, heads, t)
        self.mlp = piper.nn.MoE(dim=d, hidden=2 * d, num_experts=experts, top_k=top_k)


class MoEGPT(MHAGPT):
    def __init__(self, *, d: int, layers: int, heads: int, t: int, vocab: int, experts: int, top_k: int,
                 regions: int):
        super().__init__(d=d, layers=layers, heads=heads, t=t, vocab=vocab, regions=regions)
        self.blocks = nn.ModuleList(MoEBlock(d, heads, t, experts, top_k) for _ in range(layers))


register(Family(
    "moe-gpt",
    lambda c: (f"MoE GPT (piper.nn.MoE, {c['experts']} experts, top-{c['top_k']}) d={c['d']} layers={c['layers']} "
               f"heads={c['heads']} T={c['t']} vocab={c['vocab']}, batch {c['batch']}, float32, experts replicated"),
    MoEGPT, _mha_batches, token_loss,
    quick=dict(d=48, layers=4, heads=4, t=16, vocab=64, experts=4, top_k=2, batch=16),
    full=dict(d=128, layers=8, heads=4, t=64, vocab=256, experts=8, top_k=2, batch=16)))


# -- a Hugging Face Llama, regions by module path ---------------------------------------------------

class HFLlama(nn.Module):
    """`transformers.LlamaForCausalLM` from a tiny config (no download), cut into `regions` PP regions
    of whole decoder layers by `piper.annotate_modules`; forward returns the loss."""

    def __init__(self, *, hidden: int, layers: int, heads: int, t: int, vocab: int, regions: int):
        import transformers

        from examples.train_hf import CausalLM

        super().__init__()
        self.n_regions = regions
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                       num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=max(1, heads // 2), max_position_embeddings=t)
        self.lm = CausalLM(transformers.LlamaForCausalLM(cfg))
        per = layers // regions
        groups = [[f"lm.m.model.layers.{i}" for i in range(r * per, (r + 1) * per)] for r in range(regions)]
        groups[0][:0] = ["lm.m.model.embed_tokens"]
        groups[-1] += ["lm.m.model.norm", "lm.m.lm_head"]
        piper.annotate_modules(self, "PP", groups)

    def forward(self, idx, targets):
        return self.lm(idx, targets)


def _llama_stage(model: HFLlama, r: int) -> nn.Module:
    from .llama_stage import LlamaStage

    return LlamaStage(model.lm, r, model.n_regions)


def _llama_batches(cfg: dict, count: int, seed: int = 1):
    return _mha_batches({"batch": cfg["batch"], "t": cfg["t"], "vocab": cfg["vocab"]}, count, seed)


if importlib.util.find_spec("transformers") is not None:     # the test extra; not a core dependency
    register(Family(
        "hf-llama",
        lambda c: (f"Hugging Face LlamaForCausalLM hidden={c['hidden']} layers={c['layers']} heads={c['heads']} "
                   f"T={c['t']} vocab={c['vocab']}, batch {c['batch']}, float32"),
        HFLlama, _llama_batches, token_loss,
        quick=dict(hidden=48, layers=4, heads=4, t=16, vocab=64, batch=16),
        full=dict(hidden=192, layers=8, heads=6, t=64, vocab=256, batch=16),
        stage=_llama_stage))
