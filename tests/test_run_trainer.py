"""`piper run` as a trainer: its flags, the model file's data, the metric it reports, --save."""

import pytest
import torch

from piper.cli import build_parser, main
from piper.cli_run import make_optimizer, throughput

MODEL_FILE = """
import torch
import piper

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8, dtype=torch.float64)
        self.b = torch.nn.Linear(8, 1, dtype=torch.float64)

    def forward(self, x, y):
        with piper.annotate("PP"):
            h = torch.tanh(self.a(x))
        with piper.annotate("PP"):
            return ((self.b(h).squeeze(-1) - y) ** 2).mean()

def make():
    return Net()

def example_batch(batch_size):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 4, generator=g, dtype=torch.float64), torch.randn(batch_size, generator=g,
                                                                                     dtype=torch.float64)
"""


def test_run_flags_parse_with_their_defaults():
    args = build_parser().parse_args(["run", "s.pps", "--model", "m.py:make"])
    assert (args.steps, args.batch_size, args.optimizer, args.lr, args.address, args.device, args.save) == \
        (None, None, "adamw", 1e-3, None, "auto", None)
    args = build_parser().parse_args(["run", "s.pps", "--model", "m.py:make", "--batch-size", "8", "--lr", "0.1",
                                      "--optimizer", "sgd", "--steps", "3", "--address", "auto", "--device", "cpu",
                                      "--save", "w.pt"])
    assert (args.steps, args.batch_size, args.optimizer, args.lr, args.address, args.device, args.save) == \
        (3, 8, "sgd", 0.1, "auto", "cpu", "w.pt")


def test_the_optimizer_flag_builds_torch_optimizers():
    opt = make_optimizer("sgd", 0.5)([torch.zeros(2, requires_grad=True)])
    assert type(opt) is torch.optim.SGD and opt.defaults["lr"] == 0.5
    with pytest.raises(Exception, match="not a positive learning rate"):
        make_optimizer("adamw", 0.0)


def test_throughput_is_tokens_only_for_token_inputs():
    assert throughput((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))) == (64, "tok")
    assert throughput((torch.zeros(4, 3), torch.zeros(4))) == (4, "samples")
    assert throughput((torch.zeros(4, dtype=torch.long), torch.zeros(4))) == (4, "samples")   # class ids


def test_bad_step_counts_are_usage_errors(tmp_path, capsys):
    (tmp_path / "m.py").write_text(MODEL_FILE)
    assert main(["run", "x.pps", "--model", f"{tmp_path}/m.py:make", "--steps", "0"]) == 2


def test_run_trains_warns_on_one_repeated_batch_and_saves_the_weights(ray_cluster, tmp_path, capsys):
    (tmp_path / "m.py").write_text(MODEL_FILE)
    script = tmp_path / "s.pps"
    script.write_text("split MB into 2\n")
    saved = tmp_path / "w.pt"
    assert main(["run", str(script), "--model", f"{tmp_path}/m.py:make", "--steps", "3", "--batch-size", "4",
                 "--optimizer", "sgd", "--lr", "0.1", "--device", "cpu", "--save", str(saved)]) == 0
    err = capsys.readouterr().err
    assert "defines no `training_batches(batch_size)`" in err and "again and again" in err
    assert "samples/s" in err and "tok/s" not in err
    assert "workers ready" in err and "over 3 steps" in err
    state = torch.load(saved)
    assert set(state) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    # Three SGD steps on the repeated batch, as one device takes them.
    import importlib.util
    spec = importlib.util.spec_from_file_location("m_ref", tmp_path / "m.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    torch.manual_seed(0)
    net = ref.make()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = ref.example_batch(4)
    for _ in range(3):
        opt.zero_grad()
        net(x, y).backward()
        opt.step()
    for name, value in net.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12)


def test_save_writes_weights_to_a_weight_file_and_a_checkpoint_elsewhere(tmp_path):
    """`--save w.pt` keeps torch.save of the weights; `--save DIR` asks the job for a checkpoint."""
    import io

    import torch
    from rich.console import Console

    from piper.cli_run import save_outputs

    class Job:
        steps = 3
        saved = []

        def state_dict(self):
            return {"w": torch.ones(2)}

        def save(self, path):
            self.saved.append(path)

    job, console = Job(), Console(file=io.StringIO())
    save_outputs(job, str(tmp_path / "w.pt"), console)
    assert torch.equal(torch.load(tmp_path / "w.pt")["w"], torch.ones(2)) and job.saved == []
    save_outputs(job, str(tmp_path / "ckpt"), console)
    assert job.saved == [str(tmp_path / "ckpt")]
    assert "checkpoint" in console.file.getvalue()
