"""Hugging Face MoE experts captured as Piper's MoE primitives, so `shard experts` divides them.

transformers (5.x) builds the experts of every MoE family (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
DeepSeek-V3, GPT-OSS, ...) with `@use_experts_implementation`: one module of stacked weights,
`gate_up_proj` `[E, 2I, H]` and `down_proj` `[E, H, I]` (GPT-OSS: `[E, H, 2I]` and `[E, I, H]`,
gate and up interleaved, with biases), called as `experts(hidden, top_k_index, top_k_weights)`,
which runs the implementation the config names: "eager" loops over the experts a batch hits
(data-dependent Python, a graph break under capture), "grouped_mm" calls a custom op of the
library's own. Capture runs each such module instead as

    dispatch -> expert_mm (+ expert_bias) -> the module's own gate -> expert_mm (+ expert_bias) -> combine

the arithmetic of transformers' grouped forward on Piper's primitives, so the regions hold
`piper::` ops only, a region of experts is cut at its exchanges, and under `shard experts`
each device holds `E / size(axis)` rows of every expert weight and bias. The model itself
is not changed: only capture's meta copy runs this forward, and its parameters keep their
names (`m.model.layers.1.mlp.experts.gate_up_proj`).
"""
from __future__ import annotations

import types

import torch

# The implementations of transformers' own; a config naming another (a user's registered
# kernel) keeps it, and `shard experts` then finds no experts there.
_LIBRARY_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")


def is_hf_experts(module: torch.nn.Module) -> bool:
    """A module made by transformers' `use_experts_implementation` with a library implementation."""
    flags = ("has_gate", "has_bias", "is_transposed", "num_experts", "config")
    if not all(hasattr(module, f) for f in flags) or getattr(module, "_is_expert_parallel", False):
        return False
    first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (isinstance(first, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)):
        return False
    if first.dim() != 3 or down.dim() != 3 or first.shape[0] != module.num_experts:
        return False
    implementation = getattr(module.config, "_experts_implementation", None)
    return isinstance(implementation, str | None) and implementation in _LIBRARY_IMPLEMENTATIONS


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' `grouped_mm_experts_forward` on `piper.nn`'s dispatch, expert_mm and combine."""
    from .. import nn

    routed, counts, handle = nn.dispatch(hidden_states, top_k_index.long(), self.num_experts)
    transposed = not self.is_transposed          # transformers' default layout is [E, out, in]
    first, bias = (self.gate_up_proj, "gate_up_proj_bias") if self.has_gate else (self.up_proj, "up_proj_bias")
    h = nn.expert_mm(routed, counts, first, transposed=transposed)
    if self.has_bias:
        h = nn.expert_bias(h, counts, getattr(self, bias))
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    y = nn.expert_mm(h, counts, self.down_proj, transposed=transposed)
    if self.has_bias:
        y = nn.expert_bias(y, counts, self.down_proj_bias)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    return nn.combine(y, top_k_weights, handle).to(hidden_states.dtype)


def use_piper_experts(model: torch.nn.Module) -> int:
    """Run every Hugging Face experts module of `model` (capture's meta copy) on Piper's
    primitives; how many there were."""
    found = 0
    for module in model.modules():
        if is_hf_experts(module):
            module.forward = types.MethodType(experts_forward, module)
            found += 1
    return found
