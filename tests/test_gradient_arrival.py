"""Gradient buffers appear as the gradients arrive: a bucket's flat buffer is attached by a hook on
its parameters when autograd hands one of them its first gradient of the step, and a unit that no
data-parallel collective reads keeps each parameter in a bucket of its own."""
import functools

import torch

from piper.frontend.capture import TensorSpec
from piper.compiler.flat_layout import layout_unit
from piper.runtime.state.unit import Unit

SPECS = {"a": TensorSpec((3, 2), torch.float64), "b": TensorSpec((2,), torch.float64),
         "c": TensorSpec((4,), torch.float64)}


def _unit(group=(0,), apart=True, zero=0):
    layout = layout_unit(0, list(SPECS), SPECS, group, apart=apart)
    init = [torch.arange(b.padded, dtype=torch.float64) / 10 for b in layout.buckets]
    return Unit(layout, 0, zero, init, functools.partial(torch.optim.SGD, lr=0.1), torch.device("cpu"))


def test_apart_gives_each_parameter_a_bucket_and_packed_one_per_dtype():
    assert [[e.name for e in b.entries] for b in layout_unit(0, list(SPECS), SPECS, (0,), apart=True).buckets] \
        == [["a"], ["b"], ["c"]]
    assert [[e.name for e in b.entries] for b in layout_unit(0, list(SPECS), SPECS, (0, 1)).buckets] \
        == [["a", "b", "c"]]


def test_a_tied_parameter_keeps_its_own_bucket_under_apart():
    layout = layout_unit(0, list(SPECS), SPECS, (0,), tied={"b": 7}, apart=True)
    assert [(b.tied, [e.name for e in b.entries]) for b in layout.buckets] == [(None, ["a"]), (7, ["b"]), (None, ["c"])]


def test_a_buffer_appears_only_when_its_parameters_gradient_arrives():
    unit = _unit()
    a, b, c = (unit.leaves[n] for n in "abc")
    assert unit.flat_grad == [None, None, None] and unit.memory()["grads"] == 0
    (a.sum() * 2).backward()                     # only `a` gets a gradient
    assert unit.flat_grad[0] is not None and unit.flat_grad[1] is None and unit.flat_grad[2] is None
    assert a.grad.data_ptr() == unit.flat_grad[0].data_ptr()       # accumulated into the buffer itself
    assert torch.equal(a.grad, torch.full((3, 2), 2.0, dtype=torch.float64))
    assert unit.held == unit.memory()["params"] + 6 * 8             # counted as it appeared
    ((b * c[:2]).sum() + a.sum()).backward()     # `b`, `c` arrive; `a` accumulates into its buffer
    assert all(g is not None for g in unit.flat_grad)
    assert torch.equal(a.grad, torch.full((3, 2), 3.0, dtype=torch.float64))
    assert torch.equal(unit.flat_grad[2], torch.cat([b.detach(), b.new_zeros(2)]))
    unit.step()                                   # and let go after the update, to appear again
    assert unit.flat_grad == [None, None, None] and unit.memory()["grads"] == 0
    assert a.grad is None
    b.sum().backward()
    assert unit.flat_grad[0] is None and unit.flat_grad[1] is not None


def test_an_unreached_parameter_is_not_stepped_as_torch_skips_a_none_grad():
    unit = _unit()
    before = unit.leaves["c"].detach().clone()
    (unit.leaves["a"].sum() + unit.leaves["b"].sum()).backward()
    unit.step()
    assert torch.equal(unit.leaves["c"].detach(), before)
    assert not torch.equal(unit.leaves["a"].detach(), torch.arange(6, dtype=torch.float64).view(3, 2) / 10)


def test_a_packed_bucket_appears_whole_at_its_first_gradient():
    unit = _unit(group=(0, 1), apart=False)
    (unit.leaves["b"].sum()).backward()
    assert unit.flat_grad[0] is not None and unit.flat_grad[0].numel() == 12
    assert torch.equal(unit.leaves["a"].grad, torch.zeros(3, 2, dtype=torch.float64))


def test_the_split_backward_of_torch_pipelining_accumulates_into_the_buffers():
    from piper.runtime.autograd.split_backward import backward_inputs, backward_weights, can_split

    unit = _unit()
    a, b = unit.leaves["a"], unit.leaves["b"]
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    y = ((x @ a).tanh() * b).sum()
    weights = [a, b]
    split = can_split([y], [x], weights)
    assert split
    _, state = backward_inputs([y], [None], [x], weights, split=split)
    assert unit.flat_grad == [None, None, None]      # BI computes no weight gradient
    backward_weights(weights, state)
    assert unit.flat_grad[0] is not None and unit.flat_grad[1] is not None and unit.flat_grad[2] is None
    assert a.grad.data_ptr() == unit.flat_grad[0].data_ptr()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ga, gb = torch.autograd.grad(((x.detach() @ a2).tanh() * b2).sum(), [a2, b2])
    assert torch.allclose(a.grad, ga) and torch.allclose(b.grad, gb)
