"""A model with no `piper.annotate` regions (for the golden of a schedule that needs two)."""
import torch


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)


def make():
    return Plain()


def example_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 1)
