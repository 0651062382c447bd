"""Train a Hugging Face causal LM, as the library wrote it, with ZeRO-3 x 1F1B.

    python examples/train_hf.py                    # tiny Llama, dp=2 x pp=2 (4 CPU workers)
    python examples/train_hf.py --family gpt2      # GPT-2: its tied embedding sits on both stages
    piper show examples/gpt_zero3_1f1b.pps --model examples/train_hf.py:tiny_llama --what ir

The model is built from a tiny config (no download) on the bundled corpus's
characters. Nothing in its code changes: `piper.annotate_modules` names the
modules of each pipeline stage (`PP`) and of each block (`L`, so ZeRO-3
gathers one block at a time), and what runs outside them (rotary tables,
the attention mask, the loss) joins the region that first uses it.
Needs `transformers` (the `test` extra: pip install -e '.[test]').
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F
from rich.console import Console

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import piper  # noqa: E402
from examples.gpt import _corpus_tokens, training_batches  # noqa: E402
from piper.job.train import fit  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ = 64


class CausalLM(torch.nn.Module):
    """Forward returns the loss, as Piper asks; the model inside is untouched."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, idx, targets):
        logits = self.m(input_ids=idx).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(family: str = "llama", layers: int = 4, stages: int = 2, seed: int = 0, *, hidden: int = 64,
          heads: int = 4) -> CausalLM:
    """A tiny `family` model cut into `stages` PP regions of whole blocks, a region per block inside."""
    import transformers

    vocab = _corpus_tokens()[0].vocab_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if family == "llama":
            cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                           num_hidden_layers=layers, num_attention_heads=heads,
                                           num_key_value_heads=max(1, heads // 2), max_position_embeddings=SEQ)
            model = CausalLM(transformers.LlamaForCausalLM(cfg))
            embed, block, tail = ["m.model.embed_tokens"], "m.model.layers.{}", ["m.model.norm", "m.lm_head"]
        elif family == "gpt2":
            cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                          n_positions=SEQ, bos_token_id=0, eos_token_id=0)
            model = CausalLM(transformers.GPT2LMHeadModel(cfg))
            embed, block, tail = ["m.transformer.wte", "m.transformer.wpe"], "m.transformer.h.{}", [
                "m.transformer.ln_f", "m.lm_head"]
        else:
            raise ValueError(f"unknown family {family!r}: llama or gpt2")
    per = layers // stages
    groups = [[block.format(i) for i in range(s * per, (s + 1) * per)] for s in range(stages)]
    groups[0][:0] = embed
    groups[-1] += tail
    piper.annotate_modules(model, "PP", groups)                                  # a region per stage
    piper.annotate_modules(model, "L", [[block.format(i)] for i in range(layers)])   # and per block
    return model


def tiny_llama() -> CausalLM:
    """For `--model examples/train_hf.py:tiny_llama`."""
    return build("llama")


def example_batch(batch_size: int):
    return next(training_batches(batch_size))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--strategy", default=os.path.join(HERE, "gpt_zero3_1f1b.pps"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    console = Console()
    model = build(args.family, args.layers)
    stream = training_batches(args.batch_size)
    first = next(stream)
    params = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]{type(model.m).__name__}[/] {args.layers} blocks in 2 stages, {params:,} parameters; "
                  f"strategy [cyan]{os.path.relpath(args.strategy)}[/]")
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr)
    try:
        with piper.compile(model, first, strategy=args.strategy, optimizer=optimizer) as job:
            console.print(f"mesh {job.mesh}: {job.mesh.world_size} workers; regions "
                          f"{', '.join(r.label for r in job.program.regions)}")
            losses = fit(job, _chain(first, stream), args.steps, tokens_per_batch=first[0].numel(), console=console)
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
