"""Tensor, sequence and vocab parallelism trained against one device: float64, the same weights,
3 AdamW steps, the losses and every parameter within 1e-9 (`piper.testing.train_both`), on
examples/llama_tp.py's model, a MoE model beside expert parallelism and a Hugging Face Llama;
what each device holds (measured), and the diagnostics of plans a model cannot take.

Each training test is a Ray job (or two); the checks of memory and of the program ride in their
`job_hook`s. The diagnostics compile without workers: `piper.compile` refuses before any starts.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import piper
import piper.nn
from examples.llama_tp import Attention, LlamaTP, batches, make_model, tensor_parallel
from piper.diagnostics import PiperError
from piper.dsl import load_strategy
from piper.testing import train_both
from tests.helpers import allocation_rise, assert_same

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
VOCAB = 96          # no other dimension of the model is 96 or 48: a tensor of the vocabulary is recognisable


def strategy(*, dp=None, pp=None, microbatches=2, sequence=False, vocab=True):
    """examples/llama_tp.py's plan over tp, with `use DP() on dp` and 1F1B on pp when asked."""
    @piper.strategy
    def plan(s):
        if pp:
            s.use("one_f_one_b", microbatches=microbatches, on="pp")
        if dp:
            s.use(dp, on="dp")
        tensor_parallel(s, sequence=sequence, vocab=vocab)
    return plan


def train(strategy, mesh, *, stages=1, batch=4, job_hook=None, **sizes):
    return train_both(make_model(stages=stages, vocab=VOCAB, **sizes), strategy, mesh=mesh,
                      batches=batches(batch=batch, vocab=VOCAB), optimizer=ADAMW, job_hook=job_hook, progress=False)


def last_dims(program) -> set[int]:
    """The last dimension of every tensor any region graph of `program` computes."""
    return {n.meta["val"].shape[-1] for r in program.regions for n in r.graph.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim()}


def bytes_of(model, names) -> int:
    params = dict(model.named_parameters())
    return sum(params[n].numel() * params[n].element_size() for n in names)


# ---- training against one device

@pytest.mark.usefixtures("ray_cluster")
def test_tp2_alone_and_with_vocab_parallel_loss():
    """TP=2 on attention and the MLP; then with the embedding and the output layer divided too and
    the loss computed on the vocabulary shards. Each device holds 1/2 of every divided weight
    (measured), and the vocab-parallel loss never holds a whole row of logits."""
    seen = {}

    def hook(key):
        def look(job):
            seen[key] = (job.memory(), job.program)
        return look
    assert_same(train(strategy(vocab=False), {"tp": 2}, job_hook=hook("whole")))
    assert_same(train(strategy(vocab=True), {"tp": 2}, job_hook=hook("vocab")))

    model = make_model(stages=1, vocab=VOCAB)
    everything = bytes_of(model, [n for n, _ in model.named_parameters()])     # what one device holds at tp=1
    for key, (memory, program) in seen.items():
        divided = set(program.tensor.dims)
        assert ("embed.weight" in divided) == (key == "vocab")
        assert {"blocks.0.attn.q.weight", "blocks.1.mlp.down.weight"} <= divided
        for rank in (0, 1):
            assert memory[rank]["params"] == everything - bytes_of(model, divided) // 2, (key, rank)
    # The loss on shards: no tensor of any region's graph ends in the vocabulary (without vocab
    # parallelism the logits do), and the activations saved for backward are fewer.
    assert VOCAB in last_dims(seen["whole"][1])
    assert VOCAB not in last_dims(seen["vocab"][1]) and VOCAB // 2 in last_dims(seen["vocab"][1])
    for rank in (0, 1):
        assert seen["vocab"][0][rank]["activations_peak"] < seen["whole"][0][rank]["activations_peak"]


@pytest.mark.usefixtures("ray_cluster")
def test_tp2_with_sequence_parallelism():
    seen = {}
    assert_same(train(strategy(sequence=True), {"tp": 2}, job_hook=lambda job: seen.update(tensor=job.program.tensor)))
    # The norms run on sequence shards: their gradients are partial along tp and summed over it.
    assert {"blocks.0.attn_norm.weight", "blocks.1.mlp_norm.weight", "norm.weight"} <= seen["tensor"].summed


@pytest.mark.usefixtures("ray_cluster")
def test_dp2_x_tp2_with_zero1_and_its_checkpoint_at_tp1_and_at_pp2_x_tp2(tmp_path):
    """DP=2 x TP=2 with ZeRO-1 equals one device; its checkpoint (whole parameters, the shards
    as chunks) loads at tp=1 and at pp=2 x tp=2 with SP, and the next steps equal one device's."""
    import copy

    from piper.testing import single_device

    model, data = make_model(stages=2, vocab=VOCAB), batches(count=5, vocab=VOCAB)
    reference = copy.deepcopy(model)
    with piper.compile(copy.deepcopy(model), data[0], strategy=strategy(dp="zero1"), mesh={"dp": 2, "tp": 2},
                       optimizer=ADAMW, progress=False) as job:
        first = [job.step(*b) for b in data[:3]]
        job.save(tmp_path / "tp2")
    ref_losses, ref_state = single_device(reference, data, ADAMW)
    for plan, mesh in ((None, None), (strategy(pp=True, sequence=True), {"pp": 2, "tp": 2})):
        with piper.compile(copy.deepcopy(model), data[0], strategy=plan, mesh=mesh, optimizer=ADAMW,
                           progress=False) as job:
            job.load(tmp_path / "tp2")
            then = [job.step(*b) for b in data[3:]]
            assert_same((first + then, ref_losses, job.state_dict(), ref_state))


@pytest.mark.usefixtures("ray_cluster")
def test_a_checkpoint_goes_from_no_tp_to_tp4_and_from_tp4_to_dp2_x_tp2(tmp_path):
    """The other way round: a checkpoint of ZeRO-3 over dp=2 (no TP) loads at tp=4 with SP, and
    that one's at dp=2 x tp=2 with ZeRO-1; every step equals one device's."""
    import copy

    from piper.testing import single_device

    model, data = make_model(stages=1, vocab=VOCAB, kv_heads=4), batches(count=4, vocab=VOCAB)
    ref_losses, ref_state = single_device(copy.deepcopy(model), data, ADAMW)
    legs = ((load_strategy("use zero3() on dp\n"), {"dp": 2}, data[:2]),
            (strategy(sequence=True), {"tp": 4}, data[2:3]),
            (strategy(dp="zero1"), {"dp": 2, "tp": 2}, data[3:]))
    losses, saved = [], None
    for k, (plan, mesh, steps) in enumerate(legs):
        with piper.compile(copy.deepcopy(model), data[0], strategy=plan, mesh=mesh, optimizer=ADAMW,
                           progress=False) as job:
            if saved is not None:
                job.load(saved)
            losses += [job.step(*b) for b in steps]
            saved = tmp_path / f"leg{k}"
            job.save(saved)
            state = job.state_dict()
    assert_same((losses, ref_losses, state, ref_state))


@pytest.mark.full          # the 8-worker DP x PP x TP test runs 1F1B with SP by default
@pytest.mark.usefixtures("ray_cluster")
def test_pp2_x_tp2_with_1f1b_and_sequence_parallelism():
    assert_same(train(strategy(pp=True, sequence=True), {"pp": 2, "tp": 2}, stages=2))


@pytest.mark.usefixtures("ray_cluster")
def test_dp2_x_pp2_x_tp2_with_zero3_1f1b_sequence_and_vocab_on_8_workers():
    seen = {}
    assert_same(train(strategy(dp="zero3", pp=True, sequence=True), {"dp": 2, "pp": 2, "tp": 2}, stages=2, batch=8,
                      job_hook=lambda job: seen.update(program=job.program)))
    assert len(seen["program"].regions) == 2 and VOCAB not in last_dims(seen["program"])


class MoEBlock(nn.Module):
    """Grouped-query attention (q/k/v/o projections) and a `piper.nn.MoE` feed-forward."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.attn_norm, self.moe_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.moe = piper.nn.MoE(dim, 32, 4, 2, shared_hidden=16)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoELM(nn.Module):
    def __init__(self, vocab=VOCAB, dim=32, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        with piper.annotate("PP"):
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.usefixtures("ray_cluster")
def test_pp2_x_tp2_with_zero_bubble_recompute_sequence_and_clipping():
    """The training options compose with TP: a split backward (BI/BW), recomputed regions and a
    global-norm clip that counts each element once (the replicated norms on one tp index)."""
    @piper.strategy
    def plan(s):
        s.use("zero_bubble", microbatches=2, on="pp")
        s.recompute("PP=*")
        tensor_parallel(s, sequence=True)
    assert_same(train_both(make_model(stages=2, vocab=VOCAB), plan, mesh={"pp": 2, "tp": 2},
                           batches=batches(vocab=VOCAB), optimizer=ADAMW, progress=False, clip_grad_norm=0.05))


@pytest.mark.full
@pytest.mark.usefixtures("ray_cluster")
def test_pp2_x_tp2_under_dualpipev():
    """DualPipeV's overlapped slots with TP: each lane has its own tensor group."""
    @piper.strategy
    def plan(s):
        s.use("dualpipev", microbatches=4, on="pp")
        tensor_parallel(s)
    assert_same(train_both(make_model(stages=4, layers=4, vocab=VOCAB), plan, mesh={"pp": 2, "tp": 2},
                           batches=batches(vocab=VOCAB), optimizer=ADAMW, progress=False))


@pytest.mark.usefixtures("ray_cluster")
def test_moe_with_experts_over_dp2_and_attention_over_tp2():
    @piper.strategy
    def plan(s):
        s.use("dp", on="dp")
        s.shard("experts", over="dp")
        s.shard("columns", of=["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v"], over="tp")
        s.shard("rows", of=["blocks.*.attn.o"], over="tp")

    seen = {}
    model = MoELM().double()
    assert_same(train_both(model, plan, mesh={"dp": 2, "tp": 2}, batches=batches(batch=4, vocab=VOCAB),
                           optimizer=ADAMW, progress=False, job_hook=lambda job: seen.update(m=job.memory())))
    experts = [n for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and p.dim() == 3]
    attention = [n for n, _ in model.named_parameters() if ".attn." in n]
    rest = [n for n, _ in model.named_parameters() if n not in experts and n not in attention]
    held = bytes_of(model, rest) + bytes_of(model, experts) // 2 + bytes_of(model, attention) // 2
    assert {seen["m"][rank]["params"] for rank in range(4)} == {held}


def hf_llama():
    """A tiny Hugging Face Llama (grouped-query attention: 4 heads, 2 key/value heads) in float64,
    cut into two stages by module path; forward returns the loss taken from its logits."""
    transformers = pytest.importorskip("transformers")

    class CausalLM(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.m = model

        def forward(self, idx, targets):
            return F.cross_entropy(self.m(input_ids=idx).logits.flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8)
    model = CausalLM(transformers.LlamaForCausalLM(cfg)).double()
    return piper.annotate_modules(model, "PP", [["m.model.embed_tokens", "m.model.layers.0"],
                                                ["m.model.layers.1", "m.model.norm", "m.lm_head"]])


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "tp+sp"])
def test_hugging_face_llama_under_pp2_x_tp2_by_module_path(sequence):
    """With SP, the sequence shards begin at the first decoder layer: Hugging Face makes the
    positions and the causal mask from the embedding's output, which stays whole."""
    model = hf_llama()
    plan = load_strategy("use one_f_one_b(microbatches=2) on pp\n"
                         f"use llama_tensor_parallel(sequence={str(sequence).lower()}) on tp\n")
    seen = {}
    assert_same(train_both(model, plan, mesh={"pp": 2, "tp": 2}, batches=batches(batch=4, vocab=VOCAB),
                           optimizer=ADAMW, progress=False,
                           job_hook=lambda job: seen.update(program=job.program)))
    layout = seen["program"].tensor
    assert {"m.model.layers.1.self_attn.k_proj.weight", "m.model.layers.0.mlp.down_proj.weight",
            "m.model.embed_tokens.weight", "m.lm_head.weight"} <= set(layout.dims)
    assert len(seen["program"].regions) == 2 and VOCAB not in last_dims(seen["program"]), "the loss is on shards"
    assert layout.sequence_from == ("m.model.layers.0" if sequence else "")
    if sequence:      # the norms run on sequence shards: their gradients are summed over tp
        assert {"m.model.layers.0.input_layernorm.weight", "m.model.norm.weight"} <= layout.summed


# ---- the vocab-parallel loss on one device (no tensor group: the collectives are the identity)

@pytest.mark.parametrize("ignore", [False, True])
def test_vocab_cross_entropy_is_cross_entropy_and_keeps_one_copy_of_the_logits(ignore):
    from piper.tensor_ops import vocab_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(12, VOCAB, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, VOCAB, (12,))
    if ignore:
        target[::3] = -100
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size() if t.is_floating_point() else 0)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = vocab_cross_entropy(logits, target)
    ref = F.cross_entropy(logits, target)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0],
                               rtol=0, atol=1e-12)
    # For backward it keeps the exponentials and vectors, not a second [N, V] tensor (cross_entropy
    # keeps log_softmax's result: at tp=2 two halves would be as much as that).
    assert logits.numel() * 8 <= sum(kept) < logits.numel() * 8 * 3 // 2, kept


def test_the_vocab_cross_entropy_backward_allocates_one_tensor_of_the_logits_size():
    """Where a step peaks (the loss's backward), the vocab-parallel loss's backward writes the
    logits' gradient into one new tensor: autograd through its pieces allocated three, and
    `cross_entropy` allocates two. From every allocation torch's profiler records."""
    from piper.tensor_ops import vocab_cross_entropy

    def rise(fn) -> float:
        logits = torch.randn(64, 512, requires_grad=True)
        loss = fn(logits, torch.randint(0, 512, (64,)))
        return allocation_rise(loss.backward) / (logits.numel() * logits.element_size())
    assert rise(vocab_cross_entropy) < 1.1 and rise(F.cross_entropy) >= 1.9


class FlattenedLoss(LlamaTP):
    """llama_tp's model taking its loss as Hugging Face users write it: `logits.flatten(0, 1)`."""

    def forward(self, idx, targets):
        x = self.embed(idx)
        with piper.annotate("PP"):
            for block in self.blocks:
                x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


def test_flattened_logits_get_the_vocab_parallel_loss_too():
    from piper.frontend.capture import capture
    from piper.frontend.tensor_parallel import plan_of
    from piper.job import build_strategy
    from piper.mesh import Mesh

    torch.manual_seed(0)
    mesh, directives = build_strategy(strategy(), Mesh.of({"tp": 2}))
    program = capture(FlattenedLoss(vocab=VOCAB, stages=1).double(), batches(1, vocab=VOCAB)[0], (),
                      plan_of(directives, mesh))
    ops = {getattr(getattr(n.target, "_schema", None), "name", None) for r in program.regions
           for n in r.graph.graph.nodes}
    assert "piper::tp_max" in ops and VOCAB not in last_dims(program)     # the loss on shards, inlined


# ---- diagnostics: `piper.compile` refuses before any worker starts

class FixedHeads(Attention):
    """Attention reshaping with a literal head count: on 2 devices its q holds 2 heads, not 4."""

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, 2, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, 2, self.head_dim).transpose(1, 2)
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def fixed_heads():
    model = make_model(stages=1)
    for block in model.blocks:
        fixed = FixedHeads(32, 4, 2).double()
        fixed.load_state_dict(block.attn.state_dict())
        block.attn = fixed
    return model


def refusal(lines, model=None, mesh=None):
    """The diagnostic `piper.compile` raises for the Python strategy `lines(s)` (before any worker:
    a plan that got past the checks fails the test instead of starting a job)."""
    import piper.job

    with pytest.MonkeyPatch.context() as patch, pytest.raises(PiperError) as info:
        patch.setattr(piper.job, "Job", lambda *a, **k: pytest.fail("piper.compile accepted the plan"))
        piper.compile(model or make_model(stages=1), batches(1)[0], strategy=piper.strategy(lines),
                      mesh=mesh or {"tp": 2}, progress=False)
    (d,) = info.value.diagnostics
    assert d.hint, d
    if d.code != "tp-capture":          # a statement's mistake points at the statement
        assert d.span is not None and d.span.file == __file__, d
    assert "Traceback" not in str(info.value)
    return d


def rows_and_columns(s):
    s.shard("columns", of=["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v"], over="tp")
    s.shard("rows", of=["blocks.*.attn.o"], over="tp")


def test_a_pattern_matching_nothing_suggests_the_closest_module():
    d = refusal(lambda s: (s.shard("columns", of=["blocks.*.atn.q"], over="tp"), rows_and_columns(s)))
    assert d.code == "unknown-module" and "blocks.*.atn.q" in d.message
    assert "did you mean" in d.hint and ".attn.q`" in d.hint


@pytest.mark.parametrize("pattern, kind", [("blocks.*.attn", "columns"), ("blocks.*.attn_norm", "rows"),
                                           ("norm", "vocab")])
def test_a_module_of_another_type_is_refused(pattern, kind):
    d = refusal(lambda s: (rows_and_columns(s), s.shard(kind, of=[pattern], over="tp")))
    assert d.code == "tp-module-type" and pattern.replace("*", "0") in d.message


def test_features_that_do_not_divide():
    d = refusal(rows_and_columns, mesh={"tp": 3})
    assert d.code == "tp-indivisible" and "`blocks.0.attn.q`" in d.message and "size 3" in d.message


def test_heads_that_do_not_divide():
    # 2 heads of 16 features, 1 key/value head: k's 16 features divide over 2, its one head does not.
    d = refusal(rows_and_columns, model=make_model(stages=1, heads=2, kv_heads=1))
    assert d.code == "tp-indivisible" and "attn` has n_kv_heads=1" in d.message


def test_rows_without_columns_and_columns_without_rows():
    d = refusal(lambda s: s.shard("rows", of=["blocks.*.attn.o"], over="tp"))
    assert d.code == "tp-unpaired" and "rows" in d.message
    d = refusal(lambda s: s.shard("columns", of=["blocks.*.mlp.up"], over="tp"))
    assert d.code == "tp-unpaired" and "columns" in d.message


def test_shard_sequence_without_tensor_parallel_modules():
    d = refusal(lambda s: (s.shard("vocab", of=["embed", "head"], over="tp"), s.shard("sequence", over="tp")))
    assert d.code == "sequence-without-tp" and "sequence" in d.message


def test_sequence_parallelism_without_a_vocab_sharded_embedding():
    d = refusal(lambda s: (rows_and_columns(s), s.shard("sequence", over="tp")))
    assert d.code == "sequence-needs-vocab" and "shard vocab" in d.hint


def test_a_model_reshaping_to_a_fixed_head_count():
    d = refusal(rows_and_columns, model=fixed_heads())
    assert d.code == "tp-capture" and "size 2" in d.message and "view(B, T, -1, head_dim)" in d.hint


def test_the_capture_refusal_names_the_line_and_the_shapes():
    d = refusal(rows_and_columns, model=fixed_heads())
    assert "test_tensor_parallel.py:" in d.message and "[4, 8, 4, 8]" in d.message
