"""The one name-pattern matcher (`piper/frontend/name_patterns.py`): the same answers as the regex it
replaced, in time linear in the name (patterns of 60 and more stars finish), and a bound on a
pattern's length (`pattern-too-long`) wherever patterns are given."""
from __future__ import annotations

import fnmatch
import re
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from piper.diagnostics import PiperError
from piper.frontend.directives import shard_problem
from piper.frontend.name_patterns import MAX_PATTERN, match_names, pattern_problem

NAMES = ["wte.weight", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias", "blocks.0.attn.q.weight",
         "blocks.11.attn.q.bias", "blocks.1.mlp.fc.weight", "ln_f.weight", "lm_head.weight", "bias",
         "model.layers.31.self_attn.q_proj", "model.layers.31.self_attn.x"]


def reference(pattern: str, names) -> list[str]:
    """The regex the matcher replaced (exponential on many stars, exact on small inputs): the spec."""
    names = list(names)
    if not any(c in pattern for c in "*?["):
        return [pattern] if pattern in names else []
    regex = re.compile("".join(
        "(?:.*\\.)?" if part == "**." else ".*" if part == "**" else "[^.]*" if part == "*"
        else fnmatch.translate(part)[4:-3]
        for part in re.split(r"(\A\*\*\.|\*\*|\*)", pattern) if part) + r"\Z")
    return [n for n in names if regex.match(n)]


@pytest.mark.parametrize("pattern", ["**.bias", "**.ln_*.weight", "blocks.*.attn.q.*", "*", "**", "blocks.**",
                                     "blocks.?.ln_[12].*", "blocks.1?.**", "[!b]*.weight", "**.*", "*.*",
                                     "wte.weight", "model.**.q_proj", "**.[a-m]*.weight", "blocks.**.weight",
                                     "[", "a[", "**.x", "***.x", "blocks.*"])
def test_the_patterns_in_use_match_as_before(pattern):
    assert match_names(pattern, NAMES) == reference(pattern, NAMES)


def test_the_documented_example():
    assert match_names("**.ln_*.weight", ["ln_f.weight", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias"]) == \
        ["ln_f.weight", "blocks.0.ln_1.weight"]


# Small alphabets hit the edges: dots against `*`, sets against `[`/`]`/`!`/`-`, and newlines (which
# regex `.` and so `**` and `?` do not match, while `[^.]`, so `*`, does).
PATTERN_PIECES = st.sampled_from(["a", "b", ".", "*", "**", "?", "[", "]", "!", "-", "[a-b]", "[!a]", "\n", "**."])
NAME_CHARS = st.sampled_from(["a", "b", ".", "-", "!", "[", "]", "\n", "c"])


@settings(max_examples=600, deadline=None)
@given(st.lists(PATTERN_PIECES, max_size=8).map("".join),
       st.lists(st.lists(NAME_CHARS, max_size=8).map("".join), min_size=1, max_size=6))
def test_the_matcher_agrees_with_the_regex_it_replaced(pattern, names):
    assert match_names(pattern, names) == reference(pattern, names)


@pytest.mark.parametrize("pattern, expected", [
    ("*" * 60 + "x", ["model.layers.31.self_attn.x"]),                      # the report's pattern
    ("*" * 61 + "x", ["model.layers.31.self_attn.x"]),
    ("*." * 60 + "x", []),                                                   # 60 parts: no name has them
    ("**." * 40 + "x", []),                                                 # 39 dots at least
    ("**." * 40 + "b", ["a." * 100 + "b"]),
    ("*a" * 40 + "b", []),
    ("**a" * 40 + "b", []),
    ("?*" * 50 + "y", []),
    ("**." + "*" * 200 + "x", ["model.layers.31.self_attn.x"]),
])
def test_many_stars_finish(pattern, expected):
    long_names = NAMES + ["a" * 200, "a." * 100 + "b", "model.layers.0." + "q" * 150]
    assert match_names(pattern, long_names) == expected


def test_many_stars_finish_through_param_groups_and_annotate_modules():
    torch = pytest.importorskip("torch")
    import piper
    from piper.frontend.param_groups import ParamGroups

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    groups = ParamGroups(torch.optim.SGD, no_decay=("*" * 60 + "bias",), weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        made = groups(model.named_parameters())
    assert [len(g["params"]) for g in made] == [2, 2] and made[1]["weight_decay"] == 0.0
    piper.annotate_modules(model, "PP", [["*" * 60 + "0"], ["*" * 60 + "1"]])
    with pytest.raises(PiperError) as err:
        piper.annotate_modules(model, "L", [["*" * 60 + "x"]])
    assert err.value.code == "unknown-module"


def test_every_pattern_user_shares_the_one_matcher():
    pytest.importorskip("torch")
    from piper.frontend import modules, name_patterns, param_groups, tensor_parallel

    assert modules.match_names is param_groups.match_names is tensor_parallel.match_names \
        is name_patterns.match_names


def test_a_pattern_is_bounded_where_it_is_matched():
    assert match_names("*" * MAX_PATTERN, ["a"]) == ["a"]
    with pytest.raises(PiperError) as err:
        match_names("*" * (MAX_PATTERN + 1) + "x", NAMES)
    assert err.value.code == "pattern-too-long" and "over the 1,000 characters" in str(err.value)
    assert len(str(err.value)) < 400                                       # the pattern is clipped
    assert pattern_problem("**.bias") is None


def test_a_long_shard_pattern_is_refused_by_check(tmp_path, capsys):
    from piper.cli import main

    long = "**." + "*." * 600 + "q"
    problem = shard_problem(("columns",), (long,))
    assert problem is not None and problem.code == "pattern-too-long"
    script = tmp_path / "job.pps"
    script.write_text(f'mesh tp=2\nshard columns of "**.q", "{long}" over tp\n')
    assert main(["check", "--format", "concise", str(script)]) == 1
    out = capsys.readouterr().out
    assert "[pattern-too-long]" in out and ":2:" in out


def test_the_same_answers_once_the_automaton_stops_keeping_steps(monkeypatch):
    from piper.frontend import name_patterns

    monkeypatch.setattr(name_patterns, "STEPS", 3)          # past it, steps are worked out each time
    for pattern in ("**.bias", "blocks.?.ln_[12].*", "**.*", "*" * 60 + "x", "[!b]*.weight"):
        assert match_names(pattern, NAMES) == reference(pattern, NAMES) if "x" not in pattern \
            else match_names(pattern, NAMES) == ["model.layers.31.self_attn.x"]
