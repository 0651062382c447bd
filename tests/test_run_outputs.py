"""`piper run`'s outputs are tried before the model loads (`piper/run_paths.py`): a probe file is created
and removed where each will be written, so a name the file system refuses, /proc, a folder under a
regular file or a missing tensorboard package end the run before it trains, not after."""
import os
import sys

import pytest

from piper.cli import main

MODEL = "examples/gpt.py:two_stage_gpt"


class Reached(BaseException):
    """The run got as far as loading the model: every output passed."""


@pytest.fixture
def no_model(monkeypatch):
    import piper.cli_run as cli_run

    def load_model(spec):
        raise Reached(spec)
    monkeypatch.setattr(cli_run, "load_model", load_model)


def refused(capsys, *argv) -> str:
    assert main(["run", "s.pps", "--model", MODEL, *argv]) == 1
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize("flag, name", [("--save", "w" * 300 + ".pt"), ("--trace", "t" * 300 + ".json"),
                                        ("--metrics", "m" * 300 + ".jsonl"), ("--tensorboard", "b" * 300),
                                        ("--checkpoint-dir", "c" * 300)])
def test_a_name_over_255_bytes_is_refused_before_the_model_loads(tmp_path, capsys, flag, name):
    extra = ["--checkpoint-every", "2"] if flag == "--checkpoint-dir" else []
    err = refused(capsys, flag, str(tmp_path / name), *extra)
    assert "error[bad-output]" in err and flag in err and "longer than the file system allows" in err
    assert os.listdir(tmp_path) == []                  # no probe left behind


@pytest.mark.usefixtures("no_model")
def test_a_checkpoint_directory_whose_staging_folder_would_be_too_long_is_refused(tmp_path, capsys):
    """`job.save` writes `.{name}.saving-<12 hex>` beside the checkpoint: 240 bytes fit, that does not."""
    name = "c" * 240
    err = refused(capsys, "--save", str(tmp_path / name))
    assert "error[bad-output]" in err and "longer than the file system allows" in err
    with pytest.raises(Reached):
        main(["run", "s.pps", "--model", MODEL, "--save", str(tmp_path / ("c" * 200))])
    assert os.listdir(tmp_path) == []


@pytest.mark.usefixtures("no_model")
def test_save_into_proc_is_refused_even_for_root(capsys):
    err = refused(capsys, "--save", "/proc/piper-weights.pt")
    assert "error[bad-output]" in err and "--save /proc/piper-weights.pt cannot be written" in err


@pytest.mark.usefixtures("no_model")
def test_a_tensorboard_folder_under_a_regular_file_is_refused(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    err = refused(capsys, "--tensorboard", str(tmp_path / "a_file" / "tb"))
    assert "error[bad-output]" in err and "--tensorboard" in err and "which is a file" in err


@pytest.mark.usefixtures("no_model")
def test_a_missing_tensorboard_package_is_found_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)     # import raises ImportError
    err = refused(capsys, "--tensorboard", str(tmp_path / "tb"))
    assert "error[bad-flag]" in err and "needs the tensorboard package" in err and "pip install" in err


@pytest.mark.usefixtures("no_model")
def test_missing_folders_of_metrics_tensorboard_and_checkpoints_are_created(tmp_path):
    metrics, board, ckpt = tmp_path / "logs" / "run1" / "m.jsonl", tmp_path / "tb" / "run1", tmp_path / "ckpt"
    with pytest.raises(Reached):
        main(["run", "s.pps", "--model", MODEL, "--metrics", str(metrics), "--tensorboard", str(board),
              "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"])
    assert metrics.parent.is_dir() and board.is_dir() and ckpt.is_dir()
    assert not metrics.exists() and os.listdir(board) == []             # probes removed


@pytest.mark.usefixtures("no_model")
def test_an_unwritable_folder_is_found_by_its_probe(tmp_path, capsys, monkeypatch):
    """Whatever refuses the probe (here an OSError of a read-only file system) refuses the run."""
    import errno

    import piper.run_paths as run_paths

    real_open = os.open

    def read_only(path, flags, *args):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *args)
    monkeypatch.setattr(run_paths.os, "open", read_only)
    err = refused(capsys, "--trace", str(tmp_path / "t.json"))
    assert "error[bad-output]" in err and "is on a read-only file system" in err


@pytest.mark.usefixtures("no_model")
def test_an_existing_output_file_is_kept_as_it_was(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text("earlier")
    with pytest.raises(Reached):
        main(["run", "s.pps", "--model", MODEL, "--trace", str(trace)])
    assert trace.read_text() == "earlier"
