"""Tiny Hugging Face MoE models of six families (no download), a loss around each, cut into stages.

Shared by tests/test_hf_moe.py and the MoE benchmarks. Every family builds its experts with
transformers' `use_experts_implementation` (stacked `gate_up_proj`/`down_proj`), which
`piper.frontend.hf_experts` captures on Piper's MoE primitives.
"""
import torch
import torch.nn.functional as F

VOCAB, SEQ = 64, 8
EXPERTS, TOP_K = 4, 2


class CausalLM(torch.nn.Module):
    """forward returns the loss, from the logits (Hugging Face's own upcasts them to float32)."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, idx, targets):
        return F.cross_entropy(self.m(input_ids=idx).logits.flatten(0, 1), targets.flatten())


def _config(transformers, family: str, layers: int):
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ, num_experts_per_tok=TOP_K)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=32, moe_intermediate_size=8,
                                           num_experts=EXPERTS, decoder_sparse_step=1, norm_topk_prob=True)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, intermediate_size=32, moe_intermediate_size=8,
                                           num_experts=EXPERTS, shared_expert_intermediate_size=8)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=8, num_local_experts=EXPERTS)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=8, num_experts=EXPERTS)
    if family == "deepseek_v3":    # MLA attention, one shared expert, a grouped sigmoid router, first layer dense
        common["num_key_value_heads"] = common["num_attention_heads"]       # MLA: a key/value per head
        return transformers.DeepseekV3Config(**common, intermediate_size=32, moe_intermediate_size=8,
                                             n_routed_experts=EXPERTS, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=2, topk_group=1, kv_lora_rank=8, q_lora_rank=8,
                                             qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                                             rope_scaling=None)
    if family == "gpt_oss":        # transposed, interleaved gate/up with biases and a clamped gate
        return transformers.GptOssConfig(**common, intermediate_size=8, num_local_experts=EXPERTS, head_dim=4,
                                         layer_types=["full_attention"] * layers, sliding_window=SEQ)
    raise ValueError(family)


_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
            "olmoe": "OlmoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
FAMILIES = tuple(_CLASSES)


def make(family: str, *, layers: int = 2, dtype=torch.float64, experts: str = "eager", seed: int = 0):
    """A tiny `family` causal LM with the loss around it; expert weights drawn large enough that
    routing and experts matter to the loss (their library init is tiny or zero)."""
    import transformers

    torch.manual_seed(seed)
    cfg = _config(transformers, family, layers)
    cfg._experts_implementation = experts
    model = CausalLM(getattr(transformers, _CLASSES[family])(cfg)).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name or name.endswith("router.weight") or name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    return model


def stages(model, pieces: int) -> list[list[str]]:
    """The embedding, the blocks and the norm and head in `pieces` groups of module names."""
    layers = len(model.m.model.layers)
    per = layers // pieces
    groups = [[f"m.model.layers.{i}" for i in range(s * per, (s + 1) * per)] for s in range(pieces)]
    groups[0].insert(0, "m.model.embed_tokens")
    groups[-1] += ["m.model.norm", "m.lm_head"]
    return groups


def batches(steps: int, size: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out
