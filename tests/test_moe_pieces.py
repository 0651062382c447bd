"""The MoE cut (`piper.ir.moe_cut`) and its runner (`piper.runtime.moe.pieces`) on one
process: the pieces and exchanges of a region, run one action at a time as a plan
would, give the region graph's own loss and gradients (float64, exact to 1e-12)."""
import copy
import threading
from types import SimpleNamespace

import pytest
import torch

from piper.frontend.capture import capture
from piper.ir.dag import Node
from piper.ir import region_cut
from piper.ir.moe_cut import COMBINE, DISPATCH


def cuttable(gm) -> bool:
    """Whether `gm` has MoE layers the cut takes (dispatch and combine alternating)."""
    return region_cut.cuttable(gm, experts=True) and "ALL_TO_ALL" in count_ops(gm)


def count_ops(gm) -> tuple:
    return region_cut.exchange_ops(gm, experts=True, tensor=False)


def count_exchanges(gm) -> int:
    return len(count_ops(gm)) if cuttable(gm) else 0


def cut(gm, size):
    return region_cut.cut(gm, size, experts=True, tensor=False)
from piper.runtime.moe import expert_groups as expert_groups
from piper.runtime.launch.packed_graphs import pack, unpack
from piper.runtime.moe.pieces import Pieces

from .test_experts import SkewedMoE, Tiny, moe_layer, tiny_batches


class _Done:
    def wait(self):
        return True


class OneMember:
    """An expert group of one: each all-to-all hands the rows back (what Gloo does on one rank)."""

    size, index = 1, 0

    def exchange_counts(self, counts):
        return counts.clone()

    def all_to_all_async(self, rows, out_splits, in_splits):
        assert out_splits.tolist() == in_splits.tolist() == [rows.shape[0]]
        return rows.clone(), _Done()


class FakeExecutor:
    """What `Pieces` asks of the executor, for one region on one device."""

    def __init__(self, model, region, recompute=False):
        spec = SimpleNamespace(inputs=region.inputs, outputs=region.outputs, loss=region.loss, units=(0,),
                               recompute=recompute)
        self.spec = SimpleNamespace(regions={0: spec}, grad_scale=1.0)
        self.params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
        self.units, self.experts, self.device = {0: SimpleNamespace(views=lambda: self.params)}, None, torch.device("cpu")
        self.clip = None
        self._evaluating = False          # a training step: pieces record autograd graphs
        self._param_storages, self._lock = set(), threading.Lock()
        self.saved_bytes, self.activations, self.activation_peak = {}, 0, 0
        self.values, self.losses, self.grads, self.timings, self.pending = {}, [], {}, {}, {}
        self.delivered = []

    def _args(self, region, mb):
        args, leaves = [], {}
        for i in region.inputs:
            if i.kind == "value":          # a value from another region: a leaf, as the executor makes it
                leaves[i.ref] = self.value.detach().clone().requires_grad_()
                args.append(leaves[i.ref])
            else:
                args.append(self.params[i.ref] if i.kind == "param" else self.batch[i.ref])
        return args, leaves

    def _release(self, action):
        pass

    def _deliver_input_grads(self, node, leaves, grads):
        self.delivered.append(node.key)
        self.input_grads = grads

    def _weights(self, region):
        return [self.params[i.ref] for i in region.inputs if i.kind == "param"]

    def run(self, node, pieces, inputs_only=False):
        action = SimpleNamespace(node=node, key=node.key)
        if node.op == "ALL_TO_ALL":
            pieces.exchange(self, action)
            works, then = self.pending.pop(node.key)
            [w.wait() for w in works]
            then()
        elif node.op == "F":
            pieces.forward(self, action)
        elif node.op == "BW":
            pieces.backward_weights(self, action)
        else:
            pieces.backward(self, action, inputs_only=inputs_only)


_captured = {}


def _region(layer, regions=1, key=None):
    """(the model, its last region with the graph on the CPU); `key` reuses a capture (export takes seconds)."""
    if key is None or key not in _captured:
        model = Tiny(regions, layer).double()
        program = capture(copy.deepcopy(model), tiny_batches(1)[0])
        region = program.regions[regions - 1]
        region.graph = unpack(pack(region.graph), torch.device("cpu"))     # off the meta device, as workers do
        _captured[key] = model, region
    return _captured[key]


def _reference(model, region, batch, value=None):
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    if value is not None:
        params["<value>"] = value = value.detach().clone().requires_grad_()
    args = [params[i.ref] if i.kind == "param" else value if i.kind == "value" else batch[i.ref]
            for i in region.inputs]
    loss = region.graph(*args)[-1]
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in params.items()}


@pytest.mark.parametrize("layer,regions", [(moe_layer(), 1), (lambda: SkewedMoE(8, 8, 4, 2), 1), (moe_layer(), 2)],
                         ids=["moe", "own-layer", "value-input"])
@pytest.mark.parametrize("backward", ["B", "BI+BW"])
@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute"])
def test_pieces_run_as_actions_equal_the_region_graph(layer, regions, backward, recompute):
    """Forward pieces and exchanges, then the backward's (whole, or for inputs then weights); with a
    value from an earlier region as input (its gradient is handed on) when `regions` is 2; with
    `recompute`, each piece keeps its inputs and runs again in its backward."""
    model, region = _region(layer, regions, key=(id(layer), regions))
    batch = list(tiny_batches(1)[0])
    value = torch.randn(8, 4, 8, dtype=torch.float64) if regions > 1 else None
    ref_loss, ref_grads = _reference(model, region, batch, value)
    assert cuttable(region.graph) and count_exchanges(region.graph) == 2
    the_cut = cut(region.graph, 1)
    assert [e.kind for e in the_cut.exchanges] == [DISPATCH, COMBINE] and len(the_cut.pieces) == 3
    ex, pieces = FakeExecutor(model, region, recompute), Pieces({0: the_cut})
    ex.batch, ex.value = batch, value
    lg = expert_groups.lane_group([OneMember()], 0)
    with lg:
        # the plan's forward, then its backward, as `piper.compiler.cut_passes.add_exchanges` lays them out
        for node in (Node("F", 0, 0), Node("ALL_TO_ALL", 0, 0, "F", 0), Node("F", 0, 0, value=1),
                     Node("ALL_TO_ALL", 0, 0, "F", 1), Node("F", 0, 0, value=2)):
            ex.run(node, pieces)
        # recompute: every piece kept only its inputs, and runs again in its backward
        assert len(pieces.passes[(0, 0)].kept) == (3 if recompute else 0)
        op = "B" if backward == "B" else "BI"
        for node in (Node(op, 0, 0, value=2), Node("ALL_TO_ALL", 0, 0, op, 1), Node(op, 0, 0, value=1),
                     Node("ALL_TO_ALL", 0, 0, op, 0), Node(op, 0, 0)):
            ex.run(node, pieces, inputs_only=op == "BI")
        if op == "BI":
            ex.run(Node("BW", 0, 0), pieces)
    torch.testing.assert_close(ex.losses[0], ref_loss, rtol=0, atol=1e-12)
    for name, g in ref_grads.items():
        got = list(ex.input_grads.values())[0] if name == "<value>" else ex.params[name].grad
        if g is None and got is None:      # a parameter of another region
            continue
        torch.testing.assert_close(got, g, rtol=0, atol=1e-12, msg=name)
    assert ex.delivered == [f"0{op}0"] and not pieces.passes and ex.activations == 0
    assert {"0ALL_TO_ALL_F0.0", "0ALL_TO_ALL_F0.1", f"0ALL_TO_ALL_{op}0.0"} <= set(ex.timings)


def test_two_layers_make_five_pieces_and_a_region_without_layers_is_not_cut():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = moe_layer()(), moe_layer()()

        def forward(self, x):
            return self.b(x + self.a(x)).sum()

    program = capture(Two().double(), (torch.randn(4, 8, dtype=torch.float64),))
    the_cut = cut(program.regions[0].graph, 2)
    assert len(the_cut.pieces) == 5 and [e.kind for e in the_cut.exchanges] == [DISPATCH, COMBINE] * 2
    # every piece reads only the region's inputs and what came before it
    for p, sources in enumerate(the_cut.inputs):
        assert all(s.kind == "arg" or (s.kind == "piece" and s.index < p) or (s.kind == "exchange" and s.index < p)
                   for s in sources)
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.lin(x).mean()

    plain = capture(Plain().double(), (torch.randn(4, 8, dtype=torch.float64),))
    assert not cuttable(plain.regions[0].graph) and count_exchanges(plain.regions[0].graph) == 0
