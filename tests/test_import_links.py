"""An `import` reads only .pps scripts inside the importing script's folder tree: a link out of it,
to a file of another kind, or into /proc is refused, and nothing of the target is printed."""
import json

import pytest

from piper.cli import main
from piper.dsl import check_source

SECRET = "PIPER_TEST_SECRET_TOKEN=hunter2"


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "job"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "common.pps").write_text("strategy halves():\n    split MB into 2\n")
    return root


@pytest.mark.parametrize("fmt", ["text", "json", "concise", "rich"])
def test_a_link_to_proc_self_environ_prints_nothing_of_it(tree, fmt, capsys, monkeypatch):
    monkeypatch.setenv("PIPER_TEST_SECRET_TOKEN", "hunter2")
    (tree / "x.pps").symlink_to("/proc/self/environ")
    (tree / "main.pps").write_text('import "x.pps"\n')
    assert main(["check", str(tree / "main.pps"), "--format", fmt]) == 1
    out = capsys.readouterr()
    assert "hunter2" not in out.out + out.err
    if fmt == "json":
        (d,) = json.loads(out.out)
        assert d["code"] == "bad-import" and "leads out of" in d["message"]


def test_a_link_to_a_file_that_is_not_a_script_prints_nothing_of_it(tree):
    (tree / "notes.txt").write_text(SECRET + "\n")
    (tree / "y.pps").symlink_to(tree / "notes.txt")     # inside the tree, but not a .pps script
    (d,) = check_source('import "y.pps"\n', str(tree / "main.pps"))
    assert d.code == "bad-import" and "not a .pps script" in d.message
    assert "hunter2" not in str(d) and d.hint


def test_a_link_out_of_the_tree_is_refused_even_to_a_script(tree, tmp_path):
    (tmp_path / "outside.pps").write_text("strategy far():\n    split MB into 2\n")
    (tree / "far.pps").symlink_to(tmp_path / "outside.pps")
    (d,) = check_source('import "far.pps"\n', str(tree / "main.pps"))
    assert d.code == "bad-import" and "leads out of" in d.message


def test_a_folder_link_out_of_the_tree_is_refused(tree, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.pps").write_text("strategy a():\n    split MB into 2\n")
    (tree / "ext").symlink_to(tmp_path / "elsewhere")
    (d,) = check_source('import "ext/a.pps"\n', str(tree / "main.pps"))
    assert d.code == "bad-import"


def test_links_inside_the_tree_and_parent_folders_still_import(tree):
    (tree / "short.pps").symlink_to(tree / "lib" / "common.pps")
    (tree / "lib" / "user.pps").write_text('import "../short.pps"\nmesh dp=1\nuse halves()\n')
    assert check_source('import "short.pps"\nmesh dp=1\nuse halves()\n', str(tree / "main.pps")) == []
    assert check_source((tree / "lib" / "user.pps").read_text(), str(tree / "lib" / "user.pps")) == []


def test_a_main_script_in_proc_is_refused(capsys):
    assert main(["check", "/proc/self/environ"]) == 2
    assert "kernel's files" in capsys.readouterr().err
