"""How a strategy's directives cut the global batch: into microbatches (`split MB`) and data-parallel
shards (`shard batch`), and the example inputs cut to one microbatch for capture.

    microbatches, shards = split_counts(mesh, directives)           # (4, 2) for split MB into 4, dp=2
    inputs, microbatches, shards, batch = microbatch_inputs(example_inputs, mesh, directives)

In the front end, below the compiler (`compiler.analysis` plans from them) and the driver (`piper.job`).
"""
from __future__ import annotations

from ..diagnostics import error
from ..lazy import LazyModule
from ..mesh import Mesh
from .directives import Shard, Split

torch = LazyModule("torch")


def split_counts(mesh: Mesh, directives) -> tuple[int, int]:
    """(microbatches, batch shards) the directives cut the global batch into."""
    microbatches = next((d.count for d in directives if isinstance(d, Split) and d.what == "MB"), 1)
    shards = 1
    for d in directives:
        if isinstance(d, Shard) and "batch" in d.what:
            shards *= mesh.size(d.over)
    return microbatches, shards


def microbatch_inputs(example_inputs, mesh: Mesh, directives):
    """Cut the global example batch to one microbatch: export fixes shapes."""
    microbatches, shards = split_counts(mesh, directives)
    sizes = {int(x.shape[0]) for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise error("bad-inputs", "every example input needs the same batch size in dimension 0",
                    hint="pass (inputs, targets) with one row per example")
    batch = sizes.pop()
    if batch % (microbatches * shards):
        raise error("indivisible-batch", f"the global batch of {batch} does not divide into {microbatches} "
                    f"microbatch(es) x {shards} data-parallel shard(s)",
                    hint=f"use a batch size that is a multiple of {microbatches * shards}")
    size = batch // (microbatches * shards)
    return tuple(x[:size] for x in example_inputs), microbatches, shards, batch
