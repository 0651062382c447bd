"""`piper check --model` on meshes a script check takes: it answers with diagnostics, in work that
does not grow with the mesh (issue 42, item 9). A batch sharded over one axis many times asked for
dp^k example rows (35 TB at dp=8,193, k=3; an overflow at k=8,192) before the plan said
`sharded-twice`; a mesh of 131,072 devices made every device's plan (37 s)."""
from __future__ import annotations

import json

import pytest

from piper.cli import main
from piper.compiler import plans as plans_module
from piper.mesh import Mesh

MODEL = "examples/llama_tp.py:make_model"
TP = ('shard columns of "blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.mlp.gate", '
      '"blocks.*.mlp.up" over tp\nshard rows of "blocks.*.attn.o", "blocks.*.mlp.down" over tp\n'
      'shard vocab of "embed", "head" over tp\n')


def _check(tmp_path, capsys, text: str) -> tuple[int, list[str]]:
    path = tmp_path / "mesh.pps"
    path.write_text(text)
    code = main(["check", "--format", "json", str(path), "--model", MODEL])
    out = capsys.readouterr().out
    return code, [d["code"] for d in json.loads(out or "[]")]


@pytest.mark.parametrize("text", [
    "mesh dp=8193, tp=2\nuse dp()\nuse dp()\nuse dp()\n" + TP,
    "mesh dp=2, tp=2\nfor q in 0..8192: use dp() on dp\n" + TP,
])
def test_a_batch_sharded_over_one_axis_again_is_a_diagnostic_not_an_allocation(tmp_path, capsys, text):
    code, codes = _check(tmp_path, capsys, text)
    assert code == 1 and codes == ["sharded-twice"], codes


def test_a_big_mesh_makes_the_plans_of_one_replica_only(tmp_path, capsys, monkeypatch):
    made, coords = [], []
    plan = plans_module.Plans._plan
    monkeypatch.setattr(plans_module.Plans, "_plan", lambda self, rank: made.append(rank) or plan(self, rank))
    mesh_coords = Mesh.coords
    monkeypatch.setattr(Mesh, "coords", lambda self, rank: coords.append(rank) or mesh_coords(self, rank))
    code, codes = _check(tmp_path, capsys, "mesh dp=4096, tp=2\nuse dp()\n" + TP)
    assert code == 0 and codes == [], codes
    assert len(made) <= 4, len(made)             # 8,192 before: every device's plan
    assert len(coords) <= 64, len(coords)        # 8,192 x 4 before: a dict per device per pass


def test_a_batch_size_that_the_shards_do_not_divide_is_said_before_the_batch_is_made():
    from piper.compiler.analysis import compile_script
    from piper.diagnostics import PiperError
    from piper.dsl import load_strategy

    script = load_strategy("mesh dp=8193, tp=2\nuse dp()\n" + TP, file="case.pps")
    with pytest.raises(PiperError) as err:
        compile_script(script, model_spec=MODEL, batch_size=10 ** 15)
    assert err.value.diagnostics[0].code == "indivisible-batch"


def test_a_shard_line_in_a_loop_matches_its_patterns_once(tmp_path, capsys, monkeypatch):
    """8,193 turns of the 7 patterns matched 57,351 patterns against the model's names (past 5 s)."""
    import piper.frontend.tensor_parallel as tensor_parallel

    calls, match = [], tensor_parallel.match_names
    monkeypatch.setattr(tensor_parallel, "match_names", lambda *args: calls.append(args[0]) or match(*args))
    lines = TP.replace("shard", "    shard").replace('    shard vocab of "embed", "head" over tp\n', "")
    code, codes = _check(tmp_path, capsys, "mesh tp=2\nfor q in 0..50:\n" + lines)
    assert codes == ["sharded-twice"], codes       # said by the plan, after the model's capture
    assert len(calls) == len(set(calls)) == 7, len(calls)
