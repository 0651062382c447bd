"""ZeRO-2/3 gradient shards add up over reduce-scatters, issued one after another or overlapping.

Two members of a data-parallel group live in this process; a stand-in for
`collectives.reduce_scatter_into` does the reduction when the work is waited on,
the way an asynchronous collective finishes later.
"""
import functools

import torch

from piper.frontend.capture import TensorSpec
from piper.runtime.communication import collectives
from piper.runtime.state.unit import Unit
from piper.compiler.flat_layout import layout_unit


class _Group:
    """A reduce-scatter over members whose calls arrive one at a time, summed when waited on."""

    def __init__(self, size):
        self.size = size
        self.calls: list[tuple] = []      # (out, full), in issue order

    def reduce_scatter_into(self, out, full, group):
        self.calls.append((out, full))
        n = len(self.calls) - 1
        return _Work(self, n - n % self.size)

    def finish(self, first):
        members = self.calls[first:first + self.size]
        total = sum(full for _, full in members)
        shard = total.numel() // self.size
        for index, (out, _) in enumerate(members):
            out.copy_(total[index * shard:(index + 1) * shard])


class _Work:
    def __init__(self, group, first):
        self.group, self.first, self.done = group, first, False

    def wait(self):
        if not self.done:
            self.group.finish(self.first)
            self.done = True


def _members(monkeypatch):
    group = _Group(2)
    monkeypatch.setattr(collectives, "reduce_scatter_into", group.reduce_scatter_into)
    layout = layout_unit(0, ["w"], {"w": TensorSpec((5,), torch.float64)}, (0, 1))
    init = [torch.zeros(layout.buckets[0].padded, dtype=torch.float64)]
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    return [Unit(layout, rank, 2, init, sgd, torch.device("cpu")) for rank in (0, 1)]


def _backward(units, grads):
    for unit, g in zip(units, grads):
        unit.attach_grads()
        unit.leaves["w"].grad.add_(g)


def _reduce(units):
    """Every member issues its reduce-scatter; returns what finishes them (wait, then done)."""
    issued = [unit.reduce(None) for unit in units]

    def finish():
        for works, done in issued:
            for w in works:
                w.wait()
            done()
    return finish


def _expected(runs):
    total = sum(g for grads in runs for g in grads)
    padded = torch.cat([total, total.new_zeros(1)])      # 5 weights padded to 6 for 2 members
    return padded[:3], padded[3:]


def test_reduce_scatters_one_after_another_sum_into_the_shard(monkeypatch):
    units = _members(monkeypatch)
    runs = [[torch.randn(5, dtype=torch.float64) for _ in units] for _ in range(3)]
    for grads in runs:
        _backward(units, grads)
        _reduce(units)()
        assert all(not u.in_flight for u in units)
    for unit, want in zip(units, _expected(runs)):
        torch.testing.assert_close(unit.grad_shard[0], want, rtol=0, atol=1e-12)


def test_overlapping_reduce_scatters_of_one_unit_still_sum(monkeypatch):
    units = _members(monkeypatch)
    runs = [[torch.randn(5, dtype=torch.float64) for _ in units] for _ in range(3)]
    _backward(units, runs[0])
    _reduce(units)()                      # the shard exists: later ones could land in it
    _backward(units, runs[1])
    first = _reduce(units)
    _backward(units, runs[2])             # a new buffer while the first is in flight
    second = _reduce(units)
    assert all(len(u.in_flight) == 2 for u in units)
    first()
    second()
    for unit, want in zip(units, _expected(runs)):
        torch.testing.assert_close(unit.grad_shard[0], want, rtol=0, atol=1e-12)
