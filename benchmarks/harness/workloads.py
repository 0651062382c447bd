"""What the suites run: model sizes, Piper strategies, stdlib look-up, and the
per-stage modules the torch.distributed baselines build from the same GPT code.

Every comparison builds both systems from `examples.gpt.make_model` with the
same seed, so both start from identical weights and see identical batches.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import piper
from examples.strategies import one_f_one_b_order

REPO = Path(__file__).resolve().parents[2]
STDLIB = REPO / "stdlib"


# -- models -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTWorkload:
    """One example-GPT configuration and its global batch.

    `model_kw` goes to `examples.gpt.make_model`; `n_regions` is set per run
    (one region per pipeline stage), so the same blocks are cut the same way
    for Piper and for torch.
    """

    n_layer: int = 8
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 64
    batch: int = 32                      # global batch (sequences)
    dtype: str = "float32"

    def model_kw(self, n_regions: int) -> dict:
        return {"n_layer": self.n_layer, "n_embd": self.n_embd, "n_head": self.n_head,
                "block_size": self.block_size, "n_regions": n_regions, "dtype": getattr(torch, self.dtype)}

    def describe(self, n_regions: int | None = None) -> str:
        regions = f", {n_regions} regions" if n_regions else ""
        return (f"GPT n_layer={self.n_layer} n_embd={self.n_embd} n_head={self.n_head} T={self.block_size}"
                f"{regions}, global batch {self.batch}, {self.dtype}, AdamW lr=1e-3")


def make_gpt(model_kw: dict):
    from examples.gpt import make_model

    model, cfg = make_model(seed=0, **model_kw)
    return model, cfg


def gpt_batches(workload: GPTWorkload, count: int, *, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (idx, targets) global batches from the bundled corpus."""
    from examples.gpt import _corpus_tokens, batches

    stream = batches(_corpus_tokens()[1], workload.batch, workload.block_size, seed=seed)
    return [next(stream) for _ in range(count)]


@dataclass(frozen=True)
class HFWorkload:
    """A Hugging Face causal LM as the library wrote it (`examples/train_hf.py`: tiny
    config, no download), cut into stages by `piper.annotate_modules`, a region per
    block inside each stage. Needs `transformers` (the `test` extra)."""

    family: str = "llama"                # or "gpt2" (tied embeddings across the first and last stage)
    layers: int = 8
    hidden: int = 128
    heads: int = 4
    batch: int = 32                      # global batch (sequences of examples.train_hf.SEQ tokens)

    def describe(self, stages: int) -> str:
        return (f"HF {self.family} layers={self.layers} hidden={self.hidden} heads={self.heads}, {stages} stages, "
                f"global batch {self.batch}, AdamW lr=1e-3")


def make_hf(workload: HFWorkload, stages: int):
    """(model, batches): the annotated model and a stream of (idx, targets) of the corpus."""
    from examples.gpt import training_batches
    from examples.train_hf import build

    model = build(workload.family, workload.layers, stages, hidden=workload.hidden, heads=workload.heads)
    return model, training_batches(workload.batch)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class GPTStage(nn.Module):
    """Region `region` of an `examples.gpt.GPT` as a standalone module for `PipelineStage`.

    It reuses the GPT's own submodules, so the computation is the one Piper
    captures from `GPT.forward`: embeddings on the first stage, the region's
    blocks, and the final LayerNorm and lm head on the last (the loss is the
    schedule's `loss_fn`, `gpt_loss`).
    """

    def __init__(self, gpt, region: int):
        super().__init__()
        cfg = gpt.cfg
        self.first = region == 0
        self.last = region == cfg.n_regions - 1
        if self.first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in cfg.region_blocks[region])
        if self.last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss (mean cross-entropy over the microbatch's tokens), as `GPT.forward` computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def region_modules(gpt, region: int) -> list[nn.Module]:
    """The submodules whose parameters Piper puts in region `region`'s flat unit (for FSDP2 grouping)."""
    cfg = gpt.cfg
    mods: list[nn.Module] = []
    if region == 0:
        mods += [gpt.wte, gpt.wpe]
    mods += [gpt.blocks[i] for i in cfg.region_blocks[region]]
    if region == cfg.n_regions - 1:
        mods += [gpt.ln_f, gpt.lm_head]
    return mods


class LinearChain(nn.Module):
    """`regions` tiny regions, each one `width x width` linear (the last also the MSE loss).

    The overhead suite uses it: compute per action is a few microseconds, so
    step time is almost all dispatch.
    """

    def __init__(self, regions: int = 8, width: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(regions))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            with piper.annotate("PP"):
                x = layer(x)
                if i == last:
                    loss = ((x - y) ** 2).mean()
        return loss


def make_chain(regions: int = 8, width: int = 4, *, seed: int = 0) -> LinearChain:
    """A LinearChain with seeded weights (a forked RNG: the global one is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LinearChain(regions, width)


class ChainStage(nn.Module):
    """Stage `stage` of `stages` of a LinearChain: a contiguous run of its layers (the loss is `chain_loss`)."""

    def __init__(self, chain: LinearChain, stage: int, stages: int):
        super().__init__()
        n = len(chain.layers)
        self.layers = nn.ModuleList(chain.layers[stage * n // stages:(stage + 1) * n // stages])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def chain_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


# -- Piper strategies (the same helpers tests/test_train.py uses) ---------------------------------

one_f_one_b = one_f_one_b_order


def pipeline(microbatches: int, *, order=None, regions_per_device: int = 1, regions: int | None = None,
             contiguous: bool = False, device_orders: dict[int, list[str]] | None = None,
             batch_axis: str | None = None):
    """A pipeline strategy over mesh axis `pp`.

    `order(stage, stages, microbatches)` gives a per-stage order (1F1B);
    `device_orders[rank]` a whole device's order over several regions
    (items carry `PP=` tags, e.g. an interleaved schedule). There are
    `regions` regions (default p * regions_per_device); they go
    round-robin (`PP=r` on `pp[r % p]`, as interleaved schedules place them)
    unless `contiguous` (`PP=r` on `pp[r * p // regions]`). `batch_axis`
    adds `shard batch over <axis>` (data parallel across pipelines).
    """

    @piper.strategy
    def strategy(s):
        p = s.size("pp")
        total = regions or p * regions_per_device
        s.split("MB", microbatches)
        for r in range(total):
            s.place(f"PP={r}", s.mesh["pp"][r * p // total if contiguous else r % p])
        if order:
            for stage in range(p):
                s.order(f"PP={stage}", order(stage, p, microbatches))
        for rank, items in (device_orders or {}).items():
            s.order(f"PP={rank}", items)
        if batch_axis:
            s.shard("batch", over=batch_axis)

    return strategy


def data_parallel(*what: str, microbatches: int = 1):
    """`shard batch over dp` plus `shard <what> over dp` (ZeRO-1/2/3), as tests/test_train.py."""

    @piper.strategy
    def strategy(s):
        if microbatches > 1:
            s.split("MB", microbatches)
        s.shard("batch", over="dp")
        if what:
            s.shard(*what, over="dp")

    return strategy


ZERO = {"dp": (), "zero1": ("optimizer",), "zero2": ("optimizer", "grads"),
        "zero3": ("optimizer", "grads", "params")}


def torch_schedule_order(schedule_name: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list[str]]:
    """A torch.distributed.pipelining schedule's per-rank compute order, as Piper order items.

    Uses `get_schedule_ops` (no process group needed). F -> `F(PP=s, MB=m)`,
    full backward -> `B(PP=s, MB=m)`. Raises ValueError for actions Piper's
    order cannot express without `split B` (I/W, overlapped F/B).
    """
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    cls = getattr(schedules, schedule_name)
    ops = get_schedule_ops(cls, pp, microbatches, num_stages_per_rank=stages_per_rank)
    out: dict[int, list[str]] = {}
    for rank, actions in enumerate(ops):
        items = []
        for a in actions:
            if a is None:
                continue
            kind = a.computation_type.name
            if kind in ("REDUCE_GRAD", "UNSHARD", "RESHARD") or kind.startswith(("SEND", "RECV")):
                continue      # bookkeeping and communication: Piper's compiler inserts its own
            name = {"FORWARD": "F", "FULL_BACKWARD": "B"}.get(kind)
            if name is None:
                raise ValueError(f"{schedule_name} uses action {kind}, which this translation does not map")
            items.append(f"{name}(PP={a.stage_index}, MB={a.microbatch_index})")
        out[rank] = items
    return out


# -- the standard library ------------------------------------------------------------------------

STDLIB_NAMES = {
    "gpipe": ("gpipe",),
    "1f1b": ("one_f_one_b", "1f1b", "onefoneb"),
    "interleaved": ("interleaved_1f1b", "interleaved_one_f_one_b", "interleaved"),
    "zbv": ("zbv", "zb_v", "zero_bubble_v", "zbv_zero_bubble", "zerobubblev"),
    "dualpipev": ("dualpipev", "dualpipe_v", "dual_pipe_v"),
    "dp": ("dp", "data_parallel"),
    "zero1": ("zero1",),
    "zero2": ("zero2",),
    "zero3": ("zero3",),
}


@dataclass
class StdlibStrategy:
    """A stdlib script found for a schedule: the path, and why it cannot be used (if so)."""

    path: Path | None
    strategy: object = None
    problem: str | None = None
    params: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return self.strategy is not None and self.problem is None


def find_stdlib(kind: str, *, microbatches: int, mesh: dict) -> StdlibStrategy:
    """Find and load `stdlib/<name>.pps` for `kind` ('1f1b', 'zbv', ...), bound to `microbatches`.

    Loading and building against `mesh` are tried here, so a script that is
    present but does not load yet is reported, not run.
    """
    files = sorted(STDLIB.glob("*.pps"))
    wanted = STDLIB_NAMES[kind]
    path = next((f for name in wanted for f in files if f.stem.lower().replace("-", "_") == name), None)
    if path is None:
        return StdlibStrategy(None, problem=f"no stdlib/{wanted[0]}.pps yet")
    try:
        from piper.dsl import load_strategy
        from piper.mesh import Mesh

        script = load_strategy(path)
        params = list(script.params)
        if "microbatches" in params:
            script = script.bind(microbatches=microbatches)
        script.build(Mesh.of(mesh))
        return StdlibStrategy(path, script, params=params)
    except Exception as exc:  # a script still being written: report it, run nothing
        text = str(exc).strip().splitlines()
        return StdlibStrategy(path, problem=f"{path.name} does not load: {text[0] if text else type(exc).__name__}")


@functools.lru_cache(maxsize=None)
def corpus_vocab() -> int:
    from examples.gpt import _corpus_tokens

    return _corpus_tokens()[0].vocab_size


# -- one pipeline schedule, as Piper runs it ------------------------------------------------------

PIPELINE_SCHEDULES = {
    # kind: (torch schedule class, stages per rank)
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved": ("ScheduleInterleaved1F1B", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipev": ("ScheduleDualPipeV", 2),
}


def schedule_strategy(kind: str, *, pp: int, microbatches: int):
    """Piper's equivalent of a torch schedule: (strategy or None, where it comes from, note).

    A loadable stdlib script wins; otherwise GPipe, 1F1B and interleaved 1F1B
    are the Python strategies below; ZBV and DualPipeV have no fallback.
    """
    found = find_stdlib(kind, microbatches=microbatches, mesh={"pp": pp})
    if found.usable:
        return found.strategy, f"stdlib/{found.path.name}", None
    note = found.problem
    if kind == "gpipe":
        return pipeline(microbatches), "python: no order (GPipe)", note
    if kind == "1f1b":
        return pipeline(microbatches, order=one_f_one_b), "python: per-stage 1F1B order", note
    if kind == "interleaved":
        orders = torch_schedule_order("ScheduleInterleaved1F1B", pp, microbatches, 2)
        return (pipeline(microbatches, regions_per_device=2, device_orders=orders),
                "python: 2 regions/device + torch's Interleaved1F1B order", note)
    return None, "not yet available", note


def zero_strategy(level: str, *, dp: int):
    """Piper's dp / zero1 / zero2 / zero3 over mesh axis `dp`: (strategy, where it comes from, note)."""
    found = find_stdlib(level, microbatches=1, mesh={"dp": dp})
    if found.usable:
        return found.strategy, f"stdlib/{found.path.name}", None
    return data_parallel(*ZERO[level]), f"python: data_parallel{ZERO[level]}", found.problem
