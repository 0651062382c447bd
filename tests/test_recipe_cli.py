"""`piper run`'s recipe flags: `--config run.toml` (flags override it), `--lr-schedule warmup-cosine
--warmup N`, `--weight-decay`, `--data FILE.bin --block-size N`, `--eval-every N --eval-batches K`,
`--tensorboard DIR`."""
import json

import numpy as np
import pytest

from examples.gpt import _corpus_tokens
from piper.cli import build_parser, main
from piper.diagnostics import PiperError
from piper import run_recipe as recipe


def parse(*argv):
    return build_parser().parse_args(["run", "job.pps", *argv])


def test_config_fills_in_what_the_command_line_did_not_give(tmp_path):
    (tmp_path / "run.toml").write_text(
        '[training]\nsteps = 200\nlr = 3e-4\nlr_schedule = "warmup-cosine"\nwarmup = 20\nweight-decay = 0.1\n'
        '[data]\ndata = "train.bin"\nblock_size = 64\n[mesh]\ndp = 2\npp = 2\n')
    args = parse("--config", str(tmp_path / "run.toml"), "--steps", "30", "--lr", "1e-3")
    recipe.apply_config(args)
    assert (args.steps, args.lr) == (30, 1e-3)             # given on the command line
    assert (args.lr_schedule, args.warmup, args.weight_decay) == ("warmup-cosine", 20, 0.1)
    assert (args.data, args.block_size, args.mesh) == ("train.bin", 64, "dp=2,pp=2")
    assert recipe.check(args) is None
    assert recipe.schedule(args, 30)(30) == pytest.approx(0.1) and recipe.schedule(args, 30)(20) == 1.0


@pytest.mark.parametrize("text,needle", [
    ("[training]\nstep = 200\n", "did you mean `steps`"),
    ("steps = 'many'\n", "not a whole number"),
    ("lr_schedule = 'cosine'\n", "not one of"),
    ("steps = [1, 2]\n", "one value"),
    ("steps = \n", "not valid TOML"),
])
def test_bad_config_is_a_diagnostic(tmp_path, text, needle):
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(PiperError) as info:
        recipe.apply_config(parse("--config", str(tmp_path / "run.toml")))
    assert info.value.code == "bad-config" and needle in str(info.value)


@pytest.mark.parametrize("argv,needle", [
    (["--data", "x.bin"], "--block-size"),
    (["--eval-every", "5"], "--val-data"),
    (["--no-decay", "**.bias"], "--weight-decay"),
    (["--warmup", "-1"], "--warmup"),
])
def test_flags_that_do_not_go_together_are_named(argv, needle):
    assert needle in recipe.check(parse(*argv))


@pytest.mark.usefixtures("ray_cluster")
def test_piper_run_trains_a_token_file_with_the_full_recipe(tmp_path):
    tokens = _corpus_tokens()[1].numpy().astype(np.uint16)
    tokens[:4000].tofile(tmp_path / "train.bin")
    tokens[4000:6000].tofile(tmp_path / "val.bin")
    (tmp_path / "job.pps").write_text("mesh dp=2\nuse zero3() on dp\n")
    try:
        import tensorboard  # noqa: F401
        board = ["--tensorboard", str(tmp_path / "tb")]
    except ImportError:     # the package is optional: the rest of the recipe is still checked
        board = []
    (tmp_path / "run.toml").write_text(
        f'[training]\nsteps = 6\nbatch_size = 8\nlr = 1e-2\nlr_schedule = "warmup-cosine"\nwarmup = 2\n'
        f'weight_decay = 0.1\n[data]\ndata = "{tmp_path / "train.bin"}"\nval_data = "{tmp_path / "val.bin"}"\n'
        f'block_size = 64\nshuffle = true\n[eval]\neval_every = 3\neval_batches = 2\n')
    metrics = tmp_path / "m.jsonl"
    assert main(["run", str(tmp_path / "job.pps"), "--model", "examples/gpt.py:small_gpt", "--config",
                 str(tmp_path / "run.toml"), "--metrics", str(metrics), *board]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 6 and rows[-1]["tokens"] == 6 * 8 * 64
    assert rows[-1]["loss"] < rows[0]["loss"]
    if board:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {"train/loss", "train/lr", "train/step_s", "train/tokens_per_s", "eval/loss"} <= tags
        lrs = [e.value for e in events.Scalars("train/lr")]
        assert lrs[0] == pytest.approx(1e-2 / 3) and lrs[2] == pytest.approx(1e-2)     # warmup, then the peak
        assert [e.step for e in events.Scalars("eval/loss")] == [3, 6]
