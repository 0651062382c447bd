"""`piper.compile` says what it is doing while workers start (on stderr by default), as `piper run` does;
`progress=False` or PIPER_PROGRESS=0 keeps it quiet, and a callable receives the messages."""
import torch

import piper
from piper.job.progress import reporter


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x, y):
        with piper.annotate("PP"):
            h = torch.relu(self.a(x))
        with piper.annotate("PP"):
            return torch.nn.functional.mse_loss(self.b(h), y)


def test_the_reporter_follows_the_argument_then_the_environment(monkeypatch, capsys):
    said = []
    assert reporter(said.append) == said.append
    monkeypatch.delenv("PIPER_PROGRESS", raising=False)
    reporter(None)("placing 2 workers")
    reporter(True)("set up")
    reporter(False)("never shown")
    monkeypatch.setenv("PIPER_PROGRESS", "0")
    reporter(None)("not shown either")
    reporter(True)("asked for, so shown")
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == "piper: placing 2 workers\npiper: set up\npiper: asked for, so shown\n"


def test_compile_reports_each_stage_on_stderr_unless_told_not_to(ray_cluster, capsys, monkeypatch):
    monkeypatch.delenv("PIPER_PROGRESS", raising=False)
    batch = (torch.randn(4, 4), torch.randn(4, 1))
    with piper.compile(_Two(), batch, strategy=None, device="cpu") as job:
        job.step(*batch)
    lines = capsys.readouterr().err.splitlines()
    stages = [line.split(" ")[1] for line in lines if line.startswith("piper: ")]
    assert stages[:2] == ["capturing", "planning"] and stages[-1] == "workers" and "placing" in stages
    assert lines[-1].startswith("piper: workers ready (")
    said = []
    with piper.compile(_Two(), batch, strategy=None, device="cpu", progress=said.append) as job:
        job.step(*batch)
    with piper.compile(_Two(), batch, strategy=None, device="cpu", progress=False) as job:
        job.step(*batch)
    assert "piper: " not in capsys.readouterr().err
    assert said[0].startswith("capturing _Two") and said[-1].startswith("workers ready")
