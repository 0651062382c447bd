"""Tensor, sequence and vocab parallelism as statements: `.pps` and Python to directives to IR, with
their diagnostics. No model and no lowering: an abstract chain of regions (`Program.chain`)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from piper import PiperError
from piper.dsl import check_source, load_strategy
from piper.frontend.capture import Program
from piper.frontend.directives import SHARDABLE, TENSOR_KINDS, Shard
from piper.frontend.strategy import strategy
from piper.ir.dag import format_ir, parse_ir
from piper.ir.statements import apply_all, initial_ir
from piper.job import build_strategy
from piper.mesh import Mesh

MESH = {"dp": 2, "tp": 2}
TP = '''mesh dp=2, tp=2
shard batch over dp
shard columns of "**.q_proj", "**.k_proj" over tp
shard rows of "**.o_proj" over tp
shard columns of "**.up_proj" over tp
shard vocab of "**.embed_tokens", "**lm_head" over tp
shard sequence over tp
'''


def directives_of(source, mesh=MESH):
    _, directives = build_strategy(load_strategy(source) if isinstance(source, str) else source, Mesh.of(mesh))
    return directives


def ir_of(source, mesh=MESH, regions=2):
    mesh = Mesh.of(mesh)
    return apply_all(initial_ir(Program.chain(f"PP={regions}"), mesh), directives_of(source, mesh))


def refusal(source, mesh=MESH):
    """The one diagnostic building the IR of `source` raises."""
    with pytest.raises(PiperError) as info:
        ir_of(source, mesh)
    (diagnostic,) = info.value.diagnostics
    return diagnostic


def checked(source):
    """The errors `check_source` (the language's checker, no model) reports for `source`."""
    return [d for d in check_source(source, "job.pps") if d.severity == "error"]


def test_contract_names():
    assert TENSOR_KINDS == ("columns", "rows", "vocab")
    assert {"columns", "rows", "vocab", "sequence"} <= set(SHARDABLE)
    d = Shard(("columns",), "tp", of=("a",), of_spans=("x",))
    assert d == Shard(("columns",), "tp", of=("a",)), "of_spans is not part of the value"


def test_pps_statements_become_directives_with_a_span_per_pattern():
    shards = [d for d in directives_of(TP) if d.what != ("batch",)]
    assert [(d.what, d.of, d.over) for d in shards] == [
        (("columns",), ("**.q_proj", "**.k_proj"), "tp"), (("rows",), ("**.o_proj",), "tp"),
        (("columns",), ("**.up_proj",), "tp"), (("vocab",), ("**.embed_tokens", "**lm_head"), "tp"),
        (("sequence",), (), "tp")]
    first = shards[0]
    assert len(first.of_spans) == 2
    q, k = first.of_spans
    assert (q.line, q.column, q.end_column) == (3, 18, 29)      # the quoted "**.q_proj"
    assert (k.line, k.column) == (3, 31)


def test_ir_records_one_axis_and_accumulates_patterns():
    ir = ir_of(TP)
    assert ir.sharding == (("batch", "dp"), ("columns", "tp"), ("rows", "tp"), ("vocab", "tp"), ("sequence", "tp"))
    assert ir.tensor_axis() == "tp"
    assert ir.tensor_patterns_of("columns") == ("**.q_proj", "**.k_proj", "**.up_proj")
    assert ir.tensor_patterns_of("rows") == ("**.o_proj",)
    assert ir.tensor_patterns_of("vocab") == ("**.embed_tokens", "**lm_head")
    kind, pattern, span = ir.tensor_patterns[0]
    assert (kind, pattern, span.line, span.column) == ("columns", "**.q_proj", 3, 18)
    assert ir_of("mesh dp=2\nshard batch over dp\n", {"dp": 2}).tensor_axis() is None


def test_ir_text_form_round_trips_the_patterns():
    ir = ir_of(TP.replace('"**.o_proj"', '"blocks.*.attn.o \\"x\\""'))
    text = format_ir(ir)
    assert 'pattern rows "blocks.*.attn.o \\"x\\""' in text
    back = parse_ir(text)
    assert back == ir and back.tensor_patterns_of("rows") == ('blocks.*.attn.o "x"',)
    assert back != ir.with_(tensor_patterns=ir.tensor_patterns[1:]), "patterns are part of the value"


def test_python_forms_build_the_same_ir():
    @strategy
    def tp(s, axis="tp"):
        s.shard("batch", over="dp")
        s.shard("columns", of=["**.q_proj", "**.k_proj"], over=axis)
        s.shard("rows", of="**.o_proj", over=axis)          # one string is one pattern
        s.shard("columns", of=("**.up_proj",), over=axis)
        s.shard("vocab", of=["**.embed_tokens", "**lm_head"], over=axis)
        s.shard("sequence", over=axis)

    assert ir_of(tp) == ir_of(TP)


@pytest.mark.parametrize("call, code", [
    (lambda s: s.shard("columns", over="tp"), "missing-of"),
    (lambda s: s.shard("sequence", of=["x"], over="tp"), "bad-shard"),
    (lambda s: s.shard("batch", of=["x"], over="tp"), "bad-shard"),
    (lambda s: s.shard("columns", "rows", of=["x"], over="tp"), "bad-shard"),
    (lambda s: s.shard("columns", "batch", of=["x"], over="tp"), "bad-shard"),
    (lambda s: s.shard("columns", of=[""], over="tp"), "bad-shard"),
    (lambda s: s.shard("columns", of=["a", "a"], over="tp"), "duplicate-name"),
    (lambda s: s.shard("columns", of=[3], over="tp"), "wrong-type"),
])
def test_python_refusals(call, code):
    with pytest.raises(PiperError) as info:
        directives_of(strategy(call))
    assert info.value.diagnostics[0].code == code
    assert info.value.diagnostics[0].span.file == __file__


@pytest.mark.parametrize("line, code, column", [
    ("shard columns over tp", "missing-of", 7),
    ('shard sequence of "x" over tp', "bad-shard", 19),
    ('shard batch of "x" over tp', "bad-shard", 16),
    ('shard columns, rows of "x" over tp', "bad-shard", 16),
    ('shard columns, batch of "x" over tp', "bad-shard", 16),
    ('shard columns of "" over tp', "bad-shard", 18),
    ('shard columns of "a", "a" over tp', "duplicate-name", 23),
    ('shard colums of "a" over tp', "bad-shard", 7),
])
def test_pps_refusals_point_at_the_item(line, code, column):
    (d,) = checked(f"mesh dp=2, tp=2\n{line}\n")
    assert (d.code, d.span.line, d.span.column) == (code, 2, column)


@pytest.mark.parametrize("line, code, column", [
    ("shard columns of over tp", "missing-pattern", 18),
    ("shard columns of q_proj over tp", "missing-pattern", 18),
    ('shard rows of "a", over tp', "missing-pattern", 20),
    ('shard columns "a" over tp', "missing-of", 15),
    ('shard columns of "a" tp', "missing-over", 22),
    ('shard columns of "a" "b" over tp', "missing-separator", 22),
])
def test_syntax_errors_of_of(line, code, column):
    (d,) = checked(f"mesh tp=2\n{line}\n")
    assert (d.code, d.span.line, d.span.column) == (code, 2, column)


def test_a_pattern_divided_two_ways_names_both_statements():
    d = refusal('mesh tp=2\nshard columns of "a", "b" over tp\nshard rows of "c", "b" over tp\n', {"tp": 2})
    assert d.code == "sharded-twice" and "columns" in d.message and "rows" in d.message
    assert (d.span.line, d.span.column) == (3, 20)
    assert [(label.span.line, label.span.column) for label in d.labels] == [(2, 23)]
    d = refusal('mesh tp=2\nshard columns of "a" over tp\nshard columns of "a" over tp\n', {"tp": 2})
    assert d.code == "sharded-twice" and d.span.line == 3 and d.labels[0].span.line == 2


@pytest.mark.parametrize("script", [
    "shard batch over dp\nshard columns of \"a\" over dp\n",
    "shard columns of \"a\" over dp\nshard batch over dp\n",             # any order
    "shard batch over dp\nshard optimizer, grads over tp\nshard rows of \"a\" over tp\n",
    "shard batch over tp\nshard experts over tp\nshard sequence over tp\nshard columns of \"a\" over dp\n",
])
def test_tensor_parallelism_needs_an_axis_of_its_own(script):
    d = refusal("mesh dp=2, tp=2\n" + script)
    assert d.code == "unsupported-sharding" and d.hint == "TP needs an axis of its own: mesh dp=2, tp=2"
    assert d.labels, "the statement it clashes with is labelled"


def test_tensor_parallelism_over_two_axes_is_refused_with_both_spans():
    d = refusal('mesh dp=2, tp=2, tq=2\nshard batch over dp\nshard columns of "a" over tp\n'
                'shard rows of "b" over tq\n', {"dp": 2, "tp": 2, "tq": 2})
    assert d.code == "unsupported-sharding" and d.span.line == 4 and d.labels[0].span.line == 3
    d = refusal('mesh dp=2, tp=2, tq=2\nshard columns of "a" over tp\nshard columns of "b" over tq\n',
                {"dp": 2, "tp": 2, "tq": 2})
    assert d.code == "unsupported-sharding" and d.span.line == 3


def test_sequence_needs_columns_or_rows_in_any_order():
    d = refusal('mesh dp=2, tp=2\nshard batch over dp\nshard sequence over tp\nshard vocab of "**lm_head" over tp\n')
    assert d.code == "sequence-without-tp" and d.span.line == 3
    ir = ir_of('mesh dp=2, tp=2\nshard sequence over tp\nshard rows of "a" over tp\n')
    assert ir.sharded("sequence") == "tp" and ir.tensor_patterns_of("rows") == ("a",)
    assert refusal("mesh tp=2\nshard sequence over tp\nshard sequence over tp\n", {"tp": 2}).code == "sharded-twice"


def test_zero_and_experts_ignore_the_tensor_kinds():
    from piper.ir.experts import check
    from piper.ir.lower import zero_levels

    ir = ir_of(TP.replace("shard batch over dp\n", "shard batch over dp\nshard optimizer, grads, params over dp\n"))
    assert zero_levels(ir) == 3
    assert zero_levels(ir_of(TP)) == 0
    check(Program.chain("PP=2"), ir_of(TP))           # no experts sharded: nothing to say


def test_the_hand_built_directive_is_checked_too():
    mesh = Mesh.of({"tp": 2})
    with pytest.raises(PiperError) as info:
        apply_all(initial_ir(Program.chain("PP=1"), mesh), [Shard(("rows",), "tp")])
    assert info.value.diagnostics[0].code == "missing-of"


# ---- stdlib/llama_tensor_parallel.pps

LLAMA = Path(__file__).parents[1] / "stdlib" / "llama_tensor_parallel.pps"


def test_llama_tensor_parallel_is_one_documented_strategy():
    text = LLAMA.read_text()
    assert text.startswith("strategy llama_tensor_parallel(")
    doc = re.search(r'"""(.*?)"""', text, re.S).group(1)
    for part in ("Source:", "Memory per device:", "Communication:", "Limits:", "Use:"):
        assert part in doc, f"the docstring says nothing under {part!r}"
    assert {"axis", "sequence"} <= set(load_strategy(LLAMA).params)


@pytest.mark.parametrize("args, sequence", [("", False), ("sequence=true", True)])
def test_llama_tensor_parallel_by_name(args, sequence):
    ir = ir_of(f"mesh dp=2, tp=2\nuse dp() on dp\nuse llama_tensor_parallel({args}) on tp\n")
    assert ir.tensor_axis() == "tp" and ir.batch_axes() == ("dp",)
    assert ir.tensor_patterns_of("columns") == ("**.q_proj", "**.k_proj", "**.v_proj", "**.gate_proj", "**.up_proj")
    assert ir.tensor_patterns_of("rows") == ("**.o_proj", "**.down_proj")
    assert ir.tensor_patterns_of("vocab") == ("**.embed_tokens", "**.lm_head")
    assert (ir.sharded("sequence") == "tp") == sequence
    span = ir.tensor_patterns[0][2]
    assert span.file.endswith("llama_tensor_parallel.pps"), "a pattern's span is the library file's"


def test_llama_tensor_parallel_on_the_batch_axis_is_refused():
    d = refusal("mesh dp=2, tp=2\nuse dp() on dp\nuse llama_tensor_parallel() on dp\n")
    assert d.code == "unsupported-sharding" and d.hint == "TP needs an axis of its own: mesh dp=2, tp=2"


def test_llama_patterns_pick_every_linear_and_embedding_of_a_hugging_face_llama_once():
    transformers = pytest.importorskip("transformers")
    import torch

    from piper.frontend.modules import match_names

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    ir = ir_of(load_strategy(LLAMA))
    names = [name for name, _ in model.named_modules()]
    kinds: dict[str, list[str]] = {}
    for kind in TENSOR_KINDS:
        for pattern in ir.tensor_patterns_of(kind):
            for name in match_names(pattern, names):
                kinds.setdefault(name, []).append(kind)
    divisible = {name for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    assert set(kinds) == divisible and "lm_head" in kinds, "the top-level lm_head is matched"
    assert all(len(found) == 1 for found in kinds.values())
    assert kinds["lm_head"] == kinds["model.embed_tokens"] == ["vocab"]
    assert kinds["model.layers.1.mlp.down_proj"] == ["rows"]
