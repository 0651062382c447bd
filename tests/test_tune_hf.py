"""`piper tune` and `piper simulate` on Hugging Face models (tiny configs, no download): the repo's
tiny Llama, a Llama whose vocabulary divides over tp, and a Qwen3-MoE; tune's expert and sequence
parallelism on them."""
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from piper.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DENSE = "examples/train_hf.py:tiny_llama"         # 61 characters of vocabulary: no tp size divides it

MODELS = """
import sys
sys.path.insert(0, %r)
import torch
import transformers

import hf_moe_models as hf
import piper


def qwen3_moe():
    model = hf.make("qwen3_moe", layers=2, dtype=torch.float32)       # 4 experts, top 2
    piper.annotate_modules(model, "PP", hf.stages(model, 2))
    return model


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=hf.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=hf.SEQ)
    model = hf.CausalLM(transformers.LlamaForCausalLM(cfg))
    piper.annotate_modules(model, "PP", hf.stages(model, 2))
    return model


def example_batch(b):
    return hf.batches(1, b)[0]
""" % str(ROOT / "tests")

EP_SCRIPT = "mesh dp=2, pp=2\nuse one_f_one_b(microbatches=4) on pp\nuse dp() on dp\nuse expert_parallel() on dp\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "hf_models.py"
    path.write_text(MODELS)
    return path


@pytest.fixture(scope="module")
def _cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def cache(_cache_dir, monkeypatch):
    """One cost cache for this module's searches: each model's regions are timed once."""
    monkeypatch.setenv("PIPER_CACHE", str(_cache_dir))


def _tune(args, capsys) -> dict:
    assert main(["tune", *args, "--no-calibrate", "--format", "json", "--top", "1000"]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_a_hugging_face_dense_and_moe_model(models, tmp_path, capsys):
    """The memory model runs the regions on the CPU: their rotary positions and masks were captured
    as `arange(..., device=meta)` (an internal error before)."""
    assert main(["simulate", "examples/gpt_zero3_1f1b.pps", "--model", DENSE]) == 0
    assert "predicted step" in " ".join(capsys.readouterr().out.split())
    script = tmp_path / "ep.pps"
    script.write_text(EP_SCRIPT)
    assert main(["simulate", str(script), "--model", f"{models}:qwen3_moe"]) == 0
    assert "predicted step" in " ".join(capsys.readouterr().out.split())


def test_tune_a_hugging_face_dense_model(capsys, tmp_path):
    best = tmp_path / "best.pps"
    found = _tune(["--model", DENSE, "--devices", "2", "--memory", "1GiB", "--batch-size", "4", "-o", str(best)],
                  capsys)
    rows = found["strategies"]
    assert rows and all(r["peak_bytes"] <= 2**30 and r["step_s"] > 0 for r in rows)
    assert {r["mesh"]["pp"] for r in rows} == {1, 2} and rows[0]["script"] in best.read_text()
    assert not any(r["expert_parallel"] for r in rows)                 # no MoE layer: no EP searched
    assert found["skipped"] == []


def test_tune_searches_expert_parallelism_on_a_moe_model(models, capsys):
    """Each dp > 1 candidate also with its experts divided over dp: fewer parameter bytes per device
    than the same without; a dp the experts do not divide over is skipped with the reason."""
    from piper.compiler.tune import Candidate, Search
    from piper.compiler.tune_parallel import skip_summary

    spec = f"{models}:qwen3_moe"
    rows = _tune(["--model", spec, "--devices", "4", "--memory", "1GiB", "--batch-size", "8"], capsys)["strategies"]
    ep = [r for r in rows if r["expert_parallel"]]
    assert ep and all("use expert_parallel() on dp" in r["script"] and r["mesh"]["dp"] > 1 for r in ep)
    assert {r["mesh"]["dp"] for r in ep} == {2, 4}
    key = ("mesh", "schedule", "microbatches", "data_parallel", "recompute")
    plain = {tuple(str(r[k]) for k in key): r for r in rows if not r["expert_parallel"]}
    pairs = [(r, plain[tuple(str(r[k]) for k in key)]) for r in ep if tuple(str(r[k]) for k in key) in plain]
    assert pairs and all(e["memory"]["params"] < p["memory"]["params"] for e, p in pairs)
    # 4 experts over dp=8: skipped, and why
    search = Search(spec, 8, 2**30, 8)
    assert search.evaluate(Candidate(8, 1, None, 1, None, "dp", experts=True)) is None
    (entry,) = skip_summary(search.skipped)
    assert entry["what"] == "expert parallelism over dp=8" and "do not divide" in entry["reason"]
    assert search.evaluate(Candidate(8, 1, None, 1, None, "dp")) is not None


def test_tune_searches_sequence_parallelism_and_says_why_a_size_is_skipped(models, capsys):
    """With llama_tensor_parallel, each tp > 1 candidate also with `sequence=true`; SP holds fewer
    activations than TP alone; tp=4 (2 key/value heads) is skipped with the capture's reason, in
    the JSON and under the table."""
    from piper.compiler.tune import Candidate, Search

    spec = f"{models}:llama"
    args = ["--model", spec, "--devices", "4", "--memory", "1GiB", "--batch-size", "8",
            "--tensor-parallel", "llama_tensor_parallel"]
    found = _tune(args, capsys)
    rows = found["strategies"]
    assert any(r["sequence_parallel"] and "use llama_tensor_parallel(sequence=true) on tp" in r["script"]
               and r["mesh"]["tp"] == 2 for r in rows)
    assert any(not r["sequence_parallel"] and r["mesh"]["tp"] == 2 for r in rows)
    skipped = {s["what"]: s for s in found["skipped"]}
    assert set(skipped) == {"tp=4", "tp=4 sp"} and all(s["reason"] and s["candidates"] for s in skipped.values())
    assert main(["tune", *args, "--no-calibrate"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"skipped tp=4 ({skipped['tp=4']['candidates']} candidates): {' '.join(skipped['tp=4']['reason'].split())}" \
        in text
    search = Search(spec, 4, 2**30, 8, tensor="llama_tensor_parallel")
    tp, sp = (search.evaluate(Candidate(1, 2, "one_f_one_b", 2, tp=2, tensor="llama_tensor_parallel", sequence=s))
              for s in (False, True))
    assert sp.memory["activations"] < tp.memory["activations"]
