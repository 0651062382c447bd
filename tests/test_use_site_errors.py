"""Errors raised at a line of a `use`d standard-library strategy name the user's `use` line too
(rendered as "used from FILE:LINE"), and expert parallelism on an axis the batch is not sharded
over hints the axis it is (issue 43, item 7); goldens: tests/dsl/golden/cases/error-in-used-strategy
and expert-parallel-wrong-axis."""
from __future__ import annotations

import json

from piper.cli import main


def _check(tmp_path, capsys, text: str, *args: str, fmt: str = "text") -> str:
    script = tmp_path / "job.pps"
    script.write_text(text)
    main(["check", "--format", fmt, str(script), *args])
    return capsys.readouterr().out


def test_a_stdlib_error_names_the_use_line(tmp_path, capsys):
    text = "mesh dp=8, pp=64\nuse one_f_one_b(microbatches=1024) on pp\nuse zero3() on dp\n"
    out = _check(tmp_path, capsys, text, "--regions", "PP=64")
    assert "one_f_one_b.pps:17:5: error[plan-too-large]" in out
    assert f"note: used from {tmp_path / 'job.pps'}:2:1" in out
    found = json.loads(_check(tmp_path, capsys, text, "--regions", "PP=64", fmt="json"))
    assert [(site["file"], site["line"]) for site in found[0]["trace"]] == [(str(tmp_path / "job.pps"), 2)]


def test_expert_parallel_on_the_pipeline_axis_hints_the_data_parallel_one(tmp_path, capsys):
    out = _check(tmp_path, capsys, "mesh dp=2, pp=2\nuse one_f_one_b(microbatches=4) on pp\nuse dp() on dp\n"
                 "use expert_parallel() on pp\n", "--regions", "PP=2")
    assert "error[unsupported-sharding]: experts are sharded over `pp` but the batch is sharded over `dp`" in out
    hint = out.split("hint:")[1]
    assert "`use expert_parallel() on dp`" in hint and "shard batch over pp" not in hint
    assert f"note: used from {tmp_path / 'job.pps'}:4:1" in out

