"""Files handed to Piper that are not what they claim: `--config` as a FIFO, a link to /dev/zero or a
folder, and TOML that used to crash the config reader (inf, nan, a number for a list, 3,000 dotted
parts, brackets nested thousands deep, bytes that are not UTF-8); `user_files`, the one reader.
Also `--config` giving `model` and the strategy script, as every other flag."""
import os

import pytest

from piper import run_recipe as recipe
from piper import user_files
from piper.cli import build_parser
from piper.diagnostics import PiperError
from tests.helpers import raised


def parse(*argv):
    return build_parser().parse_args(["run", *argv])


def special(path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    else:
        os.mkdir(path)


KINDS = {"fifo": "a pipe (FIFO), not a regular file", "dev_zero": "a character device, not a regular file",
         "folder": "a folder, not a regular file"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_special_config_file_is_refused_by_name(tmp_path, kind):
    path = tmp_path / "run.toml"
    special(path, kind)
    err = raised(recipe.apply_config, parse("job.pps", "--config", str(path)))
    assert isinstance(err, PiperError) and err.code == "unreadable-file", err
    assert KINDS[kind] in str(err) and "the config" in str(err) and "run.toml" in str(err)


@pytest.mark.parametrize("text, needle", [
    ("[training]\nsteps = 3\nbatch_size = inf\n", "(line 3): `batch_size` = inf is not a whole number"),
    ("batch_size = nan\n", "(line 1): `batch_size` = nan is not a whole number"),
    ("steps = 2\nno_decay = 1000\n", "(line 2): `no_decay` = 1000 is not a string or a list of strings"),
    ("a" + ".a" * 3000 + " = 1\n", "(line 1): `a.a.a...` nests tables 32 deep"),
    ("steps = 1\nlr = " + "[" * 3000 + "]" * 3000 + "\n", "(line 2): brackets nest 3000 deep"),
    ("x = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n", "(line 1): brackets nest 3000 deep"),
    ("steps = 1\nlr = 1e400\n", "(line 2): `lr` = inf is not a finite number"),
    ("steps = 0x" + "f" * 5000 + "\n", "(line 1): `steps` = a 20000-bit number is out of range"),
    ("\n\nsteps = " + "1" * 5000 + "\n", "(line 3): not valid TOML"),
    ("[mesh]\ndp = \"x\"\n", "`mesh` = a table is not a table of axis sizes"),
    ("steps = 1979-05-27\n", "`steps` = datetime.date(1979, 5, 27) is not a whole number"),
    ("model = 3\n", "(line 1): `model` = 3 is not a string"),
    ("timeout = -inf\n", "`timeout` = -inf is not a finite number"),
    ("steps = 1\nset = \"warmup-cosine\"\n", "(line 2): `set` takes NAME=VALUE, not `warmup-cosine`"),
])
def test_configs_that_crashed_the_reader_are_bad_config_naming_key_and_line(tmp_path, text, needle):
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(PiperError) as info:
        recipe.apply_config(parse("job.pps", "--config", str(tmp_path / "run.toml")))
    assert info.value.code == "bad-config" and needle in str(info.value), str(info.value)


def test_bytes_that_are_not_utf8_are_bad_config_naming_the_line(tmp_path):
    (tmp_path / "run.toml").write_bytes(b"steps = 1\n\nlr_schedule = '\xff'\n")
    with pytest.raises(PiperError) as info:
        recipe.apply_config(parse("job.pps", "--config", str(tmp_path / "run.toml")))
    assert info.value.code == "bad-config" and "line 3 is not UTF-8 text" in str(info.value)


def test_a_key_in_a_section_is_found_on_its_own_line(tmp_path):
    (tmp_path / "run.toml").write_text("[eval]\nsteps = 1\n[training]\n# steps\nsteps = 'x'\n")
    with pytest.raises(PiperError) as info:      # two tables, two keys `steps`: the second is bad
        recipe.apply_config(parse("job.pps", "--config", str(tmp_path / "run.toml")))
    assert "(line 5): `steps` = 'x'" in str(info.value)


def test_the_config_can_give_the_model_and_the_script(tmp_path, monkeypatch):
    (tmp_path / "run.toml").write_text('model = "examples/gpt.py:small_gpt"\nscript = "job.pps"\n[training]\nsteps = 2\n')
    args = parse("--config", str(tmp_path / "run.toml"))
    recipe.apply_config(args)
    assert (args.model, args.script, args.steps) == ("examples/gpt.py:small_gpt", "job.pps", 2)
    args = parse("mine.pps", "--model", "m.py:f", "--config", str(tmp_path / "run.toml"))
    recipe.apply_config(args)                        # the command line overrides the file
    assert (args.model, args.script, args.steps) == ("m.py:f", "mine.pps", 2)
    # `piper run --config run.toml` alone goes on with the file's model and script.
    from piper import cli_run

    seen = []

    class Reached(Exception):
        pass

    def stop(spec):
        seen.append(spec)
        raise Reached

    monkeypatch.setattr(cli_run, "check_output_paths", lambda args: seen.append(args.script))
    monkeypatch.setattr(cli_run, "load_model", stop)
    with pytest.raises(Reached):
        cli_run.run(parse("--config", str(tmp_path / "run.toml")))
    assert seen == ["job.pps", "examples/gpt.py:small_gpt"]


def test_without_a_script_anywhere_run_says_so(tmp_path, capsys):
    from piper import cli_run

    (tmp_path / "run.toml").write_text('model = "examples/gpt.py:small_gpt"\n')
    assert cli_run.run(parse("--config", str(tmp_path / "run.toml"))) == 2
    assert "SCRIPT is required" in capsys.readouterr().err


# ---- user_files, the one reader


def test_user_files_reads_regular_files_and_refuses_the_rest(tmp_path):
    (tmp_path / "ok.txt").write_bytes(b"x = 1")
    assert user_files.read_text(tmp_path / "ok.txt", limit=5, what="the config") == "x = 1"
    assert list(user_files.chunks(tmp_path / "ok.txt", what="a file", size=2)) == [b"x ", b"= ", b"1"]
    with pytest.raises(PiperError, match="is 5 bytes, over the 4 bytes this file may be"):
        user_files.read_bytes(tmp_path / "ok.txt", limit=4, what="the config")
    with open(tmp_path / "sparse", "wb") as f:      # 100 GB on paper: refused by its size, nothing read
        f.truncate(100 << 30)
    with pytest.raises(PiperError, match="107,374,182,400 bytes"):
        user_files.read_bytes(tmp_path / "sparse", limit=1 << 20, what="the manifest")
    for kind, needle in KINDS.items():
        special(tmp_path / kind, kind)
        for call in (user_files.read_bytes, user_files.regular_file):
            err = raised(call, tmp_path / kind, limit=10, what="the manifest")
            assert isinstance(err, PiperError) and err.code == "unreadable-file" and needle in str(err)
    err = raised(user_files.read_bytes, tmp_path / "none", limit=10, what="the manifest")
    assert err.code == "file-not-found"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "link").symlink_to(tmp_path / "ok.txt")
    with pytest.raises(PiperError, match="leads outside"):
        user_files.regular_file(tmp_path / "in" / "link", what="the checkpoint file", inside=tmp_path / "in")
    with pytest.raises(PiperError, match="NUL byte"):
        user_files.read_bytes("a\0b", limit=10, what="the config")
