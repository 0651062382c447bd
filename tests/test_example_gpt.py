"""The example GPT (examples/gpt.py): it trains, it captures as n_regions tagged PP regions, float64 works."""
from __future__ import annotations

import copy
import importlib
import itertools
import sys
from pathlib import Path

import pytest
import torch

# Plain `pytest` (unlike `python -m pytest`) does not put the repo root, home of examples/, on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import gpt  # noqa: E402
from examples.gpt import GPTConfig, batches, example_batch, make_model  # noqa: E402

# `import piper.annotate as A` would give the function that piper/__init__ re-exports, not the module.
annotate_module = importlib.import_module("piper.frontend.annotate")

SMALL = dict(block_size=32, n_layer=2, n_head=2, n_embd=32, n_regions=2)


def capture(model: gpt.GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.export.ExportedProgram:
    """Strict torch.export on the meta device, as Piper's capture does."""
    annotate_module.reset_counters()
    meta = copy.deepcopy(model).to("meta")
    return torch.export.export(meta, (idx.to("meta"), targets.to("meta")), strict=True)


def test_trains_on_one_device():
    torch.manual_seed(0)
    model, cfg = make_model(**SMALL)
    tokens = gpt._corpus_tokens()[1]
    eval_idx, eval_targets = next(batches(tokens, 32, cfg.block_size, seed=99))
    with torch.no_grad():
        before = model(eval_idx, eval_targets).item()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for idx, targets in itertools.islice(batches(tokens, 16, cfg.block_size, seed=0), 20):
        loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = model(eval_idx, eval_targets).item()
    # Uniform guessing over ~61 characters is ln(61) = 4.1; 20 steps learn the letter frequencies at least.
    assert before == pytest.approx(4.1, abs=0.1)
    assert after < 0.8 * before, (before, after)


@pytest.fixture(scope="module")
def uneven():
    """6 blocks over 4 regions (2, 2, 1, 1), captured once for the tests below."""
    model, cfg = make_model(n_layer=6, n_regions=4)
    return cfg, capture(model, *example_batch(2))


def pp_tags(ep: torch.export.ExportedProgram) -> list[int]:
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    untagged = [str(n.target) for n in nodes if "PP" not in n.meta.get("custom", {})]
    assert untagged == [], f"compute outside any PP region: {untagged}"
    return [n.meta["custom"]["PP"] for n in nodes]


@pytest.mark.parametrize("overrides", [{}, dict(n_layer=3, n_regions=1)])
def test_capture_has_exactly_the_pp_regions(overrides):
    model, cfg = make_model(**overrides)
    tags = pp_tags(capture(model, *example_batch(2, block_size=cfg.block_size)))
    assert set(tags) == set(range(cfg.n_regions))
    assert tags == sorted(tags), "regions must appear in trace order"


def test_uneven_capture_has_exactly_the_pp_regions(uneven):
    cfg, ep = uneven
    tags = pp_tags(ep)
    assert set(tags) == {0, 1, 2, 3}
    assert tags == sorted(tags), "regions must appear in trace order"


def test_every_parameter_belongs_to_one_region(uneven):
    cfg, ep = uneven
    by_node = {spec.arg.name: spec.target for spec in ep.graph_signature.input_specs if spec.target}
    region_of: dict[str, set[int]] = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in by_node:
            region_of[by_node[node.name]] = {u.meta["custom"]["PP"] for u in node.users}
    assert len(region_of) == len(dict(make_model(n_layer=6, n_regions=4)[0].named_parameters()))
    assert all(len(r) == 1 for r in region_of.values()), region_of
    first = {name for name, r in region_of.items() if r == {0}}
    last = {name for name, r in region_of.items() if r == {cfg.n_regions - 1}}
    assert {"wte.weight", "wpe.weight", "blocks.0.ln_1.weight", "blocks.1.mlp.2.bias"} <= first
    assert {"ln_f.weight", "lm_head.weight", "blocks.5.attn.c_attn.weight"} <= last
    assert "blocks.2.ln_1.weight" not in first | last


def test_region_blocks_split_evenly_first_regions_take_the_extra():
    assert GPTConfig(vocab_size=8, n_layer=6, n_regions=4).region_blocks == (
        range(0, 2), range(2, 4), range(4, 5), range(5, 6))
    assert GPTConfig(vocab_size=8, n_layer=4, n_regions=1).region_blocks == (range(0, 4),)


def test_float64():
    model, cfg = make_model(**SMALL)
    idx, targets = example_batch(4, block_size=cfg.block_size)
    loss32 = model(idx, targets)
    model64 = copy.deepcopy(model).to(torch.float64)
    loss64 = model64(idx, targets)
    loss64.backward()
    assert loss64.dtype == torch.float64
    assert loss64.item() == pytest.approx(loss32.item(), abs=1e-5)
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in model64.parameters())
    # Built as float64 from the start: the same weights (initialised in float32, then cast).
    built64, _ = make_model(**SMALL, dtype=torch.float64)
    assert built64(idx, targets).item() == loss64.item()


def test_batches_are_deterministic_and_shifted():
    tokens = torch.arange(1000)
    a = list(itertools.islice(batches(tokens, 4, 16, seed=3), 3))
    b = list(itertools.islice(batches(tokens, 4, 16, seed=3), 3))
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    idx, targets = a[0]
    assert idx.shape == targets.shape == (4, 16)
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    with pytest.raises(ValueError, match="smaller block_size"):
        next(batches(torch.arange(10), 2, 10, seed=0))


def test_tokenizer_round_trips_the_corpus():
    tok = gpt.CharTokenizer(gpt.load_corpus())
    text = gpt.load_corpus()[:500]
    assert tok.decode(tok.encode(text)) == text
    assert 40 <= tok.vocab_size <= 100
    assert 50_000 <= len(gpt.load_corpus()) <= 200_000
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("~")


def test_small_gpt_matches_example_batch():
    model = gpt.small_gpt()
    idx, targets = example_batch()
    assert idx.shape == (8, model.cfg.block_size)
    assert model(idx, targets).ndim == 0


@pytest.mark.parametrize("overrides, message", [
    (dict(n_layer=2, n_regions=4), "n_layer >= 4 or n_regions <= 2"),
    (dict(n_embd=65, n_head=4), "multiple of n_head"),
    (dict(n_regions=0), "n_regions=0 must be at least 1"),
    (dict(vocab_size=0), "vocab_size=0 must be at least 1"),
    (dict(dtype=torch.int64), "not a floating-point type"),
])
def test_config_errors_name_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{"vocab_size": 61, **overrides})


@pytest.mark.usefixtures("ray_cluster")
def test_the_main_job_trains_with_a_region_per_block_and_without():
    # README's main job: examples/train_gpt.py, ZeRO-3 + 1F1B on dp=2 x pp=2.
    from examples.train_gpt import main

    assert main(["--steps", "2", "--batch-size", "16"]) == 0
    assert main(["--steps", "2", "--batch-size", "16", "--no-layer-regions"]) == 0
