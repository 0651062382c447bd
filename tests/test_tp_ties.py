"""A weight tied between a module tensor parallelism divides and one it does not (or divides
another way) is refused when the model is captured, at `piper check --model`, naming both
parameters (issue 42, item 8): it passed the check and failed after the workers started with
`KeyError: 'aux.weight'`."""
from __future__ import annotations

import json

from piper.cli import main

TP = ('mesh tp=2\nshard columns of "blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.mlp.gate", '
      '"blocks.*.mlp.up" over tp\nshard rows of "blocks.*.attn.o", "blocks.*.mlp.down" over tp\n')


def _check(tmp_path, capsys, text: str, model: str):
    path = tmp_path / "job.pps"
    path.write_text(text)
    status = main(["check", "--format", "json", str(path), "--model", model])
    return status, json.loads(capsys.readouterr().out or "[]")


def test_a_weight_tied_to_a_module_no_pattern_names_is_refused_at_check(tmp_path, capsys):
    status, found = _check(tmp_path, capsys, TP + 'shard vocab of "embed", "head" over tp\n',
                           "tests/tied_tp_model.py:make_model")
    assert status == 1 and [d["code"] for d in found] == ["tp-tied-weight"], found
    message = found[0]["message"]
    assert "`aux.weight`" in message and "`head.weight`" in message and "`aux`" in found[0]["hint"]
    assert found[0]["line"] == 4          # the statement that divides the weight


def test_naming_every_holder_of_the_weight_checks(tmp_path, capsys):
    status, found = _check(tmp_path, capsys, TP + 'shard vocab of "embed", "head", "aux" over tp\n',
                           "tests/tied_tp_model.py:make_model")
    assert status == 0, found


def test_a_weight_divided_along_two_dimensions_is_refused(tmp_path, capsys):
    status, found = _check(tmp_path, capsys, TP, "tests/tied_tp_model.py:make_q_o_tied")
    assert status == 1 and [d["code"] for d in found] == ["tp-tied-weight"], found
    assert "dimension 1" in found[0]["message"] and "dimension 0" in found[0]["message"]
