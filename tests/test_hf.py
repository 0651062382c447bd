"""Models nobody here wrote: tiny Hugging Face causal LMs (no download), cut into
stages with `piper.annotate_modules`, train equal to one device in float64.

Each training test runs 3 steps against single-device training from the same
weights and batches (losses and parameters within 1e-9). Capturing a Hugging
Face model costs seconds (TorchDynamo traces the library's Python), so the
captured program is shared by the tests that cut the model the same way.
"""
import copy
import functools
import os

import pytest
import torch
import torch.nn.functional as F

import piper
import piper.job
from piper.frontend.capture import capture
from piper.dsl import load_strategy
from piper.testing import train_both
from tests.helpers import assert_same

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, MICRO = 64, 8, 2      # every job below runs microbatches of 2 sequences of 8 tokens


class CausalLM(torch.nn.Module):
    """What a user writes around a Hugging Face model: forward returns the loss.

    The loss is taken from the logits here: Hugging Face's own (`labels=`)
    upcasts the logits to float32, which would cap a float64 comparison at
    float32's precision (`test_model_output_and_keywords` uses it as is)."""

    def __init__(self, model, key):
        super().__init__()
        self.m = model
        self.cache_key = key

    def forward(self, idx, targets):
        logits = self.m(input_ids=idx).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def llama(layers=4):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return CausalLM(transformers.LlamaForCausalLM(cfg), "llama").double()


def gpt2():
    """GPT-2 ties lm_head.weight to the token embedding: across stages once cut."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=4, n_head=2, n_positions=SEQ,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = CausalLM(transformers.GPT2LMHeadModel(cfg), "gpt2").double()
    assert model.m.lm_head.weight is model.m.transformer.wte.weight
    return model


def qwen2_tied():
    """A third family: Qwen2 (biased q/k/v projections) with tied embeddings."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=True)
    model = CausalLM(transformers.Qwen2ForCausalLM(cfg), "qwen2").double()
    assert model.m.lm_head.weight is model.m.model.embed_tokens.weight
    return model


STAGES = {    # module names per family: the embedding, the blocks, the final norm and the head
    "llama": ("m.model.embed_tokens", "m.model.layers.{}", ["m.model.norm", "m.lm_head"]),
    "qwen2": ("m.model.embed_tokens", "m.model.layers.{}", ["m.model.norm", "m.lm_head"]),
    "gpt2": ("m.transformer.wte", "m.transformer.h.{}", ["m.transformer.ln_f", "m.lm_head"]),
}


def cut(model, stages: int):
    """Four blocks into `stages` groups; the embedding joins the first, norm and head the last."""
    embed, block, tail = STAGES[model.cache_key]
    per = 4 // stages
    groups = [[block.format(i) for i in range(s * per, (s + 1) * per)] for s in range(stages)]
    groups[0].insert(0, embed)
    groups[-1] += tail
    model.cache_key = (model.cache_key, stages)
    return piper.annotate_modules(model, "PP", groups)


def batches(steps, size, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


_programs: dict = {}


def cached(model, inputs, names=(), tensor=None):
    """capture(), once per (model family, cut, microbatch shape, tensor-parallel plan) for the whole module."""
    key = (getattr(model, "cache_key", id(model)), tuple(tuple(x.shape) for x in inputs), names, tensor)
    if key not in _programs:
        _programs[key] = capture(model, inputs, names, tensor)
    return _programs[key]


@pytest.fixture
def shared_capture(monkeypatch):
    monkeypatch.setattr(piper.job, "capture", cached)


STRATEGIES = {    # name -> (script, mesh, stages the model is cut into, global batch)
    "dp": ("use dp() on dp\n", {"dp": 2}, 2, 2 * MICRO),
    "1f1b": ("use one_f_one_b(microbatches=2) on pp\n", {"pp": 2}, 2, 2 * MICRO),
    "zero3x1f1b": ("use one_f_one_b(microbatches=2) on pp\nuse zero3() on dp\n", {"dp": 2, "pp": 2}, 2, 4 * MICRO),
    "interleaved": ("use interleaved_1f1b(microbatches=2, virtual=2) on pp\n", {"pp": 2}, 4, 2 * MICRO),
}


# Each training test costs a Ray job (and a capture of seconds per cut): the default run
# keeps three, Llama under 1F1B and GPT-2's tied weight under ZeRO-3 x 1F1B (4 workers)
# and the interleaved schedule; PIPER_FULL=1 runs every family x strategy.
FULL = os.environ.get("PIPER_FULL") == "1"
DEFAULT = {("llama", "1f1b"), ("gpt2", "zero3x1f1b"), ("gpt2", "interleaved")}


def strategies(family):
    return [pytest.param(name, marks=() if FULL or (family, name) in DEFAULT else pytest.mark.skip(
        reason="PIPER_FULL=1 runs every family x strategy")) for name in STRATEGIES]


def assert_exact(result, tol=1e-9):
    assert_same(result, tol)
    losses = result[0]
    assert losses[-1] < losses[0]


def train(model_fn, strategy, **kw):
    """3 steps on one batch (so the loss must fall), AdamW with lr 1e-2."""
    script, mesh, stages, batch = STRATEGIES[strategy]
    model = cut(model_fn(), stages)
    return train_both(model, load_strategy(script), mesh=mesh, batches=batches(1, batch) * 3,
                      optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), **kw)


@pytest.mark.usefixtures("ray_cluster", "shared_capture")
@pytest.mark.parametrize("strategy", strategies("llama"))
def test_llama_trains_as_on_one_device(strategy):
    assert_exact(train(llama, strategy))


@pytest.mark.usefixtures("ray_cluster", "shared_capture")
@pytest.mark.parametrize("strategy", strategies("gpt2"))
def test_gpt2_with_tied_embeddings_trains_as_on_one_device(strategy):
    copies = {}

    def both_copies(job):
        # After the last step each stage still holds the same tied weight: compare the
        # stages' own copies, not the one state_dict picks.
        if len(job.layouts) > 1:
            from piper.runtime.state.flat_buffers import unflatten
            shards = job._get([a.shards.remote() for a in job.actors], "shards")
            for u, layout in job.layouts.items():
                for b, bucket in enumerate(layout.buckets):
                    if bucket.tied is not None:
                        full = torch.cat([shards[rank][u][b] for rank in layout.group])
                        copies[u] = unflatten(bucket, full)["m.transformer.wte.weight"]
    assert_exact(train(gpt2, strategy, job_hook=both_copies))
    if strategy != "dp":                           # the weight is held by the first and the last stage
        first, last = copies.values()
        assert torch.equal(first, last)


@pytest.mark.skipif(not FULL, reason="PIPER_FULL=1 runs the third family")
@pytest.mark.usefixtures("ray_cluster", "shared_capture")
def test_qwen2_tied_under_zero3_and_1f1b():
    assert_exact(train(qwen2_tied, "zero3x1f1b"))


@pytest.mark.full       # tests/test_modules.py captures both without workers
@pytest.mark.usefixtures("ray_cluster")
def test_model_output_and_keywords():
    """The model itself, called with keywords, returning a ModelOutput whose loss Hugging Face computes."""
    hf = llama(layers=2).m
    piper.annotate_modules(hf, "PP", [["model.embed_tokens", "model.layers.0"],
                                      ["model.layers.1", "model.norm", "lm_head"]])
    data = [{"input_ids": x, "labels": x} for x, _ in batches(3, 2 * MICRO)]
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    reference = copy.deepcopy(hf)
    strategy = load_strategy(STRATEGIES["1f1b"][0])
    with piper.compile(copy.deepcopy(hf), data[0], strategy=strategy, mesh={"pp": 2}, optimizer=optimizer) as job:
        losses = [job.step(**b) for b in data]
        state = job.state_dict()
    opt = optimizer(list(reference.parameters()))
    ref_losses = []
    for b in data:
        opt.zero_grad()
        loss = reference(**b).loss
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    # Hugging Face's loss is float32 (it upcasts the logits), so the losses agree to float32.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6)
    assert state.keys() == reference.state_dict().keys()
    for name, ref in reference.state_dict().items():
        torch.testing.assert_close(state[name], ref, rtol=1e-6, atol=1e-6)


# ---- capture of what real models do, without Ray


def test_llama_regions_follow_the_groups_and_the_outside_rule():
    model = cut(llama(), 2)
    x, y = batches(1, MICRO)[0]
    program = cached(model, (x, y))
    assert [r.label for r in program.regions] == ["PP=0", "PP=1"]
    assert "m.model.embed_tokens.weight" in program.regions[0].params
    assert "m.lm_head.weight" in program.regions[1].params
    # The rotary tables and the mask are computed outside every module listed: they join
    # their first user (stage 0), and stage 1 receives them without a gradient.
    joined = {op for op, why, _ in program.regions[0].joined if why == "first user"}
    assert {"aten.cos.default", "aten.sin.default"} <= joined
    # The loss after the head joins the last region that fed it.
    assert any(op == "aten.nll_loss_forward.default" or "cross_entropy" in op or "log_softmax" in op
               for op, why, _ in program.regions[1].joined if why == "last producer")
    assert "m.model.rotary_emb.inv_freq" in program.buffers              # a non-persistent buffer
    to_stage_1 = [v for v in program.values if v.producer == 0]
    assert any(not v.differentiable for v in to_stage_1)                 # cos/sin: no gradient back
    assert any(v.differentiable for v in to_stage_1)                     # the hidden states


def test_annotate_modules_changes_nothing_but_the_annotation():
    model = llama()
    x, y = batches(1, MICRO)[0]
    before = model(x, y)
    names = [n for n, _ in model.named_modules()]
    cut(model, 2)
    assert torch.equal(model(x, y), before)
    assert [n for n, _ in model.named_modules()] == names
    assert model.state_dict().keys() == llama().state_dict().keys()
    model(x, y).backward()              # and it trains without Piper
    assert model.m.lm_head.weight.grad is not None


def test_unknown_module_name_suggests_the_right_one():
    with pytest.raises(piper.PiperError) as err:
        piper.annotate_modules(llama(), "PP", [["m.model.embed", "m.model.layers.0"], ["m.lm_head"]])
    assert err.value.code == "unknown-module"
    assert "`m.model.embed`" in str(err.value) and "m.model.embed_tokens" in err.value.diagnostics[0].hint


def test_overlapping_groups_are_refused():
    with pytest.raises(piper.PiperError) as err:
        piper.annotate_modules(llama(), "PP", [["m.model.layers.*"], ["m.model.layers.3", "m.lm_head"]])
    assert err.value.code == "overlapping-groups"
    assert "`m.model.layers.3` is in group 0 and group 1" in str(err.value)
    with pytest.raises(piper.PiperError) as err:       # a module and its parent
        piper.annotate_modules(llama(), "PP", [["m.model.layers.0"], ["m.model.layers.0.mlp"]])
    assert err.value.code == "overlapping-groups" and "inside `m.model.layers.0`" in str(err.value)


def test_group_order_must_follow_forward():
    model = piper.annotate_modules(llama(layers=2), "PP", [["m.model.layers.1", "m.lm_head"],
                                                           ["m.model.embed_tokens", "m.model.layers.0"]])
    with pytest.raises(piper.PiperError) as err:
        capture(model, batches(1, MICRO)[0])
    assert err.value.code == "group-order"
    assert "group 1 of `PP` runs before group 0" in str(err.value)


def test_nested_tags_by_calling_again():
    model = piper.annotate_modules(llama(layers=2), "PP", [["m.model.embed_tokens", "m.model.layers.0"],
                                                           ["m.model.layers.1", "m.model.norm", "m.lm_head"]])
    piper.annotate_modules(model, "L", [["m.model.layers.0"], ["m.model.layers.1"]])
    program = capture(model, batches(1, MICRO)[0])
    labels = [r.label for r in program.regions]
    assert labels == ["PP=0", "PP=0 L=0", "PP=1 L=1", "PP=1"]      # embedding, blocks, norm and head


def test_benchmark_workload_is_the_example_model_cut_into_stages():
    from benchmarks.harness.workloads import HFWorkload, make_hf
    from piper.frontend.modules import module_groups

    model, stream = make_hf(HFWorkload(family="gpt2", layers=4, hidden=16, heads=2, batch=2), 2)
    groups = module_groups(model)
    assert groups["PP"][0][:3] == ["m.transformer.wte", "m.transformer.wpe", "m.transformer.h.0"]
    assert groups["PP"][1][-1] == "m.lm_head" and len(groups["L"]) == 4
    x, y = next(stream)
    assert x.shape == y.shape == (2, 64) and torch.isfinite(model(x, y))
