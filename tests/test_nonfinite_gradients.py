"""A step whose loss is finite but whose gradients hold inf or NaN stops in that step, naming
it, with no device's weights touched by them (`nonfinite="stop"`, the default)."""
import pytest
import torch

import piper
from piper.dsl import load_strategy


class NaNGradient(torch.nn.Module):
    """The loss is finite; d/dw of sqrt(|w - w|) at 0 is inf * 0 = NaN."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        kink = (self.a.weight - self.a.weight.detach()).abs().sum()
        return ((self.a(x).squeeze(-1) - y) ** 2).mean() + torch.sqrt(kink)


XY = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, dtype=torch.float64))


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("clip", [None, 1.0])
def test_nonfinite_gradients_stop_the_step_that_made_them(clip):
    model = NaNGradient().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with piper.compile(model, XY, strategy=load_strategy("use zero1() on dp\n"), mesh={"dp": 2},
                       clip_grad_norm=clip) as job:
        with pytest.raises(piper.PiperError) as err:
            job.step(*XY)
        assert err.value.code == "non-finite"
        text = str(err.value)
        assert "the gradients of step 1 hold inf or NaN" in text and "rank 0" in text and "rank 1" in text
        assert ("the global gradient norm" if clip else "unit 0") in text
        after = job.state_dict()              # every device found them, so none stepped
    for name, value in before.items():
        assert torch.equal(after[name], value), name


@pytest.mark.usefixtures("ray_cluster")
def test_skip_goes_on_past_them():
    with piper.compile(NaNGradient().double(), XY, strategy=load_strategy("use dp() on dp\n"), mesh={"dp": 2},
                       nonfinite="skip") as job:
        loss = job.step(*XY)
        assert loss == loss and job.steps == 1          # finite, and the step counted (its update skipped)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_the_finite_check_finds_inf_and_nan_in_any_tensor_and_changes_no_value(dtype):
    from piper.runtime.state.clip import gradients_finite

    grads = [torch.randn(5, dtype=dtype), None, torch.randn(3, 4, dtype=dtype), torch.tensor([1e-40, -0.0])]
    before = [g.clone() if g is not None else None for g in grads]
    assert gradients_finite(grads)
    assert all(g is None or torch.equal(g, b) and g.dtype == b.dtype for g, b in zip(grads, before))
    assert torch.equal(grads[3].signbit(), torch.tensor([False, True]))       # -0.0 stays -0.0
    for bad in (float("inf"), float("-inf"), float("nan")):
        grads[2][2, 3] = bad
        assert not gradients_finite(grads)
        grads[2][2, 3] = 0.0
    assert gradients_finite([]) and gradients_finite([None])
