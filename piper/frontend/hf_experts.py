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


def _why_not(module: torch.nn.Module) -> str | None:
    """Why a transformers experts module cannot run on Piper's primitives; None when it can."""
    if getattr(module, "_is_expert_parallel", False):
        return "it is already divided by transformers' own expert parallelism"
    implementation = getattr(module.config, "_experts_implementation", None)
    if not (implementation is None or isinstance(implementation, str) and implementation in _LIBRARY_IMPLEMENTATIONS):
        return f"its config names the experts implementation {implementation!r}, not one of transformers' own"
    first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (isinstance(first, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
            and first.dim() == down.dim() == 3 and first.shape[0] == down.shape[0] == module.num_experts):
        return "its weights are not stacked [experts, ...] parameters (quantized, or another layout)"
    return None


def _is_experts_module(module: torch.nn.Module) -> bool:
    """Made by transformers' `use_experts_implementation` (which sets these flags)."""
    return all(hasattr(module, f) for f in ("has_gate", "has_bias", "is_transposed", "num_experts", "config"))


def is_hf_experts(module: torch.nn.Module) -> bool:
    """A transformers experts module that capture runs on Piper's primitives."""
    return _is_experts_module(module) and _why_not(module) is None


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


def use_piper_experts(model: torch.nn.Module) -> tuple[str, ...]:
    """Run every Hugging Face experts module of `model` (capture's meta copy) on Piper's
    primitives; the experts modules left on their own forward, each with why
    (`shard experts` cannot divide those, and says so)."""
    left = []
    for name, module in model.named_modules():
        if not _is_experts_module(module):
            continue
        why = _why_not(module)
        if why is None:
            module.forward = types.MethodType(experts_forward, module)
        else:
            left.append(f"`{name}`: {why}")
    return tuple(left)
