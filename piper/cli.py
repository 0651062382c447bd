"""The `piper` command: check scripts, explain diagnostic codes, run a training job.

    piper check examples/*.pps --mesh dp=2,pp=2 --set microbatches=8
    piper explain unknown-axis
    piper run examples/gpt_zero3_1f1b.pps --model examples/gpt.py:GPT --steps 10

Exit status (as ruff): 0 when nothing is reported, 1 when `check` reports any
error or warning (notes do not count), 2 for a usage error (bad flags, a file
that cannot be read) or an internal error.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from .diagnostics import Diagnostic, PiperError, UsageError, clip, did_you_mean

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def _parse_sets(items) -> dict[str, str]:
    out = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise UsageError(f"--set takes NAME=VALUE, not `{clip(item)}`")
        out[name.strip()] = value.strip()
    return out


def _parse_regions(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, count = part.partition("=")
        if not eq or not name.strip().isidentifier() or len(name.strip()) > 64 or not count.strip().isdigit():
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise UsageError(f"--regions takes TAG=COUNT such as PP=8 (one chain of regions), not {shown!r}")
        if len(count.strip()) > 30:      # past every limit, and too long for int() to read
            raise UsageError(f"--regions {clip(name.strip())}=N takes a count of regions, not a {len(count.strip()):,}-digit "
                         "number")
        out[name.strip()] = int(count)
    return out


def _parse_mesh(text: str | None):
    if not text:
        return None
    from .mesh import Mesh

    try:
        return Mesh.of(text)
    except PiperError as err:
        raise UsageError(err.diagnostics[0].message + " (write e.g. --mesh dp=2,pp=4)") from None


def _note(code: str, message: str, hint: str | None = None) -> Diagnostic:
    return Diagnostic(code, message, "note", hint=hint)


def _model_checks(text: str, file: str, *, mesh, overrides, model, regions, built=None) -> list[Diagnostic]:
    """What `piper.compiler.analysis.analyze` finds with the model or the region counts, if it is installed.

    `built`: the script as the check loaded and ran it (`check_and_build`), so it is not run again."""
    try:
        analysis = importlib.import_module("piper.compiler.analysis")
    except ModuleNotFoundError as err:
        if err.name != "piper.compiler.analysis":
            raise
        return [_note("analysis-unavailable", f"{file}: model checks are unavailable in this build "
                      "(piper.compiler.analysis is missing); checked the script alone")]
    from .dsl import load_strategy

    try:
        script = built or load_strategy(text, file=file, overrides=overrides)
    except PiperError:
        return []  # the script's own errors are already reported
    run_mesh = mesh if mesh is not None else script.mesh
    if not model and not regions:   # plan against the regions the script names itself
        from .frontend.script_regions import regions_to_check

        regions, problems = regions_to_check(script, run_mesh, file)
        if regions is None:
            return problems
    if run_mesh is None:
        return [_note("analysis-unavailable", f"{file}: model checks need a mesh",
                      hint="declare one in the script (`mesh dp=2, pp=4`) or pass --mesh dp=2,pp=4")]
    try:
        return list(analysis.analyze(script, mesh=run_mesh, model_spec=model, regions=regions))
    except PiperError as err:
        return list(err.diagnostics)


def cmd_check(args) -> int:
    from .dsl.script import check_and_build
    from .dsl.source import SourceError, read_source
    from .gc_guard import no_cycle_collection
    from .render import render, summary, visible

    overrides = _parse_sets(args.set)
    regions = _parse_regions(args.regions)
    mesh = _parse_mesh(args.mesh)
    diagnostics: list[Diagnostic] = []
    unreadable, checked = False, 0
    for file in args.files:
        try:
            text = read_source(file)
        except SourceError as err:
            if err.code == "script-too-large":   # a problem of the script, reported as one
                diagnostics.append(Diagnostic(err.code, f"{file}: the script is too large to check: {err.reason}",
                                              hint=err.hint))
                checked += 1
                continue
            print(f"piper check: error: cannot read {visible(file)}: {err.reason}", file=sys.stderr)
            unreadable = True
            continue
        checked += 1
        with no_cycle_collection():   # a big script's run makes 100k+ acyclic objects (0.1 s of GC at 64 x 512)
            found, built = check_and_build(text, file, mesh=mesh, overrides=overrides)
            if not any(d.severity == "error" for d in found):   # without --model/--regions: the script's regions
                found += _model_checks(text, file, mesh=mesh, overrides=overrides, model=args.model,
                                       regions=regions, built=built)
            del built
        diagnostics += found
    fmt = args.format or ("rich" if sys.stdout.isatty() else "text")
    sys.stdout.write(render(diagnostics, format=fmt, color=None if fmt == "rich" else False))
    problems = [d for d in diagnostics if d.severity in ("error", "warning")]
    if fmt != "json" and checked:
        files = f"{checked} file{'s' if checked != 1 else ''}"
        notes = len(diagnostics) - len(problems)
        print(f"piper check: {summary(diagnostics)} in {files}" if problems
              else f"piper check: all checks passed ({files})"
              + (f"; {notes} note{'s' if notes != 1 else ''} on what was not checked" if notes else ""),
              file=sys.stderr)
    if unreadable:
        return EXIT_USAGE
    return EXIT_PROBLEMS if problems else EXIT_OK


def cmd_explain(args) -> int:
    from .dsl.codes import known_codes, page

    if getattr(args, "list", False) or args.code is None:
        if args.code is None and not getattr(args, "list", False):
            raise UsageError("name a CODE (e.g. piper explain unknown-axis), or pass --list to see every code")
        from .dsl.codes import CODES

        width = max(map(len, CODES))
        sys.stdout.write("".join(f"{code:<{width}}  {CODES[code]}\n" for code in sorted(CODES)))
        return EXIT_OK
    text = page(args.code)
    if text is None:
        hint = did_you_mean(args.code, known_codes())
        print(f"piper explain: error: no page for the code `{args.code}`" + (f"; {hint}" if hint else ""),
              file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return EXIT_OK


def cmd_run(args) -> int:
    args.overrides = _parse_sets(args.set)
    try:
        cli_run = importlib.import_module("piper.cli_run")
    except ModuleNotFoundError as err:
        if err.name != "piper.cli_run":
            raise
        print("piper run: error: running jobs is not available in this build (piper.cli_run is missing)",
              file=sys.stderr)
        return EXIT_USAGE
    return int(cli_run.run(args) or 0)


def _compile_for(args):
    from .compiler.analysis import compile_script
    from .dsl import load_strategy

    script = load_strategy(args.script, overrides=_parse_sets(args.set))
    return compile_script(script, mesh=_parse_mesh(args.mesh), model_spec=args.model,
                          regions=_parse_regions(args.regions))


def _parse_costs(text: str | None) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, eq, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise UsageError(f"--costs takes PASS=SECONDS pairs such as F=1,B=2,BI=1,BW=1, not {text!r}") from None
        if not eq:
            raise UsageError(f"--costs takes PASS=SECONDS pairs such as F=1,B=2, not {text!r}")
    return out


def cmd_show(args) -> int:
    from .ir.dag import format_ir

    compiled = _compile_for(args)
    if getattr(args, "timeline", None):
        from .compiler.timeline import write

        write(compiled, args.timeline, costs=_parse_costs(args.costs) or None, title=f"{args.script}")
        print(f"piper show: wrote {args.timeline}", file=sys.stderr)
    if args.what == "ir":
        from .frontend.capture import describe

        sys.stdout.write(format_ir(compiled.ir))
        program = getattr(compiled, "program", None)
        sys.stdout.write(describe(program) if program is not None else "")
    else:
        from .compiler.show_plans import plan_grid, plan_lines

        layout = plan_grid if getattr(args, "layout", "lines") == "grid" else plan_lines
        sys.stdout.write(layout(compiled, legend=not getattr(args, "no_legend", False)))
    return EXIT_OK


def cmd_simulate(args) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from .compiler.report import summary_rows, timeline_text
    from .compiler.simulate import STEP, background_seconds, simulate, timed_slots

    costs = _parse_costs(args.costs)
    from .compiler.analysis import compile_with_program
    from .dsl import load_strategy

    compiled, program = compile_with_program(
        load_strategy(args.script, overrides=_parse_sets(args.set)), mesh=_parse_mesh(args.mesh),
        model_spec=args.model, regions=_parse_regions(args.regions), batch_size=getattr(args, "batch_size", None),
        precision=args.precision)
    memory = None
    if args.model:                 # a model has parameters and activations to predict
        from .compiler.memory_model import predict_memory

        memory = predict_memory(compiled, program, ranks=compiled.plans.representatives(), precision=args.precision)
    timings = {}
    if args.timings:
        with open(args.timings, encoding="utf-8") as f:
            timings = {k: float(v) for k, v in json.load(f).items()}
    costs.update({k: v for k, v in timings.items() if k != STEP})
    from .compiler.step_costs import recompute_costs

    costs = recompute_costs(compiled, costs)     # `recompute` regions: their forward again in B/BI
    plans = compiled.plans.representatives()
    sim = simulate(plans, costs=costs, overlap=timed_slots(timings), cores=args.cores,
                   devices=compiled.ir.mesh.world_size, background=background_seconds(timings),
                   record_comm=bool(args.trace))
    table = Table(title=f"{args.script}: predicted step {sim.step_time:g}, bubble {sim.bubble_fraction:.1%}")
    columns = ("rank", "busy", "idle", "bubble", "peak microbatches in flight")
    if memory:
        columns += ("peak memory", "params", "grads", "optimizer", "activations")
    for column in columns:
        table.add_column(column, justify="right")
    for rank, busy, idle, frac, peak in summary_rows(compiled, sim):
        row = [str(rank), f"{busy:g}", f"{idle:g}", f"{frac:.1%}", str(peak)]
        if memory:
            from .compiler.memory_model import format_bytes

            m = memory[rank]
            row += [format_bytes(b) for b in (m.peak, m.params, m.grads, m.optimizer, m.activations)]
        table.add_row(*row)
    console = Console()
    console.print(table)
    if args.timeline:
        console.print(timeline_text(sim), markup=False, highlight=False)
    if args.trace:
        from .compiler.trace import simulation_trace, write

        write(simulation_trace(plans, sim, mesh=compiled.ir.mesh, meta={"script": args.script}), args.trace)
        print(f"piper simulate: wrote {args.trace} (open it in ui.perfetto.dev)", file=sys.stderr)
    return EXIT_OK


def _export(args) -> int:
    from .cli_export import export_main

    return int(export_main(args) or 0)


def _interop(name: str, args) -> int:
    from .frontend import interop

    return int(getattr(interop, name)(args) or 0)


def _import(args) -> int:
    """`piper import`: a .csv file is torch's schedule (read as a CSV only); anything else may be a
    prototype JSON program, which `prototype.import_main` tells apart from a CSV."""
    if str(args.file).lower().endswith(".csv"):
        return _interop("import_main", args)
    from .frontend import prototype

    return int(prototype.import_main(args) or 0)


def _planning_flags(p) -> None:
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("--model", metavar="PATH.py:FACTORY", help="the model (captured on meta, no weights)")
    p.add_argument("--regions", metavar="TAG=COUNT", help="an abstract chain of regions instead, e.g. PP=8")
    p.add_argument("--mesh", metavar="AXIS=SIZE,...", help="the mesh (else the script's)")
    p.add_argument("--set", action="append", metavar="NAME=VALUE", help="set a strategy parameter")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="piper", description="Piper: strategies as scripts, one runtime.",
        epilog="exit status: 0 clean, 1 errors or warnings reported, 2 usage or internal error")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    check = commands.add_parser("check", help="report every error and warning in .pps scripts",
                                description="Check .pps scripts: syntax, names, types, arity, ranges, "
                                "unused lets, shadowing; with --model or --regions, the schedule too.")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument("--model", metavar="PATH.py:FACTORY", help="the model, for region and deadlock checks")
    check.add_argument("--regions", metavar="TAG=COUNT,...", help="region counts instead of a model, e.g. PP=8")
    check.add_argument("--mesh", metavar="AXIS=SIZE,...", help="the mesh, e.g. dp=2,pp=4 (else the script's)")
    check.add_argument("--set", action="append", metavar="NAME=VALUE", help="set a top-level let or parameter")
    check.add_argument("--format", choices=("text", "concise", "json", "rich"), help="output (default: rich on a terminal)")
    check.set_defaults(func=cmd_check)

    explain = commands.add_parser("explain", help="explain a diagnostic code, with an example and the fix")
    explain.add_argument("code", metavar="CODE", nargs="?")
    explain.add_argument("--list", action="store_true", help="list every code with its one-line summary")
    explain.set_defaults(func=cmd_explain)

    show = commands.add_parser("show", help="print each device's plan (or the IR) for a script")
    _planning_flags(show)
    show.add_argument("--what", choices=("plans", "ir"), default="plans")
    show.add_argument("--timeline", metavar="FILE.svg", help="draw each device's schedule as SVG (or .html)")
    show.add_argument("--costs", metavar="PASS=TIME,...", help="costs for --timeline (default F=1,B=2,BI=1,BW=1)")
    show.add_argument("--layout", choices=("lines", "grid"), default="lines",
                      help="one action per line, device after device (default), or devices side by side")
    show.add_argument("--no-legend", action="store_true", help="leave out the legend of the action notation")
    show.set_defaults(func=cmd_show)

    sim = commands.add_parser("simulate", help="predict step time, bubbles and microbatches in flight")
    _planning_flags(sim)
    sim.add_argument("--costs", metavar="PASS=TIME,...", help="per-pass costs (default F=1,B=2,BI=1,BW=1)")
    sim.add_argument("--timings", metavar="FILE.json", help="measured costs per action key (job.timings())")
    sim.add_argument("--cores", type=int, metavar="N",
                     help="the devices share N CPU cores (costs from job.timings(cpu=True))")
    sim.add_argument("--timeline", action="store_true", help="draw each device's timeline")
    sim.add_argument("--trace", metavar="FILE.json", help="write the predicted step as a Chrome/Perfetto trace")
    sim.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                     help="piper.compile's precision= (memory: 16-bit copies, gathers and activations)")
    sim.set_defaults(func=cmd_simulate)

    export = commands.add_parser("export", help="write a script's schedule for torch.distributed.pipelining")
    _planning_flags(export)
    export.add_argument("--format", choices=("torch-csv",), default="torch-csv")
    export.add_argument("-o", "--output", metavar="FILE", help="where to write (default: stdout)")
    export.add_argument("--axis", help="the pipeline axis (default: the one regions are placed along)")
    export.add_argument("--batch-size", type=int, help="the example batch for --model")
    export.set_defaults(func=lambda args: _export(args))

    imp = commands.add_parser("import", help="turn a torch schedule CSV or a prototype JSON program into a .pps script")
    imp.add_argument("file", metavar="FILE.csv|FILE.json")
    imp.add_argument("-o", "--output", metavar="OUT.pps", help="where to write (default: stdout)")
    imp.add_argument("--name", help="the strategy's name (default: the CSV file's stem)")
    imp.set_defaults(func=_import)

    from .run_args import add_tune_parser

    add_tune_parser(commands)

    run = commands.add_parser("run", help="train a model file's model with a script")
    from .run_args import add_run_arguments

    add_run_arguments(run)
    run.set_defaults(func=cmd_run)
    return parser


def _internal_error(err: BaseException) -> None:
    detail = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    print(f"error[internal-error]: piper failed on its own bug ({detail}); please report it "
          "(set PIPER_DEBUG=1 for the traceback)", file=sys.stderr)


def main(argv=None) -> int:
    """Entry point of the `piper` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        return args.func(args)
    except UsageError as err:
        print(f"piper {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except PiperError as err:
        from .render import print_diagnostics

        print_diagnostics(err.diagnostics, file=sys.stderr)
        return EXIT_PROBLEMS
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - never a traceback for any input
        if os.environ.get("PIPER_DEBUG"):
            raise
        _internal_error(err)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
