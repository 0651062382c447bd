"""Train the example GPT with a composed strategy on a local Ray cluster.

    python examples/train_gpt.py                       # ZeRO-3 + 1F1B on dp=2 x pp=2 (4 CPU workers)
    python examples/train_gpt.py --strategy my.pps --steps 50 --set microbatches=4

Each step is one optimizer step on the global batch; the strategy decides
how the work is cut up, never what is computed: the losses match
single-device training of the same model.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
from rich.console import Console

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import piper  # noqa: E402
from examples.gpt import make_model, training_batches  # noqa: E402
from piper.job.train import fit  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default=os.path.join(HERE, "gpt_zero3_1f1b.pps"))
    parser.add_argument("--mesh", default=None, help="e.g. dp=2,pp=2 (default: the script's own mesh)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--regions", type=int, default=2, help="PP regions in the model (one per pipeline stage)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--layer-regions", action=argparse.BooleanOptionalAction, default=True,
                        help="each block its own region inside its stage, the unit ZeRO gathers and frees")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    console = Console()
    overrides = dict(item.split("=", 1) for item in args.set)

    model, cfg = make_model(n_layer=args.layers, n_regions=args.regions, layer_regions=args.layer_regions)
    stream = training_batches(args.batch_size)
    first = next(stream)
    params = sum(p.numel() for p in model.parameters())
    regions = ", a region per block" if cfg.layer_regions else ""
    console.print(f"[bold]GPT[/] {cfg.n_layer} blocks in {cfg.n_regions} PP regions{regions}, {params:,} parameters; "
                  f"strategy [cyan]{os.path.relpath(args.strategy)}[/]")
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr)
    try:
        with piper.compile(model, first, strategy=args.strategy, mesh=args.mesh, optimizer=optimizer,
                           overrides=overrides or None) as job:
            console.print(f"mesh {job.mesh}: {job.mesh.world_size} workers; plan of rank 0: "
                          f"{' '.join(job.compiled.compute_order(0)[:12])} ...")
            tokens = first[0].numel()
            losses = fit(job, _chain(first, stream), args.steps, tokens_per_batch=tokens, console=console)
    except piper.PiperError as err:
        from piper.render import print_diagnostics

        print_diagnostics(err.diagnostics, file=sys.stderr)
        return 1
    console.print(f"[bold green]done[/]: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps")
    return 0


def _chain(first, rest):
    yield first
    yield from rest


if __name__ == "__main__":
    sys.exit(main())
