"""`piper.runtime.autograd.seeded.backward`: the same gradients as `torch.autograd.backward`, and
each seed gradient let go once the node reading it has run, not at the end of the pass."""
import torch

from piper.runtime.autograd import seeded
from tests.helpers import allocation_rise


def _leaves():
    return (torch.randn(256, 1024, dtype=torch.float64, requires_grad=True),
            torch.randn(1024, 1024, dtype=torch.float64, requires_grad=True))


def _outputs(x, w):
    return [torch.tanh(x @ w), x.sin()]     # two outputs, both seeded; tanh's backward reads the first


def test_the_same_gradients_as_torch_autograd_backward():
    torch.manual_seed(0)
    x, w = _leaves()
    outs = _outputs(x, w)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, [g.clone() for g in grads])
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    seeded.backward(_outputs(x, w), grads)
    torch.testing.assert_close((x.grad, w.grad), want, rtol=0, atol=0)
    assert grads == []                      # the caller's list emptied: its references handed over


def test_a_seed_gradient_is_let_go_once_read():
    """With torch.autograd.backward the caller's seed stays alive through the matmul's backward; here
    it goes when tanh's backward has read it: the pass peaks one seed's bytes lower."""
    def rise(run) -> int:
        x, w = _leaves()
        y = torch.tanh(x @ w)
        return allocation_rise(lambda: run([y], [torch.randn_like(y)]))

    def held(tensors, grads):
        torch.autograd.backward(tensors, grads)

    seed = 256 * 1024 * 8
    assert rise(held) - rise(seeded.backward) >= 0.9 * seed
