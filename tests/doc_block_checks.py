"""What each ```python block of README.md and docs/ shows, where the block has no assert of its own:
`tests/test_docs.py::test_python_blocks_run` runs the block, then the check found by a line of it (a
block's index moves as its page changes) with the block's globals and the lines it printed.

A block with neither an assert nor a check here fails that test: say what it shows, here or in it.
"""
from __future__ import annotations

import math
import sys
import types

import torch


def _capture_in(ns: dict, model, batch):
    """capture(model, batch) for a model whose class the block defined: TorchDynamo looks it up in
    its module, gone once the block has run."""
    from piper.frontend.capture import capture

    module = types.ModuleType(ns["__name__"])
    module.__dict__.update(ns)
    sys.modules[module.__name__] = module
    try:
        return capture(model, batch)
    finally:
        del sys.modules[module.__name__]


def readme_zero3_pp2(ns: dict, printed: list[str]) -> None:
    """One step's loss is the model's loss on the global batch before the step; `job.state_dict()`
    holds full parameters under model.state_dict()'s keys, moved by the step."""
    model, x, y, state = ns["model"], ns["x"], ns["y"], ns["state"]
    with torch.no_grad():               # piper.compile trains copies: `model` keeps its first weights
        torch.testing.assert_close(ns["loss"], model(x, y).item(), rtol=1e-5, atol=1e-6)
    expected = model.state_dict()
    assert state.keys() == expected.keys()
    assert all(state[k].shape == v.shape for k, v in expected.items())
    assert any(not torch.equal(state[k], v) for k, v in expected.items())     # an AdamW step moved them


def guide_regions(ns: dict, printed: list[str]) -> None:
    """The printed region labels are the ones in the block's comment."""
    assert printed == ["['PP=0', 'PP=1']"]


def guide_pipeline(ns: dict, printed: list[str]) -> None:
    """Three 1F1B steps train (the loss falls) and the weights come back whole."""
    losses, weights = ns["losses"], ns["weights"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert printed == [f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"]
    expected = ns["TwoStage"]().state_dict()
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in expected.items()}


def expert_parallel_top_one(ns: dict, printed: list[str]) -> None:
    """The layer keeps the tokens' shape, as the block's comment says, and equals its dense formula:
    each token through its one expert, scaled by its gate."""
    assert printed == ["torch.Size([5, 8])"]
    layer = ns["TopOneMoE"](dim=8, hidden=16, num_experts=4)
    x = torch.randn(5, 8)
    gates, experts = torch.softmax(layer.router(x), -1).topk(1, dim=-1)
    dense = torch.stack([gates[t, 0] * (torch.relu(x[t] @ layer.w_in[e]) @ layer.w_out[e])
                         for t, e in enumerate(experts[:, 0].tolist())])
    torch.testing.assert_close(layer(x), dense)


def models_llama_regions(ns: dict, printed: list[str]) -> None:
    """annotate_modules gives two PP stages and an L region per block inside its stage."""
    idx = torch.randint(0, 64, (2, 8))
    labels = [r.label for r in _capture_in(ns, ns["model"], (idx, idx)).regions]
    assert labels == ["PP=0", "PP=0 L=0", "PP=0 L=1", "PP=1 L=2", "PP=1 L=3", "PP=1"]


def optimizers_muon_zero3(ns: dict, printed: list[str]) -> None:
    """Under ZeRO-3 the two devices hold one copy of the optimizer state between them: Muon's
    momentum (P) for the matrices, AdamW's two moments (2P) for the rest."""
    model, held = ns["model"], ns["held"]
    matrices = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".weight") and p.dim() == 2)
    rest = sum(p.numel() for p in model.parameters()) - matrices
    assert sorted(held) == [0, 1] and math.isfinite(ns["loss"])
    assert sum(h["optimizer"] for h in held.values()) == 4 * (matrices + 2 * rest)     # float32


def own_model_file(ns: dict, printed: list[str]) -> None:
    """The file works on its own: the model returns a scalar loss on its example batch."""
    x, y = ns["example_batch"](8)
    assert x.shape == (8, 16) and y.shape == (8,)
    assert ns["model"](x, y).dim() == 0 and len(printed) == 1 and printed[0].startswith("tensor(")


def training_token_files(ns: dict, printed: list[str]) -> None:
    """Three steps and an evaluation on random tokens: every loss near ln 64, the uniform guess
    (nothing in random tokens to learn), none of them NaN."""
    step, loss, val = printed[0].split()
    assert int(step) == 2
    for value in (float(loss), float(val)):
        assert abs(value - math.log(64)) < 0.1, printed


# A line of the block -> its check.
CHECKS = {
    "def zero3_pp2(s):": readme_zero3_pp2,
    "program = capture(TwoStage()": guide_regions,
    "losses = [job.step(x, y) for _ in range(3)]": guide_pipeline,
    "class TopOneMoE(": expert_parallel_top_one,
    'piper.annotate_modules(model, "L"': models_llama_regions,
    "held = job.memory()": optimizers_muon_zero3,
    "# my_model.py": own_model_file,
    "job.evaluate(batches=2)": training_token_files,
}


def checks_for(code: str) -> list:
    return [check for line, check in CHECKS.items() if line in code]
