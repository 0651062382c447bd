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


def test_only_a_tensor_nothing_else_holds_is_emptied():
    """`let_go_unread` empties a tensor whose data only the tensor itself holds, and none that a
    detached alias, a graph that saved it (as an input or as its own output) or a view shares."""
    x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    alone, aliased, read, exp, base = x @ x, x @ x, x @ x, (x @ x).exp(), x @ x
    alias, reader, view = aliased.detach(), read.sin(), base[1:]
    seeded.let_go_unread([alone, aliased, read, exp, view])
    assert alone.untyped_storage().nbytes() == 0
    assert all(t.untyped_storage().nbytes() == 64 * 64 * 8 for t in (aliased, read, exp, base))
    assert alias.untyped_storage().nbytes() and reader.requires_grad and view.untyped_storage().nbytes()


def test_a_backward_from_an_emptied_output_gives_the_same_gradients_and_peaks_lower():
    """Two pieces as a cut region runs them: `y` feeds the second piece through a detached leaf.
    Once the second piece's backward has run, `y`'s data is held by `y` alone; emptied, the first
    piece's backward (the pass's peak: `w`'s gradient is summed into) gives the same gradients and
    peaks `y`'s bytes lower."""
    def run(empty: bool):
        torch.manual_seed(0)
        x, w = _leaves()

        def pieces():
            y = x @ w                                 # mm saves x and w, not y
            leaf = y.detach().requires_grad_()
            (leaf @ w).sum().backward()               # its graph (and the leaf its AccumulateGrad holds) gone
            g, leaf = [leaf.grad], None
            if empty:
                seeded.let_go_unread([y])
            seeded.backward([y], g)
        return allocation_rise(pieces), x.grad, w.grad

    kept, emptied = run(False), run(True)
    torch.testing.assert_close(emptied[1:], kept[1:], rtol=0, atol=0)
    assert kept[0] - emptied[0] >= 0.9 * 256 * 1024 * 8
