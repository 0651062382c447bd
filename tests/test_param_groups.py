"""Parameter groups and learning-rate schedules: `optimizer=piper.param_groups(...)` (or a function
of the named parameters) and `lr_schedule=` train exactly as `torch.optim.AdamW(groups)` with a
`LambdaLR` on one device, whatever the strategy (float64, 5 steps), and bad groups are diagnostics."""
import copy
import math

import pytest
import torch

import piper
from piper.dsl.script import load_strategy
from piper.frontend.param_groups import resolve
from piper.compiler.flat_layout import layout_unit
from piper.runtime.state.optimizers import build, set_lr_scale
from tests.helpers import assert_same
from tests.test_train import data_parallel, gpt, gpt_batches

LR, DECAY = 3e-3, 0.1
SCHEDULE = piper.warmup_cosine(2, 5, min_ratio=0.1)      # 2 warmup steps, then a cosine over 3


def decay_on_matrices(named):
    """Weight decay on matrices only, torch's way (nanoGPT's `configure_optimizers`)."""
    named = list(named)
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": DECAY},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def one_device(model, batches, schedule=SCHEDULE):
    """torch's own recipe: AdamW over the groups and a LambdaLR, one device."""
    opt = torch.optim.AdamW(decay_on_matrices(model.named_parameters()), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(model, strategy, mesh, batches, optimizer):
    with piper.compile(copy.deepcopy(model), batches[0], strategy=strategy, mesh=mesh, optimizer=optimizer,
                       lr_schedule=SCHEDULE) as job:
        losses = [job.step(*b) for b in batches]
        return losses, job.state_dict()


# -- without workers ---------------------------------------------------------------------------

def test_warmup_cosine_is_the_usual_curve():
    s = piper.warmup_cosine(2, 10, min_ratio=0.1)
    assert [s(0), s(1)] == [1 / 3, 2 / 3]
    assert s(2) == 1.0 and math.isclose(s(6), 0.55) and math.isclose(s(10), 0.1) and s(50) == 0.1
    with pytest.raises(piper.PiperError) as info:
        piper.warmup_cosine(10, 5)
    assert info.value.code == "bad-lr-schedule"


def test_param_groups_by_pattern():
    model = gpt(2)
    groups = piper.param_groups(torch.optim.AdamW, lr=LR, weight_decay=DECAY,
                                no_decay=("**.bias", "**.ln_*.weight", "wte.weight"))
    grouped = resolve(groups, model)
    assert grouped.cls is torch.optim.AdamW and grouped.defaults == {"lr": LR, "weight_decay": DECAY}
    assert grouped.options == ({"weight_decay": DECAY}, {"weight_decay": 0.0})
    exempt = {n for n, g in grouped.of.items() if g == 1}
    # `**.` also matches no part: ln_f.weight (top level) is a norm like the blocks' ln_1/ln_2.
    assert exempt == {n for n, p in model.named_parameters()
                      if n.endswith(".bias") or ".ln_" in "." + n and n.endswith(".weight") or n == "wte.weight"}
    assert "ln_f.weight" in exempt and "wpe.weight" not in exempt


def test_a_no_decay_pattern_matching_nothing_warns_naming_it():
    with pytest.warns(piper.PiperWarning, match="`norm.gamma`") as caught:
        resolve(piper.param_groups(torch.optim.AdamW, lr=LR, no_decay=("**.bias", "norm.gamma")), gpt(2))
    assert caught[0].message.code == "no-decay-unmatched"


@pytest.mark.parametrize("groups,code", [
    (lambda named: [{"params": [p for _, p in named]}, {"params": [p for n, p in named if n == "wte.weight"]}],
     "param-in-two-groups"),
    (lambda named: [{"params": [p for n, p in named if n != "wpe.weight"]}], "param-not-in-group"),
    (lambda named: [{"params": [torch.zeros(3)]}, {"params": [p for _, p in named]}], "bad-param-groups"),
    (lambda named: [{"lr": 1.0}], "bad-param-groups"),
])
def test_bad_groups_are_diagnostics_at_compile(groups, code):
    with pytest.raises(piper.PiperError) as info:
        piper.compile(gpt(2), gpt_batches(1)[0], optimizer=groups)
    assert info.value.code == code


def test_a_groups_function_may_return_a_torch_optimizer():
    grouped = resolve(lambda named: torch.optim.SGD(decay_on_matrices(named), lr=0.5, momentum=0.9), gpt(2))
    assert grouped.cls is torch.optim.SGD and grouped.defaults["momentum"] == 0.9
    assert grouped.options == ({"weight_decay": DECAY}, {"weight_decay": 0.0})


def test_a_flat_optimizer_is_not_taken_for_groups():
    assert resolve(lambda params: torch.optim.SGD(params, lr=0.1), gpt(2)) is None


def test_groups_are_packed_apart_so_a_shard_holds_one_group():
    model = gpt(2)
    grouped = resolve(decay_on_matrices, model)
    specs = {n: p for n, p in model.named_parameters()}
    layout = layout_unit(0, list(specs), specs, (0, 1, 2), param_groups=grouped.of)
    assert sorted(b.param_group for b in layout.buckets) == [0, 1]
    for b in layout.buckets:
        assert {grouped.of[e.name] for e in b.entries} == {b.param_group}
        assert b.padded % 3 == 0
    shards = [torch.zeros(b.shard_size, requires_grad=True) for b in layout.buckets]
    opt = build(grouped, shards, [b.param_group for b in layout.buckets])
    assert [g["weight_decay"] for g in opt.param_groups] == [DECAY, 0.0][:len(opt.param_groups)]
    set_lr_scale([opt], 0.5)
    assert grouped.defaults == {"lr": 1e-3}      # a bare list of groups: AdamW at lr 1e-3, as without groups
    assert all(g["lr"] == 1e-3 * 0.5 and g["initial_lr"] == 1e-3 for g in opt.param_groups)


# -- against one device ------------------------------------------------------------------------

ZERO3 = ("optimizer", "grads", "params")
STRATEGIES = {
    "dp": (lambda: data_parallel(), {"dp": 2}, 2),
    "zero3x1f1b": (lambda: load_strategy("use one_f_one_b(microbatches=4) on pp\nuse zero3() on dp\n"),
                   {"dp": 2, "pp": 2}, 2),
    "dualpipev": (lambda: load_strategy("use dualpipev(microbatches=4) on pp\n"), {"pp": 2}, 4),
}


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_groups_and_schedule_equal_torch_on_one_device(name):
    strategy, mesh, regions = STRATEGIES[name]
    model = gpt(regions, torch.float64)
    batches = gpt_batches(5)
    optimizer = piper.param_groups(torch.optim.AdamW, lr=LR, weight_decay=DECAY, no_decay=("**.bias", "**.ln_*.weight"))
    if name == "dp":     # the same groups as a function of the named parameters
        optimizer = lambda named: torch.optim.AdamW(decay_on_matrices(named), lr=LR)  # noqa: E731
    losses, state = train(model, strategy(), mesh, batches, optimizer)
    ref_losses, ref_state = one_device(copy.deepcopy(model), batches)
    assert_same((losses, ref_losses, state, ref_state), tol=1e-9)
    # The recipe mattered: without the decay split or the schedule the parameters differ.
    flat_losses, flat_state = one_device(copy.deepcopy(model), batches, schedule=lambda step: 1.0)
    assert max((state[k] - flat_state[k]).abs().max().item() for k in state) > 1e-6


@pytest.mark.usefixtures("ray_cluster")
def test_a_resumed_run_continues_the_schedule_under_another_strategy(tmp_path):
    """Save after step 3 under dp=2 x ZeRO-3, load into a 1F1B pipeline: steps 4-6 are the
    uninterrupted recipe's (the step, hence the schedule's position, is in the checkpoint)."""
    model = gpt(2, torch.float64)
    batches = gpt_batches(6)
    optimizer = piper.param_groups(torch.optim.AdamW, lr=LR, weight_decay=DECAY, no_decay=("**.bias", "**.ln_*.weight"))
    with piper.compile(copy.deepcopy(model), batches[0], strategy=data_parallel(*ZERO3), mesh={"dp": 2},
                       optimizer=optimizer, lr_schedule=SCHEDULE) as job:
        first = [job.step(*b) for b in batches[:3]]
        job.save(tmp_path / "step-3")
    pipeline = load_strategy("use one_f_one_b(microbatches=4) on pp\n")
    with piper.compile(copy.deepcopy(model), batches[0], strategy=pipeline, mesh={"pp": 2}, optimizer=optimizer,
                       lr_schedule=SCHEDULE) as job:
        job.load(tmp_path / "step-3")
        rest = [job.step(*b) for b in batches[3:]]
        state = job.state_dict()
    ref_losses, ref_state = one_device(copy.deepcopy(model), batches)
    assert_same((first + rest, ref_losses, state, ref_state), tol=1e-9)



@pytest.mark.parametrize("suffix", ["@" + "9" * 5000 + "d", "@²d", "@100d", "@d", "@2x"])
def test_a_per_group_dimension_suffix_that_is_no_small_number_is_a_diagnostic(suffix):
    from piper.frontend.param_groups import _split_dims

    with pytest.raises(piper.PiperError) as err:
        _split_dims("**.weight" + suffix)
    assert err.value.code == "bad-param-groups" and len(str(err.value)) < 1000
