"""A model whose forward calls a custom op of its own namespace (`pipertest::scaled_tanh`), as a
library's kernels do (`torch.ops.transformers.*`): the workers must import this module to run it."""
import torch


@torch.library.custom_op("pipertest::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.scale = inputs[1]
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    (out,) = ctx.saved_tensors
    return grad * (ctx.scale - out * out / ctx.scale), None


scaled_tanh.register_autograd(_backward, setup_context=_setup)


class WithCustomOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        h = torch.ops.pipertest.scaled_tanh(self.a(x), 2.0)
        return ((self.b(h).squeeze(-1) - y) ** 2).mean()
