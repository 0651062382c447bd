"""`piper.compile(..., precision="bf16")`: 16-bit compute, float32 master weights, optimizer state
and gradient reductions. Checked against torch doing the same on one device (bitwise, over 20
steps), and by the bytes each device holds against float32.

The torch recipe Piper follows is the master-weights one (FSDP2's `MixedPrecisionPolicy(param_dtype=
bfloat16, reduce_dtype=float32)`, Megatron's and Apex O2's), not `torch.autocast`: autocast keeps
float32 weights and picks a dtype per op (layer norms, softmax and the loss in float32), while Piper
runs every op of a region on a 16-bit copy of the weights, as `model.to(bfloat16)` does.
"""
import copy
import functools

import pytest
import torch

import piper
from examples.strategies import one_f_one_b_order as one_f_one_b
from tests.test_train import data_parallel, gpt, gpt_batches, pipeline

ZERO3 = ("optimizer", "grads", "params")
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def mixed_precision_reference(model, batches, dtype, *, microbatches: int = 1, shards: int = 1, fp16=None):
    """One device, torch's master-weights recipe: a `dtype` copy of `model` computes forward and
    backward, the float32 model holds the master weights, gets the gradients cast to float32 and
    summed there, and AdamW steps it; with `fp16` (a `piper.FP16`) torch.amp.GradScaler scales the
    loss, unscales the gradients and skips the steps they overflow, with those settings.

    The batch is cut as Piper cuts it (`shards` data-parallel shards, each `microbatches`
    microbatches), each backward is seeded as Piper seeds it (1 / (microbatches x shards), times the
    loss scale: the loss upcast first, so that a scale of 2**16 does not overflow the float16 seed),
    the float32 gradients are summed over a shard's microbatches, then over the shards, and torch
    runs on one thread as each CPU worker does (a layer norm's weight gradient is summed per
    thread): what Piper computes, to the bit. Returns (losses, master state_dict)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _mixed_precision_steps(model, batches, dtype, microbatches, shards, fp16)
    finally:
        torch.set_num_threads(threads)


def _mixed_precision_steps(model, batches, dtype, microbatches, shards, fp16):
    master = copy.deepcopy(model)
    low = copy.deepcopy(model).to(dtype)
    opt = ADAMW(list(master.parameters()))
    scaler = None if fp16 is None else torch.amp.GradScaler(
        "cpu", init_scale=fp16.init_scale, growth_factor=fp16.growth_factor, backoff_factor=fp16.backoff_factor,
        growth_interval=fp16.growth_interval)
    pieces = microbatches * shards
    losses = []
    for batch in batches:
        with torch.no_grad():
            for p16, p32 in zip(low.parameters(), master.parameters()):
                p16.copy_(p32)
        cut = list(zip(*(x.chunk(pieces) for x in (x.to(dtype) if x.is_floating_point() else x for x in batch))))
        sums, step_losses = [], []
        for s in range(shards):
            acc = [torch.zeros_like(p) for p in master.parameters()]
            for piece in cut[s * microbatches:(s + 1) * microbatches]:
                low.zero_grad(set_to_none=True)
                loss = low(*piece)
                if scaler is None:
                    loss.backward(torch.full((), 1.0 / pieces, dtype=loss.dtype))
                else:
                    scaler.scale(loss.float() * (1.0 / pieces)).backward()
                for a, p16 in zip(acc, low.parameters()):
                    a += p16.grad.float()
                step_losses.append(loss.item())
            sums.append(acc)
        for i, p in enumerate(master.parameters()):
            p.grad = functools.reduce(torch.add, (acc[i] for acc in sums))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        losses.append(sum(step_losses) / len(step_losses))      # as job.step averages them
    return losses, master.state_dict()


def low_precision_reference(model, batches, optimizer, *, microbatches: int = 1, shards: int = 1):
    """One device training a model held in 16 bits (no master weights, `model.to(bfloat16)`),
    cut, seeded and summed as Piper does (`mixed_precision_reference`), the gradients summed in
    the model's dtype as Piper's gradient buffers and reductions hold them; one thread. Returns
    (losses, state_dict)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = copy.deepcopy(model)
        opt = optimizer(list(model.parameters()))
        pieces = microbatches * shards
        losses = []
        for batch in batches:
            cut = list(zip(*(x.chunk(pieces) for x in batch)))
            sums, step_losses = [], []
            for s in range(shards):
                acc = None
                for piece in cut[s * microbatches:(s + 1) * microbatches]:
                    model.zero_grad(set_to_none=True)
                    loss = model(*piece)
                    loss.backward(torch.full((), 1.0 / pieces, dtype=loss.dtype))
                    grads = [p.grad for p in model.parameters()]
                    acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
                    step_losses.append(loss.item())
                sums.append(acc)
            for i, p in enumerate(model.parameters()):
                p.grad = functools.reduce(torch.add, (acc[i] for acc in sums))
            opt.step()
            losses.append(sum(step_losses) / len(step_losses))
        return losses, model.state_dict()
    finally:
        torch.set_num_threads(threads)


def assert_bitwise(losses, state, ref_losses, ref_state):
    assert losses == ref_losses
    for name, ref in ref_state.items():
        assert state[name].dtype == torch.float32, name      # the masters stay float32
        assert torch.equal(state[name], ref), (name, (state[name] - ref).abs().max())


def _train(strategy, mesh, batches, **options):
    model = gpt(2)
    with piper.compile(copy.deepcopy(model), batches[0], strategy=strategy, mesh=mesh, optimizer=ADAMW,
                       timeout=120, **options) as job:
        losses = [job.step(*b) for b in batches]
        return model, losses, job.state_dict(), job.memory()


CASES = {    # strategy, mesh, precision, steps, microbatches, shards
    "zero3x1f1b-bf16": (lambda: pipeline(4, order=one_f_one_b, batch_axis="dp", zero=ZERO3), {"dp": 2, "pp": 2},
                        "bf16", 20, 4, 2),
    # Replicated parameters refresh their 16-bit copy each step; ZeRO-1 gathers the float32 update.
    # GradScaler's defaults (2**16): a float16 seed of 2**16 itself would be inf.
    "zero1-fp16": (lambda: data_parallel("optimizer"), {"dp": 2}, "fp16", 5, 1, 2),
}


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("case", list(CASES))
def test_16_bit_training_follows_the_mixed_precision_reference(case):
    strategy, mesh, precision, steps, microbatches, shards = CASES[case]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    batches = gpt_batches(steps)
    model, losses, state, _ = _train(strategy(), mesh, batches, precision=precision)
    ref_losses, ref_state = mixed_precision_reference(model, batches, dtype, microbatches=microbatches,
                                                      shards=shards, fp16=piper.FP16() if precision == "fp16" else None)
    assert losses[-1] < losses[0]                      # it trained
    assert_bitwise(losses, state, ref_losses, ref_state)


@pytest.mark.usefixtures("ray_cluster")
def test_bf16_memory_per_device_against_fp32():
    # (Suite 9 of the benchmarks measures ZeRO-3 x 1F1B on dp=2 x pp=2 the same way.)
    strategy = data_parallel(*ZERO3)
    batches = gpt_batches(1)
    *_, fp32 = _train(strategy, {"dp": 2}, batches)
    *_, bf16 = _train(strategy, {"dp": 2}, batches, precision="bf16")
    for rank in range(2):
        # Between steps a ZeRO-3 device holds float32 shards, gradients and AdamW moments either way.
        for kind in ("params", "grads", "optimizer"):
            assert bf16[rank][kind] == fp32[rank][kind], (rank, kind)
        # Activations are saved in 16 bits: half the bytes (the token ids saved by the embedding stay int64).
        assert bf16[rank]["activations_peak"] < 0.6 * fp32[rank]["activations_peak"]
        assert bf16[rank]["step_peak"] < fp32[rank]["step_peak"]


@pytest.mark.parametrize("value", ["int8", "bfloat16", None, 16])
def test_bad_precision_is_a_diagnostic(value):
    with pytest.raises(piper.PiperError) as info:
        piper.compile(gpt(2), gpt_batches(1)[0], precision=value)
    assert info.value.code == "bad-precision"
    if value == "int8":
        assert "not supported" in str(info.value)


@pytest.mark.usefixtures("ray_cluster")
def test_bf16_with_recompute_under_zero_bubble():
    # Split backward (BI/BW) resumes through the cast to the float32 masters; the recomputed forward
    # takes the 16-bit parameters as the backward sees them.
    from piper.dsl.script import load_strategy

    batches = gpt_batches(3)
    strategy = load_strategy("use zero_bubble(microbatches=4) on pp\nrecompute PP=*\n")
    model, losses, state, _ = _train(strategy, {"pp": 2}, batches, precision="bf16")
    assert_bitwise(losses, state, *mixed_precision_reference(model, batches, torch.bfloat16, microbatches=4))


@pytest.mark.usefixtures("ray_cluster")
def test_float_inputs_are_passed_in_their_own_dtype_and_cast():
    from tests.test_train import SkipModel

    torch.manual_seed(0)
    model = SkipModel()
    batches = [(torch.randn(8, 8), torch.randn(8)) for _ in range(3)]
    with piper.compile(copy.deepcopy(model), batches[0], strategy=data_parallel(), mesh={"dp": 2}, optimizer=ADAMW,
                       timeout=120, precision="bf16") as job:
        losses = [job.step(*b) for b in batches]          # float32 inputs, as the example batch
        state = job.state_dict()
    # The reference casts the float inputs to bfloat16 as the workers do.
    assert_bitwise(losses, state, *mixed_precision_reference(model, batches, torch.bfloat16, shards=2))
