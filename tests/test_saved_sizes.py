"""A region's forward counts what it saves for backward once per input signature (`saved_sizes`):
the count equals the hook's every time, and a graph whose shapes depend on data is counted every time."""
import pytest
import torch
import torch.fx as fx

from examples import llama_tp
from piper.compiler.saved import SavedBytes
from piper.frontend.capture import capture
from piper.runtime.execution import saved_sizes
from piper.runtime.execution.saved_sizes import SavedSizes, shapes_fixed


class _Region:
    def __init__(self, index, graph):
        self.index, self.graph = index, graph


def _aten_graph(nonzero: bool) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.tanh.default, (x,))
    if nonzero:
        y = g.call_function(torch.ops.aten.nonzero.default, (y,))
    g.output((y,))
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.fixture
def hooks(monkeypatch) -> list:
    """Every counting hook `saved_sizes` installs from now on."""
    made = []

    class Counting(SavedBytes):
        def __enter__(self):
            made.append(self)
            return super().__enter__()
    monkeypatch.setattr(saved_sizes, "SavedBytes", Counting)
    return made


def test_which_graphs_have_fixed_shapes():
    program = capture(llama_tp.make_model(torch.float32, stages=2), llama_tp.batches(count=1)[0])
    assert all(shapes_fixed(r.graph) for r in program.regions)
    assert shapes_fixed(_aten_graph(nonzero=False)) and not shapes_fixed(_aten_graph(nonzero=True))


def test_the_count_is_the_hooks_and_is_taken_once_per_signature(hooks):
    program = capture(llama_tp.make_model(torch.float32, stages=1), llama_tp.batches(count=1)[0])
    region = program.regions[0]
    params = dict(llama_tp.make_model(torch.float32, stages=1).named_parameters())
    sizes = SavedSizes()

    def run(batch):
        args = [params[i.ref] if i.kind == "param" else batch[i.ref] for i in region.inputs]
        with SavedBytes() as truth:        # the hook's own count of the same forward
            region.graph(*args)
        outs, size = sizes.run(_Region(0, region.graph), args, frozenset())
        return size, truth.size
    kinds = {i.kind for i in region.inputs}
    assert kinds <= {"param", "batch"}, kinds
    first = run(llama_tp.batches(count=1, seed=1)[0])
    again = run(llama_tp.batches(count=1, seed=2)[0])
    assert first[0] == first[1] > 0 and again == first and len(hooks) == 1
    # Another signature is counted again: an input that needs no gradient saves nothing for it.
    tanh = _Region(1, _aten_graph(nonzero=False))
    assert sizes.run(tanh, [torch.randn(4)], frozenset())[1] == 0
    assert sizes.run(tanh, [torch.randn(4, requires_grad=True)], frozenset())[1] == 4 * 4     # tanh's output
    assert sizes.run(tanh, [torch.randn(4, requires_grad=True)], frozenset())[1] == 4 * 4
    assert len(hooks) == 3


def test_a_graph_with_data_dependent_shapes_is_counted_every_time(hooks):
    sizes, region = SavedSizes(), _Region(0, _aten_graph(nonzero=True))
    for _ in range(3):
        sizes.run(region, [torch.randn(4, requires_grad=True)], frozenset())
    assert len(hooks) == 3
