"""The benchmark runner: runs suites, prints rich tables, writes a markdown report.

The suite list and the command line; the suites are loaded by name from `benchmarks/suites/`,
their results shown by `report.py`.

    python -m benchmarks                                  # every suite; writes benchmarks/RESULTS.md
    python -m benchmarks --suite compiler overhead --quick --out /tmp/r.md
    python -m benchmarks --device cuda                    # the GPU suites on CUDA + NCCL (one GPU per process)
    python -m benchmarks --list

On CUDA the suites that compare with PyTorch on devices (pipelines,
data-parallel, overlap) run, and the report's GPU part is rewritten under its
own heading; the CPU part of the file is kept, and the other way round.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from .machine import machine, python_command
from .report import markdown, merged, print_result
from .results import SuiteResult

RESULTS = Path(__file__).resolve().parent.parent / "RESULTS.md"


@dataclass(frozen=True)
class Suite:
    number: int
    name: str
    title: str
    module: str | None       # benchmarks.suites.<module> with run(ctx) -> SuiteResult; None: not implemented yet
    cuda: bool = False       # also runs with --device cuda (the others measure CPU processes or the compiler)


SUITES = (
    Suite(1, "pipelines", "Pipeline schedules vs torch.distributed.pipelining", "pipelines", cuda=True),
    Suite(2, "data-parallel", "dp vs DDP, zero3 vs FSDP2", "data_parallel", cuda=True),
    Suite(3, "memory", "Per-device memory vs the ZeRO formulas; saved activations", "memory"),
    Suite(4, "batch-composition", "Bigger batches by composition", "batch_composition"),
    Suite(5, "overlap", "Communication/computation overlap", "overlap", cuda=True),
    Suite(6, "compiler", "Compile + verify time and scaling", "compiler"),
    Suite(7, "overhead", "Per-action dispatch cost", "overhead"),
    Suite(8, "cost-model", "Cost-model accuracy", "cost_model"),
    Suite(9, "families", "Model families beyond the example GPT", "families"),
    Suite(10, "experts", "Expert parallelism: divided vs replicated experts; DualPipeV x EP lanes", "experts"),
    Suite(11, "memory-model", "Predicted vs measured peak memory", "memory_model"),
    Suite(12, "tune", "piper tune: search time, tuned vs hand-picked", "tune"),
    Suite(13, "checkpoint", "Checkpoint save and load vs FSDP2 + DCP", "checkpoint"),
    Suite(14, "training-features", "Mixed precision and recomputation vs fp32 and FSDP2", "training_features"),
    Suite(15, "hf-moe", "Hugging Face Qwen3-MoE: experts divided vs replicated; EP under pipelines", "hf_moe"),
    Suite(16, "tensor-parallel", "Tensor parallelism vs parallelize_module; DP x PP x TP vs torchtitan's order; "
          "piper check at 8,192 devices", "tensor_parallel"),
)
BY_NAME = {s.name: s for s in SUITES}


class Context:
    """What a suite gets: the mode, the device, a logger, and the command that reproduces it."""

    def __init__(self, *, quick: bool, console: Console, verbose: bool = False, device: str = "cpu"):
        self.quick = quick
        self.console = console
        self.verbose = verbose
        self.device = device
        self.gpus = gpu_count() if device == "cuda" else 0

    def cannot_host(self, processes: int) -> str | None:
        """Why `processes` devices cannot run here (one GPU each on CUDA), or None if they can."""
        if self.device == "cuda" and processes > self.gpus:
            return f"needs {processes} GPUs, this machine has {self.gpus}"
        return None

    def log(self, message: str) -> None:
        if self.verbose or not message.startswith("Traceback"):
            self.console.print(f"[dim]  {message.rstrip()}[/dim]", highlight=False)

    def command(self, suite: str) -> str:
        return python_command(["--suite", suite] + (["--quick"] if self.quick else [])
                              + (["--device", "cuda"] if self.device == "cuda" else []))


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_suite(suite: Suite, ctx: Context) -> SuiteResult:
    if suite.module is None:
        ctx.console.print(f"[yellow]suite {suite.number} `{suite.name}`: not implemented yet[/yellow]")
        return SuiteResult(suite.name, suite.number, suite.title, ctx.command(suite.name),
                           notes=["not implemented yet"], implemented=False)
    module = importlib.import_module(f"benchmarks.suites.{suite.module}")
    t0 = time.perf_counter()
    try:
        result = module.run(ctx)
    except Exception as exc:
        ctx.console.print(traceback.format_exc(), markup=False, highlight=False)
        result = SuiteResult(suite.name, suite.number, suite.title, ctx.command(suite.name),
                             notes=[f"the suite failed: {type(exc).__name__}: {exc}"])
    result.seconds = time.perf_counter() - t0
    return result


# -- the command line -------------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="suites: " + ", ".join(f"{s.number}={s.name}" for s in SUITES))
    parser.add_argument("--suite", nargs="+", metavar="NAME", choices=[s.name for s in SUITES],
                        help="suites to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps: checks the harness runs")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"write the markdown report here (default: {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS} "
                             "for a run without --quick, whose suites replace their own sections; with --quick no file "
                             "unless --out is given)")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw metrics as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (Gloo; default) or cuda (NCCL, one GPU per process): the GPU suites "
                             "only, written under the report's GPU heading")
    parser.add_argument("--list", action="store_true", help="list the suites and exit")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failing runs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 180)
    if args.list:
        for s in SUITES:
            state = ("" if s.module else "  (not implemented yet)") + ("" if s.cuda else "  (CPU only)")
            console.print(f"{s.number}. {s.name:18} {s.title}{state}", highlight=False)
        return 0
    chosen = [BY_NAME[n] for n in args.suite] if args.suite else list(SUITES)
    chosen.sort(key=lambda s: s.number)
    if args.device == "cuda":
        refused = [s.name for s in chosen if not s.cuda]
        if args.suite and refused:
            verb = "runs" if len(refused) == 1 else "run"
            console.print(f"[red]error:[/red] {', '.join(refused)} {verb} on CPU only (measuring CPU processes "
                          f"or the compiler); GPU suites: {', '.join(s.name for s in SUITES if s.cuda)}",
                          highlight=False)
            return 2
        chosen = [s for s in chosen if s.cuda]
        if not gpu_count():
            console.print("[red]error:[/red] --device cuda, but torch sees no CUDA GPU here "
                          f"(torch {__import__('torch').__version__}); run without --device cuda for the CPU suites",
                          highlight=False)
            return 2
    # Any run at full size updates RESULTS.md: each suite's section is replaced, the others kept.
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    command = python_command(argv)
    started = datetime.datetime.now().astimezone()
    info = machine(args.device)
    console.print(f"[bold]Piper benchmarks[/bold]  {command}", highlight=False)
    console.print("  " + ", ".join(f"{k} {v}" for k, v in info.items() if k in ("cores", "memory", "torch", "ray")),
                  highlight=False)
    ctx = Context(quick=args.quick, console=console, verbose=args.verbose, device=args.device)
    results = []
    for suite in chosen:
        console.print(f"[bold]running {suite.number}. {suite.name}[/bold]  ({ctx.command(suite.name)})", highlight=False)
        result = run_suite(suite, ctx)
        print_result(result, console)
        results.append(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        report = markdown(results, command=command, started=started, info=info, device=args.device)
        out.write_text(merged(out.read_text() if out.exists() else "", report, args.device))
        console.print(f"wrote {out}", highlight=False)
    if args.json is not None:
        args.json.write_text(json.dumps({r.name: r.metrics for r in results}, indent=2, sort_keys=True))
        console.print(f"wrote {args.json}", highlight=False)
    failed = [r.name for r in results if r.implemented and any("the suite failed" in n for n in r.notes)]
    return 1 if failed else 0
