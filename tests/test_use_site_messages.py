"""What a user reads when a `use`d strategy warns or does not fit the model: the user's own line,
once, and a hint that never proposes the schedule already in use."""
import torch

import piper
from piper.cli import main


def _check(tmp_path, capsys, text: str, *args: str) -> str:
    script = tmp_path / "job.pps"
    script.write_text(text)
    main(["check", "--format", "text", str(script), *args])
    return capsys.readouterr().out


def test_a_stdlib_warning_points_at_the_use_line_once(tmp_path, capsys):
    out = _check(tmp_path, capsys, "mesh dp=1\nuse zero3() on dp\n")
    assert out.count("warning[shard-size-one]") == 1
    assert out.startswith(f"{tmp_path / 'job.pps'}:2:1: warning[shard-size-one]: `shard batch, optimizer, grads, "
                          "params over dp`")
    assert "zero3.pps:22" not in out.splitlines()[0]     # the stdlib line is a label, not the place
    assert "raised by this line of the strategy" in out


def test_the_scripts_own_lines_over_one_device_warn_once(tmp_path, capsys):
    out = _check(tmp_path, capsys, "mesh dp=1, pp=2\nshard batch over dp\nshard optimizer, grads over dp\n"
                 "place PP=0 on pp[0]\nplace PP=1 on pp[1]\n", "--regions", "PP=2")
    assert out.count("warning[shard-size-one]") == 1 and ":2:1: warning" in out
    assert "also shards over `dp`" in out


def test_a_schedule_too_long_for_the_model_never_suggests_itself(tmp_path, capsys):
    out = _check(tmp_path, capsys, "mesh pp=4\nuse one_f_one_b(microbatches=4) on pp\n", "--regions", "PP=2")
    assert "error[unknown-region]" in out and "one_f_one_b`" not in out.split("hint:")[1]
    assert "shrink the pipeline axis to 2 devices" in out
    # An interleaved schedule holds several regions per device: one region each is a real way out.
    out = _check(tmp_path, capsys, "mesh pp=2\nuse interleaved_1f1b(microbatches=4, virtual=2) on pp\n",
                 "--regions", "PP=2")
    assert "(`one_f_one_b`)" in out.split("hint:")[1]


class _Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(self.a(x)), y)


def test_a_model_without_regions_is_told_so_by_the_api(tmp_path):
    for text in ("mesh pp=2\nuse one_f_one_b(microbatches=2) on pp\n",
                 "mesh pp=2\nsplit MB into 2\nplace PP=0 on pp[0]\nplace PP=1 on pp[1]\n"):
        script = tmp_path / "s.pps"
        script.write_text(text)
        try:
            piper.compile(_Plain(), (torch.randn(4, 4), torch.randn(4, 1)), strategy=str(script))
        except piper.PiperError as err:
            d = err.diagnostics[0]
        else:
            raise AssertionError("a two-stage schedule over a one-region model compiled")
        assert d.code == "unknown-region" and "no annotated regions" in d.message
        assert "piper.annotate" in d.hint and "piper.annotate_modules" in d.hint and "one_f_one_b" not in d.hint
        assert d.span.file == str(script)
