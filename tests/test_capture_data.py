"""Capture of tensors made in forward from Python data on the input's device, and of
`torch.autocast` blocks in forward: both train as the model does on one device."""
import pytest
import torch

import piper
from examples.strategies import one_f_one_b_order as one_f_one_b
from piper.frontend.capture import capture
from piper.testing import train_both
from tests.test_train import data_parallel, pipeline


class FromData(torch.nn.Module):
    """Constants made in forward from Python data, on the input's device (meta during capture)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        with piper.annotate("PP"):
            weights = torch.tensor([1.0, 0.5, 2.0, 0.25], dtype=x.dtype, device=x.device)
            h = torch.tanh(self.a(x)) * weights
        with piper.annotate("PP"):
            shift = h.new_tensor([0.1, -0.2, 0.3, -0.4])                 # x.new_tensor: the same, by method
            scale = torch.as_tensor([[2.0]], dtype=x.dtype, device=x.device)
            out = self.b(h + shift).squeeze(-1) * scale[0, 0]
            return ((out - y) ** 2).mean()


class Autocast(torch.nn.Module):
    """An autocast block in each region (as models that manage their own precision have)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        with piper.annotate("PP"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = torch.relu(self.a(x))                          # bf16 matmul, relu on the bf16 result
        with piper.annotate("PP"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = self.b(h).squeeze(-1)
            return ((out.float() - y) ** 2).mean()                 # the loss in float32, outside autocast


def _batches(n, width, dtype):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, width, generator=g, dtype=dtype), torch.randn(8, generator=g, dtype=dtype))
            for _ in range(n)]


def test_constants_from_python_data_keep_their_values():
    program = capture(FromData().double(), _batches(1, 4, torch.float64)[0])
    values = sorted(tuple(v.flatten().tolist()) for v in program.constants.values())
    assert values == [(0.1, -0.2, 0.3, -0.4), (1.0, 0.5, 2.0, 0.25), (2.0,)]
    assert all(v.device.type == "cpu" for v in program.constants.values())


def test_autocast_block_is_captured_with_its_casts():
    program = capture(Autocast(), _batches(1, 8, torch.float32)[0])
    code = "\n".join(r.graph.code for r in program.regions)
    assert "wrap_with_autocast" not in code and "torch.bfloat16" in code
    # The value passed between the regions is autocast's: bf16, as eager computes it.
    assert [v.spec.dtype for v in program.values] == [torch.bfloat16]


CASES = {
    "dp2": (lambda: data_parallel(), {"dp": 2}),
    "1f1b-pp2": (lambda: pipeline(4, order=one_f_one_b), {"pp": 2}),
}


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("case", list(CASES))
def test_constants_from_python_data_train_as_on_one_device(case):
    strategy, mesh = CASES[case]
    losses, ref_losses, state, ref_state = train_both(FromData().double(), strategy(), mesh=mesh,
                                                      batches=_batches(1, 4, torch.float64) * 3, timeout=120)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-9, atol=1e-9)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    assert losses[-1] < losses[0]


@pytest.mark.usefixtures("ray_cluster")
def test_autocast_in_forward_trains_as_on_one_device():
    # bf16 results summed over microbatches in another order differ in the last bits of float32.
    losses, ref_losses, state, ref_state = train_both(Autocast(), pipeline(4, order=one_f_one_b), mesh={"pp": 2},
                                                      batches=_batches(1, 8, torch.float32) * 3, timeout=120)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=1e-3)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert losses[-1] < losses[0]
