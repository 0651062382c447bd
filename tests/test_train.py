"""Distributed training equals single-device training: every strategy, 3 steps,
same initial weights and global batches; losses and final parameters compared."""
import functools

import pytest
import torch

import piper
from examples.gpt import _corpus_tokens, batches, make_model
from examples.strategies import one_f_one_b_order as one_f_one_b
from piper.testing import train_both
from piper.dsl.script import load_strategy

pytestmark = pytest.mark.usefixtures("ray_cluster")


def gpt(n_regions=4, dtype=torch.float32):
    model, cfg = make_model(n_layer=n_regions, n_regions=n_regions, n_embd=32, n_head=2, block_size=16)
    return model.to(dtype)


def gpt_batches(steps=3, batch=8):
    stream = batches(_corpus_tokens()[1], batch, 16, seed=1)
    return [next(stream) for _ in range(steps)]


def assert_same_training(result, rtol=1e-5, atol=1e-5):
    """Losses and parameters equal within `rtol`.

    `atol` covers parameters whose true gradient is zero (an attention key's
    bias: softmax ignores it): their gradient is rounding noise, which Adam
    scales up to about lr-sized steps in float32. The float64 tests below
    check the same strategies to 1e-10.
    """
    losses, ref_losses, state, ref_state = result
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=rtol, atol=atol)
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    assert losses[-1] < losses[0] or len(losses) < 2  # it really trained


def pipeline(microbatches, *, order=None, regions_per_device=1, batch_axis=None, zero=()):
    @piper.strategy
    def strategy(s):
        p = s.size("pp")
        s.split("MB", microbatches)
        for r in range(p * regions_per_device):
            s.place(f"PP={r}", s.mesh["pp"][r % p])
        if batch_axis:
            s.shard("batch", over=batch_axis)
            if zero:
                s.shard(*zero, over=batch_axis)
        if order:
            for stage in range(p):
                s.order(f"PP={stage}", order(stage, p, microbatches))
    return strategy


def data_parallel(*what):
    @piper.strategy
    def strategy(s):
        s.shard("batch", over="dp")
        if what:
            s.shard(*what, over="dp")
    return strategy


@pytest.mark.parametrize("what", [(), ("optimizer",), ("optimizer", "grads"), ("optimizer", "grads", "params")],
                         ids=["dp", "zero1", "zero2", "zero3"])
def test_data_parallel_and_zero(what):
    assert_same_training(train_both(gpt(2), data_parallel(*what), mesh={"dp": 2}, batches=gpt_batches()))


@pytest.mark.parametrize("stages", [2, pytest.param(4, marks=pytest.mark.full)])
def test_pipeline_gpipe(stages):
    result = train_both(gpt(stages), pipeline(4), mesh={"pp": stages}, batches=gpt_batches())
    assert_same_training(result)


@pytest.mark.full       # test_zero3_1f1b_float64_is_exact holds a pipeline to 1e-10 by default
def test_pipeline_gpipe_float64_is_exact():
    result = train_both(gpt(4, torch.float64), pipeline(4), mesh={"pp": 4}, batches=gpt_batches())
    assert_same_training(result, rtol=1e-10, atol=1e-12)


def test_pipeline_1f1b_order_is_followed():
    plans = {}
    result = train_both(gpt(4), pipeline(8, order=one_f_one_b), mesh={"pp": 4}, batches=gpt_batches(),
                        job_hook=lambda job: plans.update({r: job.compiled.compute_order(r) for r in range(4)}))
    assert_same_training(result)
    assert plans[3][:4] == ["3F0", "3B0", "3F1", "3B1"]
    assert plans[0][:5] == ["0F0", "0F1", "0F2", "0F3", "0B0"]


def test_interleaved_two_regions_per_device():
    result = train_both(gpt(4), pipeline(4, regions_per_device=2), mesh={"pp": 2}, batches=gpt_batches())
    assert_same_training(result)


@pytest.mark.full       # the same composition in float64 (test_zero3_1f1b_float64_is_exact) runs by default
def test_zero3_with_1f1b_on_dp2_pp2():
    strategy = pipeline(4, order=one_f_one_b, batch_axis="dp", zero=("optimizer", "grads", "params"))
    result = train_both(gpt(2), strategy, mesh={"dp": 2, "pp": 2}, batches=gpt_batches())
    assert_same_training(result)


def test_zero3_1f1b_float64_is_exact():
    strategy = pipeline(4, order=one_f_one_b, batch_axis="dp", zero=("optimizer", "grads", "params"))
    result = train_both(gpt(2, torch.float64), strategy, mesh={"dp": 2, "pp": 2}, batches=gpt_batches())
    assert_same_training(result, rtol=1e-10, atol=1e-12)


def test_bfloat16_and_sgd_momentum():
    from tests.test_precision import low_precision_reference

    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    strategy = pipeline(2, batch_axis="dp", zero=("optimizer", "grads"))
    model, batches = gpt(2, torch.bfloat16), gpt_batches()
    losses, _, state, _ = train_both(model, strategy, mesh={"dp": 2, "pp": 2}, batches=batches, optimizer=sgd)
    # bf16 sums in another order differ in the last bit: against one device summing in Piper's order, exact.
    ref_losses, ref_state = low_precision_reference(model, batches, sgd, microbatches=2, shards=2)
    assert losses == ref_losses and losses[-1] < losses[0]
    assert all(torch.equal(state[k], v) for k, v in ref_state.items())


class SkipModel(torch.nn.Module):
    """Three regions; region 0's output feeds region 1 and, skipping it, region 2."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        with piper.annotate("PP"):
            h = torch.tanh(self.a(x))
        with piper.annotate("PP"):
            g = torch.tanh(self.b(h))
        with piper.annotate("PP"):
            out = self.c(g + h).squeeze(-1)
            loss = ((out - y) ** 2).mean()
        return loss


def test_skip_connection_over_three_devices():
    torch.manual_seed(0)
    data = [(torch.randn(8, 8), torch.randn(8)) for _ in range(3)]
    result = train_both(SkipModel(), pipeline(2), mesh={"pp": 3}, batches=data)
    assert_same_training(result)


def test_zero3_divides_memory():
    mem = {}
    model = gpt(2)
    n_params = sum(p.numel() for p in model.parameters())
    train_both(model, data_parallel("optimizer", "grads", "params"), mesh={"dp": 2}, batches=gpt_batches(1),
               job_hook=lambda job: mem.update(job.memory()))
    train_both(model, data_parallel(), mesh={"dp": 2}, batches=gpt_batches(1),
               job_hook=lambda job: mem.update({("dp", r): m for r, m in job.memory().items()}))
    full = n_params * 4
    for rank in (0, 1):
        zero3 = mem[rank]
        assert zero3["params"] == pytest.approx(full / 2, rel=0.01)
        assert zero3["optimizer"] == pytest.approx(2 * full / 2, rel=0.01)   # AdamW: two moments
        dp = mem[("dp", rank)]
        assert dp["params"] == pytest.approx(full, rel=0.01)
        assert dp["optimizer"] == pytest.approx(2 * full, rel=0.01)
        # gradients exist from a unit's first backward (ZeRO-3: its first reduce-scatter) to its
        # update, not between steps (test_memory_model holds the step's peak, gradients included,
        # to the prediction)
        assert dp["grads"] == zero3["grads"] == 0


def test_one_f_one_b_holds_fewer_activations_than_gpipe():
    peaks = {}
    for name, order in (("gpipe", None), ("1f1b", one_f_one_b)):
        train_both(gpt(2), pipeline(8, order=order), mesh={"pp": 2}, batches=gpt_batches(1),
                   job_hook=lambda job, name=name: peaks.update({name: job.memory()[0]["activations_peak"]}))
    # Stage 0 keeps all 8 microbatches under GPipe and at most 2 under 1F1B.
    assert peaks["1f1b"] * 3 < peaks["gpipe"]
    assert peaks["gpipe"] == pytest.approx(4 * peaks["1f1b"], rel=0.1)


def layered_gpt(stages: int, dtype=torch.float64):
    """Two blocks per stage, each block (and the embeddings, and the head) its own `L` region in its stage."""
    model, _ = make_model(n_layer=2 * stages, n_regions=stages, layer_regions=True, n_embd=32, n_head=2,
                          block_size=16)
    return model.to(dtype)


@pytest.mark.parametrize("schedule,stages", [pytest.param("one_f_one_b", 2, marks=pytest.mark.full), ("dualpipev", 4)])
def test_stages_cut_into_layer_regions_train_exactly(schedule, stages):
    # A stage of several regions: `F(MB=0)` names a chain of forwards, which runs in order
    # (not in lanes), and ZeRO-3 gathers and frees each block's parameters on its own.
    strategy = load_strategy(f"use {schedule}(microbatches=4) on pp\nuse zero3() on dp\n")
    result = train_both(layered_gpt(stages), strategy, mesh={"dp": 2, "pp": 2}, batches=gpt_batches())
    assert_same_training(result, rtol=1e-10, atol=1e-12)


def _watch_gradient_buffers(worker) -> None:
    """Inside a worker: after every action, the bytes of full gradient buffers alive (attached or in flight)."""
    ex = worker.executor
    worker.grad_high_water = 0
    run = ex._run

    def watched(action):
        out = run(action)
        alive = [g for u in ex.units.values() for g in [*u.flat_grad, *(t for sent in u.in_flight for t in sent)]
                 if g is not None]
        worker.grad_high_water = max(worker.grad_high_water, sum(g.untyped_storage().nbytes() for g in alive))
        return out

    ex._run = watched


def test_zero2_never_holds_a_stage_of_full_gradients_across_microbatches():
    # Stage 0 holds the embeddings and 4 blocks, each its own unit. ZeRO-2 reduce-scatters each
    # microbatch's gradients after its backward and lets the buffer go once that is done (one
    # compute later), so at most a few blocks' full gradients exist at once; dp keeps them all.
    import ray

    model, _ = make_model(n_layer=8, n_regions=2, layer_regions=True, n_embd=32, n_head=2, block_size=16)
    stage0 = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith(("blocks.4", "blocks.5",
                 "blocks.6", "blocks.7", "ln_f", "lm_head")))
    high, mem = {}, {}
    for level in ("dp", "zero2"):
        strategy = load_strategy(f"use one_f_one_b(microbatches=4) on pp\nuse {level}() on dp\n")
        batch = gpt_batches(1)[0]
        with piper.compile(model, batch, strategy=strategy, mesh={"dp": 2, "pp": 2}) as job:
            job.step(*batch)       # the optimizer's state exists from the second step on
            ray.get([a.__ray_call__.remote(_watch_gradient_buffers) for a in job.actors])
            job.step(*batch)
            high[level] = ray.get(job.actors[0].__ray_call__.remote(lambda w: w.grad_high_water))
            mem[level] = job.memory()[0]
    assert high["dp"] >= stage0
    assert high["zero2"] <= 0.8 * stage0
    # The runtime's own high-water mark sees it too, and is at least what stays between steps.
    assert mem["zero2"]["step_peak"] < mem["dp"]["step_peak"]
    for m in mem.values():
        assert m["step_peak"] >= m["params"] + m["grads"] + m["optimizer"] + m["activations_peak"]


def _tensors_in_a_graph(worker) -> int:
    """Inside a worker: tensors still attached to an autograd graph. None should outlive a step."""
    import gc
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize("schedule,regions", [("zbv", 4), ("dualpipev", 4), ("zero_bubble", 2),
                                              ("interleaved_zero_bubble", 4)])
def test_split_backward_frees_every_graph_by_the_end_of_the_step(schedule, regions):
    # BI keeps the graph for BW, and BW frees only the part between the weights and BI's
    # saved intermediates; the rest must go too, or each step leaks a step of activations.
    import ray

    left = {}

    def count(job):
        left.update(enumerate(ray.get([a.__ray_call__.remote(_tensors_in_a_graph) for a in job.actors])))

    strategy = load_strategy(f"use {schedule}(microbatches=4) on pp\n")
    result = train_both(gpt(regions), strategy, mesh={"pp": 2}, batches=gpt_batches(), job_hook=count)
    assert_same_training(result)
    assert left == {0: 0, 1: 0}
