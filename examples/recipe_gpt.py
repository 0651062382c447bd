"""The example GPT trained from a token file with a full pretraining recipe: parameter groups
(weight decay on matrices only), warmup then cosine, data read by the workers, a validation loss
every few steps; the loss curve is drawn as an SVG.

    python examples/recipe_gpt.py [--steps 300] [--svg docs/recipe_loss.svg] [--json loss.json]

The corpus (examples/data/corpus.txt) is written as nanoGPT's train.bin / val.bin (uint16 token
ids, 90% / 10%), then `piper.data.TokenFile` reads it on each worker.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

# `python examples/recipe_gpt.py` puts examples/ first on the path, not the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import piper  # noqa: E402
import piper.data  # noqa: E402
from examples.gpt import _corpus_tokens, make_model  # noqa: E402
from piper.dsl import load_strategy  # noqa: E402


def write_token_files(folder: str) -> tuple[str, str]:
    tokens = _corpus_tokens()[1].numpy().astype(np.uint16)
    cut = int(len(tokens) * 0.9)
    train, val = os.path.join(folder, "train.bin"), os.path.join(folder, "val.bin")
    tokens[:cut].tofile(train)
    tokens[cut:].tofile(val)
    return train, val


def svg(train: list[float], evals: list[tuple[int, float]], width=640, height=360) -> str:
    """A plain SVG line chart of the training loss (blue) and the validation loss (orange dots)."""
    pad = 48
    values = train + [v for _, v in evals]
    lo, hi = min(values), max(values)
    n = max(1, len(train) - 1)

    def x(step):
        return pad + (width - 2 * pad) * step / n

    def y(value):
        return height - pad - (height - 2 * pad) * (value - lo) / max(hi - lo, 1e-9)

    line = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(train))
    dots = "".join(f'<circle cx="{x(s - 1):.1f}" cy="{y(v):.1f}" r="3.5" fill="#e67e22"/>' for s, v in evals)
    ticks = "".join(f'<text x="{pad - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">{v:.2f}</text>'
                    for v in np.linspace(lo, hi, 5))
    steps = "".join(f'<text x="{x(s):.1f}" y="{height - pad + 16}" font-size="11" text-anchor="middle">{s}</text>'
                    for s in np.linspace(0, n, 6).astype(int))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">'
            f'<rect width="100%" height="100%" fill="white"/>'
            f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#999"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#999"/>{ticks}{steps}'
            f'<polyline points="{line}" fill="none" stroke="#2e86de" stroke-width="1.5"/>{dots}'
            f'<text x="{width / 2}" y="20" font-size="13" text-anchor="middle">example GPT from a token file: '
            f'train loss (line), validation loss (dots)</text>'
            f'<text x="{width / 2}" y="{height - 10}" font-size="11" text-anchor="middle">step</text></svg>')


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--svg", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="piper-recipe-")
    train_bin, val_bin = write_token_files(folder)
    model, cfg = make_model(n_layer=4, n_regions=2)
    train = piper.data.TokenFile(train_bin, cfg.block_size)
    val = piper.data.TokenFile(val_bin, cfg.block_size)
    optimizer = piper.param_groups(torch.optim.AdamW, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95),
                                   no_decay=("**.bias", "**.ln_*.weight", "wpe.weight"))
    strategy = load_strategy("use one_f_one_b(microbatches=4) on pp\nuse zero1() on dp\n")
    losses, evals = [], []
    with piper.compile(model, None, strategy=strategy, mesh={"dp": 2, "pp": 2}, optimizer=optimizer,
                       lr_schedule=piper.warmup_cosine(args.steps // 10, args.steps), data=train,
                       batch_size=args.batch_size, shuffle=True, seed=0, val_data=val, clip_grad_norm=1.0) as job:
        for step in range(1, args.steps + 1):
            losses.append(job.step())
            if step % args.eval_every == 0 or step == args.steps:
                evals.append((step, job.evaluate(batches=4)))
                print(f"step {step:4d}  train {losses[-1]:.4f}  val {evals[-1][1]:.4f}", flush=True)
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(svg(losses, evals))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"train": losses, "val": evals}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
