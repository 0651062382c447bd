"""BI then BW gives the gradients of one full backward, without a second pass when possible."""
import gc
import weakref

import torch

from piper.compiler.saved import SavedBytes
from piper.runtime.autograd.split_backward import backward_inputs, backward_weights, can_split


def _region(x, w1, w2):
    return torch.tanh(x @ w1) @ w2 + x.sum(-1, keepdim=True)


def test_split_equals_full_backward():
    torch.manual_seed(0)
    x0, w1, w2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64), \
        torch.randn(5, 1, dtype=torch.float64)
    g = torch.randn(4, 1, dtype=torch.float64)

    x, a, b = x0.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
    _region(x, a, b).backward(g)
    expected = (x.grad, a.grad, b.grad)

    x, a, b = x0.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
    out = _region(x, a, b)
    assert can_split([out], [x], [a, b])
    dinputs, state = backward_inputs([out], [g], [x], [a, b], split=True)
    assert state[0] == "groups"           # torch's method: weights resume from saved intermediates
    assert a.grad is None and b.grad is None
    backward_weights([a, b], state)
    for got, want in zip((dinputs[0], a.grad, b.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_region_without_differentiable_inputs_falls_back():
    w = torch.randn(3, 2, requires_grad=True)
    x = torch.randn(4, 3)
    out = x @ w
    assert not can_split([out], [], [w])
    dinputs, state = backward_inputs([out], [torch.ones(4, 2)], [], [w], split=False)
    assert dinputs == [] and state[0] == "graph"
    backward_weights([w], state)
    torch.testing.assert_close(w.grad, x.t() @ torch.ones(4, 2))


def test_counted_forward_frees_its_activations_after_a_split_backward():
    """The runtime counts saved bytes with a pack hook; BI + BW must still free every saved
    tensor. tanh saves its own output: kept as is, that output held its node alive through
    C++ (a cycle no collector sees) and every microbatch of a split backward leaked."""
    x = torch.randn(4, 3, dtype=torch.float64).requires_grad_()
    a = torch.randn(3, 5, dtype=torch.float64).requires_grad_()
    b = torch.randn(5, 1, dtype=torch.float64).requires_grad_()
    with SavedBytes(exclude={w.untyped_storage()._cdata for w in (a, b)}) as saved:
        h = torch.tanh(x @ a)
        out = h @ b + x.sum(-1, keepdim=True)
    alive = weakref.ref(h)
    del h
    # x (saved by x @ a) and tanh's output h (saved by tanh and by h @ b: one storage, counted once)
    assert saved.size == (4 * 3 + 4 * 5) * 8
    assert can_split([out], [x], [a, b])
    dinputs, state = backward_inputs([out], [torch.ones(4, 1, dtype=torch.float64)], [x], [a, b], split=True)
    backward_weights([a, b], state)
    del state, out, dinputs
    gc.collect()
    assert alive() is None
