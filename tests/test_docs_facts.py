"""What the pages say about the language, the plans' tokens, installing torch and Piper's cache
holds: each claim is checked against the code it describes."""
import os
import re
import subprocess
import sys
from pathlib import Path

from piper.cli import main

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_unknown_statement_names_every_statement_keyword(capsys):
    from piper.dsl.syntax_errors import _STATEMENT_WORDS

    assert main(["explain", "unknown-statement"]) == 0
    page = capsys.readouterr().out
    listed = page.split("statement keyword:", 1)[1].split(". ", 1)[0]
    assert set(re.findall(r"`(\w+)`", listed)) == {w.lower() for w in _STATEMENT_WORDS}


NESTED = '''
import torch, piper

class Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    def forward(self, x, y):
        for stage in range(2):
            with piper.annotate("PP"):
                for i in range(2):
                    with piper.annotate("L"):
                        x = self.blocks[2 * stage + i](x)
        return torch.nn.functional.mse_loss(x, y)

def make():
    return Nested()

def example_batch(n):
    return torch.randn(n, 4), torch.randn(n, 4)
'''


def test_a_tokens_region_number_with_nested_regions_is_as_the_plans_page_says(tmp_path, capsys):
    (tmp_path / "nested.py").write_text(NESTED)
    (tmp_path / "s.pps").write_text("mesh pp=2\nuse one_f_one_b(microbatches=2) on pp\n")
    assert main(["show", str(tmp_path / "s.pps"), "--model", f"{tmp_path}/nested.py:make", "--what", "ir"]) == 0
    regions = [line for line in capsys.readouterr().out.splitlines() if line.startswith("region ")]
    assert [" ".join(r.split()[:4]) for r in regions] == [
        "region 0 PP=0 L=0", "region 1 PP=0 L=1", "region 2 PP=1 L=2", "region 3 PP=1 L=3"]
    page = " ".join((REPO / "docs" / "plans.md").read_text(encoding="utf-8").split())
    assert "`PP=1` is regions 2 and 3" in page and "(`region 2 PP=1 L=2`)" in page


def test_the_readme_says_how_to_get_the_cpu_build_of_torch():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    # The two set-up commands stay as they are (they install the CPU wheel from a local folder).
    assert README.count(".venv/bin/pip install torch==2.13.0 -e '.[test]' && .venv/bin/python") == 2
    # From the CPU index: `==2.13.0` accepts the local version `+cpu`, and pip prefers it to the plain one.
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in README
    assert "--index-url https://download.pytorch.org/whl/cpu" in README
    assert SpecifierSet("==2.13.0").contains("2.13.0+cpu") and Version("2.13.0+cpu") > Version("2.13.0")
    assert "comes first so a CPU machine gets the CPU wheel" not in README


def test_the_cache_folder_is_piper_cache_then_xdg_then_home(monkeypatch, tmp_path):
    from piper.cache_dir import cache_dir

    monkeypatch.setenv("PIPER_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == str(tmp_path / "mine")
    monkeypatch.delenv("PIPER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "piper")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == str(tmp_path / "home" / ".cache" / "piper")
    for where in (README, (REPO / "piper" / "compiler" / "tune.py").read_text(encoding="utf-8")):
        assert "$PIPER_CACHE" in where


def test_the_suite_keeps_its_cache_out_of_home():
    cache = os.environ["PIPER_CACHE"]      # set by conftest.py for the session
    assert not cache.startswith(os.path.expanduser("~") + os.sep) and Path(cache).is_dir()


def test_tests_run_with_a_fresh_home_write_nothing_into_it(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PIPER_CACHE", "XDG_CACHE_HOME")}
    env["HOME"] = str(home)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "tests/dsl/test_golden.py::test_golden_case",
                           "tests/test_use_site_messages.py::test_a_model_without_regions_is_told_so_by_the_api"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.relative_to(home).as_posix() for p in home.rglob("*")) == []
