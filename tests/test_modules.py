"""Capture of what real models do, and `piper.annotate_modules`, on small models of
our own (no Hugging Face, no Ray): no-grad blocks, buffers updated in forward,
empty constants made in forward, ModelOutput-like returns, keyword inputs,
the outside-region rule and `piper show --what ir`."""
import pytest
import torch

import piper
from piper.frontend.capture import capture, describe
from piper.cli import main


class Stages(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        h = self.a(x)
        scale = torch.arange(4, dtype=x.dtype, device=x.device) + 1     # outside: used first by `b`
        g = torch.tanh(self.b(h * scale))
        cache = torch.tensor([], dtype=x.dtype, device=x.device)        # a lifted empty constant
        g = torch.cat([cache, g.flatten()]).view_as(g)
        out = self.head(g).squeeze(-1)
        return {"loss": ((out - y) ** 2).mean(), "out": out}            # a ModelOutput-like return


XY = (torch.randn(8, 4), torch.randn(8))


def test_outside_rule_modeloutput_and_constants():
    model = piper.annotate_modules(Stages(), "PP", [["a"], ["b", "head"]])
    program = capture(model, XY)
    assert [r.label for r in program.regions] == ["PP=0", "PP=1"]
    joined = {op: why for op, why, _ in program.regions[1].joined}
    assert joined["aten.arange.default"] == "first user"
    assert joined["aten.empty.memory_format"] == "first user"            # the constant, made in place
    assert joined["aten.mean.default"] == "last producer"                 # the loss after the head
    assert not program.regions[0].joined
    text = describe(program)
    assert "# region 1 PP=1:" in text and "joined: first user" in text and "test_modules.py:" in text


def test_keyword_inputs_are_captured_in_their_order():
    class Keywords(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, labels=None, inputs=None):
            return ((self.lin(inputs).squeeze(-1) - labels) ** 2).mean()

    program = capture(Keywords(), (XY[0], XY[1]), names=("inputs", "labels"))
    assert program.input_names == ("inputs", "labels")
    assert [tuple(b.shape) for b in program.batch] == [(8, 4), (8,)]


def test_show_ir_says_where_each_op_went(tmp_path, capsys):
    (tmp_path / "m.py").write_text(
        "import torch, piper\n"
        "from tests.test_modules import Stages\n"
        "def model():\n"
        "    return piper.annotate_modules(Stages(), 'PP', [['a'], ['b', 'head']])\n"
        "def example_batch(n):\n"
        "    return torch.randn(n, 4), torch.randn(n)\n")
    (tmp_path / "s.pps").write_text("mesh pp=2\nuse one_f_one_b(microbatches=2) on pp\n")
    assert main(["show", str(tmp_path / "s.pps"), "--model", f"{tmp_path / 'm.py'}:model", "--what", "ir"]) == 0
    out = capsys.readouterr().out
    assert "# region 0 PP=0: 1 ops (0 joined by the outside-region rule)" in out
    assert any("aten.arange.default" in line and "joined: first user" in line for line in out.splitlines())


class NoGradIsland(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        with torch.no_grad():
            scale = self.a(x).abs().mean() + 1     # uses a parameter, but no gradient flows
        h = torch.tanh(self.a(x)) / scale
        return ((self.b(h).squeeze(-1) - y) ** 2).mean()


def test_no_grad_block_gives_the_same_gradients():
    model = NoGradIsland().double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    program = capture(model, (x, y))
    (region,) = program.regions
    params = dict(model.named_parameters())
    args = [params[i.ref] if i.kind == "param" else (x, y)[i.ref] for i in region.inputs]
    loss = region.graph(*args)[-1]
    grads = torch.autograd.grad(loss, list(params.values()))
    ref = torch.autograd.grad(model(x, y), list(params.values()))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


class CountingBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, y):
        self.calls += 1
        return ((self.lin(x).squeeze(-1) - y) ** 2).mean()


def test_buffer_updated_in_forward_names_the_module():
    with pytest.raises(piper.PiperError) as err:
        capture(CountingBuffer(), (torch.randn(4, 4), torch.randn(4)))
    assert err.value.code == "unsupported-model"
    assert "CountingBuffer `the model` updates `calls`" in str(err.value)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))

    class WithNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x, y):
            return ((self.body(x).sum(-1) - y) ** 2).mean()

    with pytest.raises(piper.PiperError) as err:
        capture(WithNorm(), (torch.randn(4, 4), torch.randn(4)))
    assert "`body.1` is a BatchNorm1d" in str(err.value) and "model.body.1.eval()" in err.value.diagnostics[0].hint
    capture(WithNorm().eval(), (torch.randn(4, 4), torch.randn(4)))       # the workaround captures


class TiedToy(torch.nn.Module):
    """The head reuses the embedding's weight: on the first and the last stage once cut."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, y):
        h = torch.tanh(self.mid(self.emb(x)))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@pytest.mark.usefixtures("ray_cluster")
def test_tied_weight_across_stages_with_a_split_backward():
    """ZB-H1 on 2 stages: the weight's gradient comes from the first stage's BW and the
    last stage's; each stage's copy steps on their sum (tests/test_hf.py: GPT-2, ZeRO-3)."""
    from piper.dsl import load_strategy
    from piper.testing import train_both

    torch.manual_seed(0)
    model = piper.annotate_modules(TiedToy().double(), "PP", [["emb"], ["mid", "head"]])
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 16, (8, 4), generator=g), torch.randint(0, 16, (8, 4), generator=g))
    plans = {}
    losses, ref_losses, state, ref_state = train_both(
        model, load_strategy("use zero_bubble(microbatches=4) on pp\n"), mesh={"pp": 2}, batches=[batch] * 3,
        job_hook=lambda job: plans.update({r: [a.key for a in job.compiled.plans[r]] for r in range(2)}))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-10, atol=1e-12)
    assert state.keys() == ref_state.keys() == {"emb.weight", "mid.weight", "mid.bias", "head.weight"}
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-10, atol=1e-12)
    assert losses[-1] < losses[0]
    assert plans[0][-3:] == ["0SEND_T0>1.0", "0RECV_T0<1.0", "0UPD"]
    assert plans[1][-3:] == ["1SEND_T0>0.0", "1RECV_T0<0.0", "1UPD"]


class MadeFromData(torch.nn.Module):
    """Gemma's way: a constant made in forward from Python data on the CPU (0-dimensional:
    a CPU tensor of more dimensions does not mix with the meta device capture runs on)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        normalizer = torch.tensor(4 ** 0.5, dtype=x.dtype)
        return ((self.lin(x * normalizer).squeeze(-1) - y) ** 2).mean()


def test_constant_made_from_data_travels_as_a_buffer():
    model = MadeFromData()
    program = capture(model, XY)
    (name, value), = program.constants.items()
    assert torch.equal(value, torch.tensor(2.0)) and name in program.buffers
    (region,) = program.regions
    tensors = {**dict(model.named_parameters()), **program.constants}
    args = [tensors[i.ref] if i.kind in ("param", "buffer") else XY[i.ref] for i in region.inputs]
    torch.testing.assert_close(region.graph(*args)[-1], model(*XY))
