"""Bad inputs to `piper.compile`, `job.step` and `--model`: caught in the driver, said plainly."""
import functools
import textwrap

import pytest
import torch

import piper
from piper.frontend.batch_check import check_step_inputs, input_names
from piper.frontend.capture import TensorSpec, capture
from piper.frontend.models import load_model
from piper.frontend.optim_check import check_optimizer


class Net(torch.nn.Module):
    def __init__(self, norm=None):
        super().__init__()
        self.a = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.norm = norm
        self.b = torch.nn.Linear(4, 1, dtype=torch.float64)

    def forward(self, x, y):
        with piper.annotate("PP"):
            h = self.a(x)
            if self.norm is not None:
                h = self.norm(h)
        with piper.annotate("PP"):
            return ((self.b(h).squeeze(-1) - y) ** 2).mean()


XY = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, dtype=torch.float64))


# ---- optimizers, at compile

class Elementwise(torch.optim.SGD):
    piper_elementwise = True


class Unsaid(torch.optim.Optimizer):      # neither elementwise nor per-tensor, as far as Piper knows
    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})


@pytest.mark.parametrize("optimizer, says", [
    ("adam", "is a name"),
    (torch.optim.LBFGS, "LBFGS needs a closure"),
    (functools.partial(torch.optim.LBFGS, lr=1), "LBFGS needs a closure"),
    (Unsaid, "Unsaid does not say how it updates a parameter"),
    (lambda params: Unsaid(params, lr=1e-2), "Unsaid does not say how it updates"),
    (lambda params: 3, "returned int"),
    (lambda: None, "raised TypeError"),
    (42, "not callable"),
])
def test_optimizers_piper_cannot_run_exactly_are_refused(optimizer, says):
    with pytest.raises(piper.PiperError) as err:
        check_optimizer(optimizer)
    assert err.value.code == "bad-optimizer" and says in str(err.value)


def test_an_optimizer_built_on_parameters_is_refused_with_the_partial_to_write():
    with pytest.raises(piper.PiperError, match=r"functools.partial\(torch.optim.AdamW"):
        check_optimizer(torch.optim.AdamW(Net().parameters()))


@pytest.mark.parametrize("optimizer", [None, torch.optim.SGD, functools.partial(torch.optim.AdamW, lr=1e-3),
                                       lambda ps: torch.optim.RMSprop(ps, lr=0.1), Elementwise])
def test_elementwise_optimizers_pass(optimizer):
    check_optimizer(optimizer)


def test_compile_refuses_a_string_optimizer_before_starting_anything():
    with pytest.raises(piper.PiperError) as err:
        piper.compile(Net(), XY, optimizer="adam")
    assert err.value.code == "bad-optimizer"


# ---- layers and factories

def test_batchnorm_is_named_with_the_workaround():
    with pytest.raises(piper.PiperError) as err:
        capture(Net(torch.nn.BatchNorm1d(4, dtype=torch.float64)), XY)
    d = err.value.diagnostics[0]
    assert d.code == "unsupported-model" and "`norm` is a BatchNorm1d in training mode" in d.message
    assert "GroupNorm" in d.hint and "model.norm.eval()" in d.hint


def test_frozen_batchnorm_captures():
    net = Net(torch.nn.BatchNorm1d(4, dtype=torch.float64))
    net.norm.eval()
    assert len(capture(net, XY).regions) == 2


def test_a_factory_that_needs_arguments_is_the_users_mistake(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent("""
        import torch
        class Big(torch.nn.Module):
            def __init__(self, cfg, depth):
                super().__init__()
        def small():
            return Big(1, 2)
        def broken():
            raise RuntimeError("no weights file")
    """))
    with pytest.raises(piper.PiperError) as err:
        load_model(f"{path}:Big")
    assert err.value.code == "bad-model-spec"
    assert "needs arguments `cfg`, `depth`" in str(err.value) and "name one of broken, small" in str(err.value)
    with pytest.raises(piper.PiperError, match="`broken\\(\\)` from .* raised RuntimeError: no weights file"):
        load_model(f"{path}:broken")


def test_piper_run_with_the_gpt_class_is_a_usage_mistake(capsys):
    from piper.cli import main

    assert main(["run", "examples/gpt_zero3_1f1b.pps", "--model", "examples/gpt.py:GPT"]) == 1
    err = capsys.readouterr().err
    assert "error[bad-model-spec]" in err and "needs argument `cfg`" in err and "internal" not in err


# ---- step inputs, in the driver

SPECS = (TensorSpec((2, 4), torch.float64), TensorSpec((2,), torch.float64))
NAMES = input_names(Net(), 2)


@pytest.mark.parametrize("batch, says", [
    ((torch.zeros(8, 5, dtype=torch.float64), XY[1]), "`x` has shape (8, 5); this job was compiled for (8, 4)"),
    ((torch.zeros(8, 4, 1, dtype=torch.float64), XY[1]), "(8, 4, 1); this job was compiled for (8, 4) (a wrong rank)"),
    ((XY[0].float(), XY[1]), "`x` has dtype torch.float32; this job was compiled for torch.float64"),
    ((XY[0], torch.zeros(8, 3, dtype=torch.float64)), "`y` has shape (8, 3)"),
    ((XY[0][:4], XY[1][:4]), "step got a batch of 4 in `x`; this job was compiled for 8"),
    ((XY[0],), "step takes 2 batch tensor(s) (`x`, `y`), got 1"),
    ((XY[0], [1.0] * 8), "`y` is a list, not a tensor"),
])
def test_step_inputs_are_checked_against_the_captured_specs(batch, says):
    with pytest.raises(piper.PiperError) as err:
        check_step_inputs(batch, SPECS, 8, NAMES)
    assert err.value.code == "bad-inputs" and says in str(err.value)


def test_a_wrong_batch_leaves_the_job_usable(ray_cluster):
    with piper.compile(Net(), XY, optimizer=functools.partial(torch.optim.SGD, lr=0.1)) as job:
        with pytest.raises(piper.PiperError, match="`x` has shape"):
            job.step(torch.zeros(8, 5, dtype=torch.float64), XY[1])
        assert isinstance(job.step(*XY), float)     # nothing reached the worker; it still trains

