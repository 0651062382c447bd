"""Optimizers that update a whole parameter at a time (Muon, Adafactor, `piper_update = "tensor"`),
alone or beside AdamW through `piper.per_group`, equal to one device under dp, ZeRO-1/2/3 and pp.

Float64, from the same weights, three steps: losses and every parameter within 1e-9 of
`piper.testing.single_device` with the optimizer one device builds (`PerGroup.build`).
"""
import copy
import functools
import warnings

import pytest
import torch

import piper
from examples.strategies import one_f_one_b_order as one_f_one_b
from piper.compiler.flat_layout import layout_unit, owner_offsets
from piper.compiler.memory_model import predict_memory
from piper.frontend import param_groups
from piper.frontend.optim_check import check_optimizer
from piper.testing import single_device
from tests.test_train import assert_same_training, data_parallel, gpt, gpt_batches, pipeline

MUON = functools.partial(torch.optim.Muon, lr=0.02)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
RECIPE = {"**.weight@2d": MUON, "*": ADAMW}          # matrices by Muon, the rest by AdamW
ZERO = {1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}


class NormScaled(torch.optim.Optimizer):
    """A user's per-tensor update: each parameter steps by its gradient over the parameter's norm
    (a flat slice's norm would give another model), at a rate that falls with its count of
    updates, a plain int in its state (a checkpoint must hand it back)."""

    piper_update = "tensor"

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["updates"] = state.get("updates", 0) + 1
                    p.sub_(group["lr"] / state["updates"] * p.grad / (1.0 + p.norm()))


def train_against_one_device(strategy, mesh, optimizer, *, hook=None, model=None, batches=None, clip=None):
    """(losses, one device's losses, parameters, one device's parameters) after 3 steps (gradients
    clipped to a global norm of `clip` first, if given)."""
    model = model if model is not None else gpt(2, torch.float64)
    batches = batches if batches is not None else gpt_batches()
    reference = copy.deepcopy(model)
    with piper.compile(copy.deepcopy(model), batches[0], strategy=strategy, mesh=mesh, optimizer=optimizer,
                       clip_grad_norm=clip, progress=False) as job:
        losses = [job.step(*b) for b in batches]
        state = job.state_dict()
        if hook is not None:
            hook(job, model)
    build = optimizer.build if isinstance(optimizer, param_groups.PerGroup) else None
    ref_losses, ref_state = single_device(
        reference, batches, (lambda _: build(reference.named_parameters())) if build else optimizer, clip)
    return losses, ref_losses, state, ref_state


def state_bytes_as_predicted(job, model, optimizer):
    """Each device's optimizer-state bytes between steps are the memory model's, exactly."""
    grouped = param_groups.for_program(optimizer.resolve(list(model.named_parameters())), model, job.program.params)
    predicted = predict_memory(job.compiled, job.program, optimizer=grouped)
    held = job.memory()
    for rank, p in predicted.items():
        assert held[rank]["optimizer"] == p.between_steps["optimizer"], rank
    return {rank: held[rank]["optimizer"] for rank in held}


# ---- the optimizers Piper accepts, and how

@pytest.mark.parametrize("optimizer, kind", [
    (torch.optim.Muon, "tensor"), (MUON, "tensor"), (torch.optim.Adafactor, "tensor"), (NormScaled, "tensor"),
    (ADAMW, "element"), (lambda ps: torch.optim.Muon(ps, lr=0.02), "tensor"),
])
def test_update_kinds(optimizer, kind):
    assert check_optimizer(optimizer) == kind


def test_lbfgs_stays_refused_and_a_wrong_piper_update_is_named():
    for optimizer in (torch.optim.LBFGS, functools.partial(torch.optim.LBFGS, lr=1)):
        with pytest.raises(piper.PiperError, match="LBFGS needs a closure") as err:
            check_optimizer(optimizer)
        assert err.value.code == "bad-optimizer"

    class Odd(NormScaled):
        piper_update = "row"
    with pytest.raises(piper.PiperError, match="piper_update = 'row'") as err:
        check_optimizer(Odd)
    assert err.value.code == "bad-optimizer"


def test_per_group_first_pattern_wins_and_dims_filter():
    model = gpt(2, torch.float64)
    named = list(model.named_parameters())
    grouped = piper.per_group({"**.weight@2d": MUON, "**.weight": ADAMW, "*": torch.optim.SGD}).resolve(named)
    for name, p in named:
        cls = grouped.maker(grouped.of[name])[0]
        want = torch.optim.Muon if name.endswith(".weight") and p.dim() == 2 else \
            torch.optim.AdamW if name.endswith(".weight") else torch.optim.SGD
        assert cls is want, name
    assert grouped.maker(grouped.of[next(n for n, p in named if p.dim() == 2)])[1] == {"lr": 0.02}


def test_per_group_unmatched_parameter_is_an_error_and_an_idle_pattern_a_warning():
    named = list(gpt(2, torch.float64).named_parameters())
    with pytest.raises(piper.PiperError, match="match no pattern") as err:
        piper.per_group({"**.weight@2d": MUON}).resolve(named)
    assert err.value.code == "param-not-in-group"
    with pytest.warns(piper.PiperWarning, match="names no parameter"):
        piper.per_group({"*": ADAMW, "**.weight@2d": MUON}).resolve(named)
    with pytest.raises(piper.PiperError, match="not a number of dimensions"):
        piper.per_group({"**.weight@two": MUON, "*": ADAMW})


def test_per_group_takes_param_groups_and_refuses_muon_on_vectors():
    named = list(gpt(2, torch.float64).named_parameters())
    decayed = piper.param_groups(torch.optim.AdamW, lr=1e-3, weight_decay=0.1, no_decay="**.bias")
    grouped = piper.per_group({"**.weight@2d": MUON, "*": decayed}).resolve(named)
    of = {n: grouped.options[grouped.of[n]] for n, _ in named}
    assert of["blocks.0.attn.c_attn.bias"] == {"weight_decay": 0.0}
    assert of["blocks.0.ln_1.weight"] == {"weight_decay": 0.1} and of["blocks.0.attn.c_attn.weight"] == {}
    with pytest.raises(piper.PiperError, match="Muon refuses these groups") as err:
        piper.per_group({"**@1d": MUON, "*": ADAMW}).resolve(named)
    assert err.value.code == "bad-param-groups"


def test_muon_alone_on_a_model_with_vectors_is_refused_at_compile():
    with pytest.raises(piper.PiperError, match=r"(?s)Muon refuses parameter .*per_group") as err:
        param_groups.resolve(MUON, gpt(2, torch.float64))
    assert err.value.code == "bad-optimizer"


def test_owners_balance_and_hold_whole_parameters():
    offsets, padded = owner_offsets(["a", "b", "c"], {"a": 6, "b": 4, "c": 2}, 2, [0, 0])
    assert (offsets, padded) == ({"a": 0, "b": 6, "c": 10}, 12)
    loads = [0, 0, 0]             # fewer parameters than members: one each, the rest own none
    offsets, padded = owner_offsets(["x", "y"], {"x": 5, "y": 5}, 3, loads)
    assert padded == 15 and loads == [5, 5, 0] and sorted(offsets.values()) == [0, 5]

    class Spec:
        def __init__(self, *shape):
            self.shape, self.dtype = shape, torch.float64
    specs = {"w1": Spec(4, 4), "w2": Spec(8, 2), "w3": Spec(3, 3), "b": Spec(4)}
    layout = layout_unit(0, list(specs), specs, (0, 1), whole={"w1", "w2", "w3"}, owned=True, loads=[0, 0])
    (whole,) = [b for b in layout.buckets if b.whole]
    owned = [{e.name for e in whole.owned(i, zero=1)} for i in range(2)]
    assert owned[0] | owned[1] == {"w1", "w2", "w3"} and owned[0] and owned[1] and not owned[0] & owned[1]
    for i in range(2):                # each owner's slice holds its parameters whole
        lo, hi = whole.bounds(i)
        assert all(lo <= e.offset and e.offset + e.numel <= hi for e in whole.entries if e.name in owned[i])


def test_tensor_updates_of_expert_weights_are_refused_under_shard_experts():
    from tests.test_experts import EP, Tiny, moe_layer, script, tiny_batches

    model = Tiny(1, moe_layer()).double()
    with pytest.raises(piper.PiperError, match="`shard experts` divides") as err:
        piper.compile(model, tiny_batches()[0], strategy=script("use dp() on dp\n" + EP), mesh={"dp": 2},
                      optimizer=piper.per_group({"**@2d": MUON, "**@3d": torch.optim.Adafactor, "*": ADAMW}),
                      progress=False)
    assert err.value.code == "bad-optimizer"


@pytest.mark.full
@pytest.mark.usefixtures("ray_cluster")
def test_muon_on_the_matrices_beside_experts_divided_over_dp():
    """The expert weights (3-D) by AdamW in their rows under `shard experts`, the other matrices by
    Muon in the flat units: equal to one device."""
    from tests.test_experts import EP, Tiny, moe_layer, script, tiny_batches

    model = Tiny(1, moe_layer()).double()
    named = dict(model.named_parameters())
    assert any(p.dim() == 3 for p in named.values()) and any(p.dim() == 2 for p in named.values())
    result = train_against_one_device(script("use zero1() on dp\n" + EP), {"dp": 2}, piper.per_group(RECIPE),
                                      model=model, batches=tiny_batches(steps=3))
    assert_same_training(result, rtol=1e-9, atol=1e-9)


# ---- equal to one device

@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("name", ["one", "dp", "zero1", "zero2", "zero3"])
def test_muon_and_adamw_equal_one_device(name):
    optimizer = piper.per_group(RECIPE)
    held = {}
    if name == "one":
        strategy, mesh = None, None
    else:
        strategy, mesh = data_parallel(*ZERO.get(int(name[-1]) if name != "dp" else 0, ())), {"dp": 2}
    hook = (lambda job, model: held.update(state_bytes_as_predicted(job, model, optimizer), norm=job.grad_norm()))
    clip = 0.5 if name == "zero2" else None      # the GPT's gradient norm is about 2.4: every step clips
    assert_same_training(train_against_one_device(strategy, mesh, optimizer, hook=hook, clip=clip),
                         rtol=1e-9, atol=1e-9)
    assert clip is None or held.pop("norm") > 2 * clip
    if name.startswith("zero"):     # each device holds the state of its own share of the matrices
        assert held[0] != held[1]


@pytest.mark.full
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_muon_and_adamw_over_four_devices_with_uneven_owners(zero):
    """The attention's input matrices in a Muon group of their own (a bucket of one matrix per unit:
    fewer than the devices), the other matrices in another (more than the devices)."""
    optimizer = piper.per_group({"**.attn.c_attn.weight": functools.partial(torch.optim.Muon, lr=0.01), **RECIPE})
    held, sizes = {}, []

    def hook(job, model):
        held.update(state_bytes_as_predicted(job, model, optimizer))
        sizes.extend(len(b.entries) for layout in job.layouts.values() for b in layout.buckets if b.whole)
    assert_same_training(train_against_one_device(data_parallel(*ZERO[zero]), {"dp": 4}, optimizer, hook=hook),
                         rtol=1e-9, atol=1e-9)
    assert len(set(held.values())) > 1
    assert min(sizes) < 4 < max(sizes), sizes     # a bucket of fewer matrices than devices, one of more


@pytest.mark.usefixtures("ray_cluster")
def test_muon_and_adamw_under_pipeline_and_zero1():
    strategy = pipeline(4, order=one_f_one_b, batch_axis="dp", zero=ZERO[1])
    assert_same_training(train_against_one_device(strategy, {"dp": 2, "pp": 2}, piper.per_group(RECIPE)),
                         rtol=1e-9, atol=1e-9)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("mesh, zero", [
    ({"tp": 2}, 0),
    pytest.param({"dp": 2, "tp": 2}, 1, marks=pytest.mark.full),
    pytest.param({"dp": 2, "pp": 2, "tp": 2}, 3, marks=pytest.mark.full),
], ids=["tp2-sp", "dp2-tp2-zero1", "dp2-pp2-tp2-zero3-1f1b"])
def test_muon_and_adamw_under_tensor_parallelism(mesh, zero):
    """examples/llama_tp.py's plan with sequence parallelism: each divided matrix is gathered whole
    over tp for its update (its momentum whole on every tp index) and divided again."""
    from examples.llama_tp import batches, make_model
    from tests.test_tensor_parallel import strategy

    optimizer = piper.per_group(RECIPE)
    held = {}
    plan = strategy(sequence=True, dp=(f"zero{zero}" if zero else "dp") if "dp" in mesh else None, pp="pp" in mesh)
    stages, batch = (2, 8) if "pp" in mesh else (1, 4)
    result = train_against_one_device(
        plan, mesh, optimizer, model=make_model(stages=stages, vocab=96),
        batches=[batches(batch=batch, vocab=96)[0]] * 3,
        hook=lambda job, model: held.update(state_bytes_as_predicted(job, model, optimizer)))
    assert_same_training(result, rtol=1e-9, atol=1e-9)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("where", ["zero2-dp2", pytest.param("1f1b-pp2", marks=pytest.mark.full)])
def test_adafactor_alone(where):
    """On a Llama without biases: the GPT's attention-key biases have a true gradient of zero, so
    theirs is rounding noise, which Adafactor scales to a learning-rate-sized step either way. One
    batch three times: random tokens' loss rises on the next batch whatever the optimizer."""
    from examples.llama_tp import batches, make_model

    adafactor = functools.partial(torch.optim.Adafactor, lr=0.01)
    strategy, mesh = (data_parallel(*ZERO[2]), {"dp": 2}) if where == "zero2-dp2" else \
        (pipeline(4, order=one_f_one_b), {"pp": 2})
    result = train_against_one_device(strategy, mesh, adafactor, model=make_model(stages=2, vocab=96),
                                      batches=[batches(batch=4, vocab=96)[0]] * 3)
    assert_same_training(result, rtol=1e-9, atol=1e-9)


@pytest.mark.usefixtures("ray_cluster")
def test_a_users_per_tensor_optimizer_under_zero3():
    assert_same_training(train_against_one_device(data_parallel(*ZERO[3]), {"dp": 2}, NormScaled),
                         rtol=1e-9, atol=1e-9)


# ---- checkpoints

@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("load_strategy, load_mesh", [
    (None, None),
    pytest.param(data_parallel(*ZERO[3]), {"dp": 4}, marks=pytest.mark.full),
], ids=["one-device", "zero3-dp4"])
def test_a_muon_checkpoint_of_zero1_loads_elsewhere_and_goes_on_as_one_device(tmp_path, load_strategy, load_mesh):
    """Saved after 2 steps under ZeRO-1 over dp=2 (each matrix's momentum on its owner, each bias's
    count of updates on its), loaded where other devices own them, one more step: as 3 steps on
    one device."""
    from torch.distributed.checkpoint import FileSystemReader

    optimizer = piper.per_group({"**.weight@2d": MUON, "**.bias": NormScaled, "*": ADAMW})
    batches = gpt_batches()
    reference = gpt(2, torch.float64)
    ref_losses, ref_state = single_device(reference, batches, lambda _: optimizer.build(reference.named_parameters()))
    with piper.compile(gpt(2, torch.float64), batches[0], strategy=data_parallel(*ZERO[1]), mesh={"dp": 2},
                       optimizer=optimizer, progress=False) as job:
        losses = [job.step(*b) for b in batches[:2]]
        job.save(tmp_path / "step-2")
    keys = FileSystemReader(str(tmp_path / "step-2")).read_metadata().state_dict_metadata
    assert "optim.state.blocks.0.attn.c_attn.weight.momentum_buffer" in keys        # Muon's, torch's name
    assert "optim.state.blocks.0.ln_1.weight.exp_avg" in keys                       # AdamW's
    assert "optim.state.blocks.0.ln_1.bias.updates" in keys                         # a user's plain int
    other = gpt(2, torch.float64)
    with torch.no_grad():
        for p in other.parameters():          # other weights: everything must come from the checkpoint
            p.add_(0.5)
    with piper.compile(other, batches[0], strategy=load_strategy, mesh=load_mesh, optimizer=optimizer,
                       progress=False) as job:
        job.load(tmp_path / "step-2")
        losses.append(job.step(*batches[2]))
        state = job.state_dict()
    assert_same_training((losses, ref_losses, state, ref_state), rtol=1e-9, atol=1e-9)


@pytest.mark.full        # beside the GPT checkpoint test of the default suite
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("save, load", [
    (({"tp": 2}, None), ({}, None)),
    (({"dp": 4}, "zero1"), ({"dp": 2, "tp": 2}, "zero3")),
], ids=["tp2-to-one-device", "zero1-dp4-to-zero3-dp2-tp2"])
def test_a_muon_checkpoint_crosses_tensor_parallelism(tmp_path, save, load):
    """examples/llama_tp.py: Muon's whole momentum written once (tp index 0, or each matrix's owner),
    read whole where tp divides the matrix or another device owns it; the next step as one device's."""
    from examples.llama_tp import batches, make_model
    from tests.test_tensor_parallel import strategy

    def plan(mesh, dp):
        if not mesh:
            return None
        if "tp" in mesh:
            return strategy(sequence=True, dp=dp if "dp" in mesh else None)
        return data_parallel(*ZERO[int(dp[-1])])

    optimizer = piper.per_group(RECIPE)
    data = [batches(batch=4, vocab=96)[0]] * 3
    reference = make_model(stages=1, vocab=96)
    ref_losses, ref_state = single_device(reference, data, lambda _: optimizer.build(reference.named_parameters()))
    with piper.compile(make_model(stages=1, vocab=96), data[0], strategy=plan(*save), mesh=save[0] or None,
                       optimizer=optimizer, progress=False) as job:
        losses = [job.step(*b) for b in data[:2]]
        job.save(tmp_path / "step-2")
    with piper.compile(make_model(stages=1, vocab=96, seed=7), data[0], strategy=plan(*load), mesh=load[0] or None,
                       optimizer=optimizer, progress=False) as job:
        job.load(tmp_path / "step-2")
        losses.append(job.step(*data[2]))
        state = job.state_dict()
    assert_same_training((losses, ref_losses, state, ref_state), rtol=1e-9, atol=1e-9)
