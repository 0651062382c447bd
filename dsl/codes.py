"""Every diagnostic code Piper emits (the language, the checker, the compiler, capture, jobs
and the CLI), with a one-line summary.

`piper explain CODE` prints the page docs/codes/CODE.md, installed as the package
data of `piper.docs`; this table is what it falls back to when the pages are
missing, and what the tests hold every page against.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

SYNTAX = {
    "syntax-error": "the parser expected something else here (the message says what)",
    "missing-colon": "a line that opens a block does not end with `:`",
    "unclosed-bracket": "a `(` or `[` is not closed on its line",
    "bad-indent": "a line is indented where no block starts, or a block is not indented",
    "unexpected-token-in-selector": "a selector holds something other than NAME=VALUE tags",
    "missing-into": "`split` without `into`",
    "missing-over": "`shard` without `over`",
    "missing-pattern": "`shard ... of` without a quoted module pattern after `of` or a `,`",
    "missing-on": "`place` (or `use ... on`) without `on`",
    "missing-expression": "a value is missing, e.g. after `=` or `into`",
    "bad-range": "a `for` loop without a `START..END` range",
    "missing-separator": "two items without `;` (slots) or `,` (lists) between them",
    "bad-import": "`import` without a quoted path relative to the script",
    "misplaced-statement": "a statement where it may not appear (mesh in a block, place in an order block)",
    "unknown-statement": "a line that does not start with a statement keyword",
    "unexpected-character": "a character that is not part of the language",
    "unterminated-string": "a string without its closing quote",
    "nesting-limit": "blocks or expressions nested too deeply",
}
NAMES_AND_TYPES = {
    "unknown-name": "a name that is not bound (no let, parameter or loop variable)",
    "unknown-axis": "an axis the mesh does not have",
    "unknown-strategy": "`use` names a strategy that is not defined, imported or in the standard library",
    "unknown-parameter": "an argument, `on` or `--set` names a parameter that does not exist",
    "unknown-pass": "an order item names a pass other than F, B, BI, BW, UPD",
    "unknown-type": "a parameter type other than int, bool or axis",
    "missing-parameter": "a `use` leaves a parameter without a default unset",
    "wrong-type": "a value of the wrong kind (an axis where a number is needed, ...)",
    "wrong-arity": "too many or too few arguments",
    "duplicate-name": "one name defined twice (strategy, parameter, argument, tag, mesh axis)",
    "ambiguous-axis": "`use ... on X` when the strategy has several axis parameters",
    "ambiguous-strategy": "a file defines several strategies and uses none, so none can run",
}
VALUES = {
    "value-out-of-range": "a number outside what it may be (microbatches < 1, an index outside its axis)",
    "division-by-zero": "`//` or `%` by zero",
    "bad-split": "`split` of something other than MB (into a count) or B (into BI, BW)",
    "bad-shard": "`shard` of something other than batch, optimizer, grads, params, experts, columns, rows, vocab, "
                 "sequence, or `of` where it does not belong",
    "missing-of": "`shard columns`, `rows` or `vocab` without `of` and the patterns of its modules",
    "loop-limit": "the script takes more than 400,000 steps, or evaluates more than 2,000,000 terms",
    "recursion-limit": "`use` or `import` nested more than 64 levels deep",
}
FILES = {
    "import-not-found": "an imported file cannot be read",
    "import-cycle": "files import each other in a circle",
    "mesh-mismatch": "the script's `mesh` line differs from the mesh it is run on",
    "file-not-found": "the script file cannot be read",
    "script-too-large": "a script over the size limit (256 KiB), reported without reading the rest",
    "unreadable-file": "a file Piper is handed (config, manifest, cache) that is no regular file, too large or not UTF-8",
}
WARNINGS = {
    "unused-let": "a `let` that nothing reads (warning)",
    "shadowed-name": "a name that hides a parameter, variable or mesh axis (warning)",
    "bidi-character": "an invisible text-direction control in the source, as in trojan-source (warning)",
}
TOOLS = {
    "analysis-unavailable": "model checks were asked for but cannot run here (note)",
    "internal-error": "a bug in Piper itself, not in the script",
    "bad-mesh": "a mesh given as NAME=SIZE pairs cannot be read",
}
# Emitted by the Python API's modules (selectors, mesh, strategy); documented with the rest.
PYTHON_API = {
    "bad-selector": "a selector string that cannot be read",
    "device-out-of-mesh": "`mesh[axis][index]` with an index outside the axis",
    "bad-place": "`place` given something other than a device group",
    "bad-strategy": "something that is not a strategy passed as one",
}

# The four statements applied to the model's regions (statements.py), in the order they run.
STATEMENTS = {
    "unknown-region": "a selector matches no region of the model",
    "placed-twice": "a region is placed by two `place` statements",
    "split-twice": "`split MB` or `split B` appears twice",
    "order-before-split": "`split MB` comes after an `order` statement",
    "sharded-twice": "one thing (or one module pattern) is sharded by two `shard` statements",
    "sequence-without-tp": "`shard sequence` without `shard columns` or `shard rows` for it to run between",
    "pattern-too-long": "a module or parameter name pattern (`shard ... of`, `no_decay`, `annotate_modules`) is too long",
    "bad-order-item": "an order item that is not a pass of a microbatch (UPD, or a region alone)",
    "unknown-node": "an order item names a microbatch or pass that does not exist",
    "ordered-twice": "one pass of one microbatch appears twice in an `order`",
    "bad-recompute": "`recompute` of a pass or a microbatch instead of regions",
}
# Placement and sharding, checked as the strategy is lowered (lower.py).
PLACEMENT = {
    "unplaced-region": "some regions are placed and others are not",
    "undivided-work": "a region runs on several devices along an axis the batch is not sharded over",
    "batch-not-covered": "a region's device group does not span the axes the batch is sharded over",
    "tied-across-devices": "a parameter shared by regions on more than two device groups",
    "shard-size-one": "`shard ... over` an axis of size 1 does nothing (warning)",
    "shard-without-batch": "optimizer, grads or params sharded over an axis the batch is not sharded over",
    "incomplete-zero": "grads sharded without optimizer, or params without grads and optimizer",
    "unsupported-sharding": "ZeRO while the batch is sharded over several axes, or tensor parallelism over "
                            "two axes or over the batch's, ZeRO's or the experts' axis",
    "indivisible-experts": "`shard experts over AXIS` with a MoE layer whose experts do not divide by size(AXIS)",
    "no-experts": "`shard experts` on a model without MoE layers",
}
# The global schedule and the plans (compiler.py, lower.py's check_orders, simulate.py).
SCHEDULE = {
    "order-across-devices": "an `order` puts passes that run on different devices one after another",
    "order-cycle": "the `order` statements contradict the data flow or each other",
    "deadlock": "the devices' orders wait on each other",
    "collective-mismatch": "the devices of a group would issue their collectives in different orders",
    "partial-order": "an `order` lists a pass for some microbatches but not all (warning)",
    "bi-without-bw": "an `order` lists BW of a region but not for every microbatch whose BI it lists (warning)",
    "plan-too-large": "microbatches, regions and devices that would make a plan past the size limits",
}
# Loading and capturing a model (models.py, capture.py, job/).
MODEL = {
    "model-not-found": "the file of `--model PATH.py:FACTORY` does not exist",
    "bad-model-spec": "`--model` is not PATH.py:FACTORY, or the file has no FACTORY",
    "no-example-batch": "the model's file defines no `example_batch(batch_size)`",
    "no-regions": "planning without `--model` or `--regions`",
    "bad-model": "not an nn.Module, forward does not return one scalar loss, or the loss is outside every region",
    "bad-inputs": "example or step inputs that are not tensors with one batch size",
    "indivisible-batch": "the batch does not divide into microbatches x data-parallel shards",
    "graph-break": "TorchDynamo cannot capture forward as one graph",
    "unannotated-compute": "compute outside every region that is fed by a later region than its first user",
    "bad-annotation": "a region annotation whose value is not an integer index",
    "unsupported-model": "a constant tensor, a buffer update or a non-tensor between regions",
    "unknown-module": "`annotate_modules` or a `shard ... of` pattern names a module the model does not have",
    "overlapping-groups": "`annotate_modules` puts one module (or a module and its parent) in two groups",
    "group-order": "`annotate_modules` groups listed in another order than forward runs them",
    "bad-moe": "a piper.nn.MoE with a non-positive size or top_k above num_experts",
    "tp-module-type": "`shard columns`, `rows` or `vocab` matches a module it cannot divide",
    "tp-indivisible": "a module's features, vocabulary rows or head count do not divide by the tensor-parallel size",
    "tp-unpaired": "modules are sharded by rows but none by columns, or by columns but none by rows",
    "tp-conflict": "one module is matched by two kinds of tensor-parallel sharding",
    "tp-tied-weight": "a weight tied between modules that tensor parallelism would divide differently, or "
                      "divide in one and not the other",
    "sequence-needs-vocab": "`shard sequence` without a vocab-sharded embedding where the sequence shards begin",
    "tp-capture": "the model does not capture when its modules compute on one device's shards",
    "tp-mixed-use": "a replicated parameter is used both on values divided over tp and on values every device "
                    "holds alike",
}
# A running job (job/).
JOBS = {
    "bad-device": "`device=` other than 'auto', 'cpu' or 'cuda'",
    "bad-optimizer": "an optimizer given by name, built already, needing a closure, or not elementwise",
    "no-resources": "the Ray cluster cannot host one worker per device",
    "worker-timeout": "workers did not finish within the job's timeout",
    "worker-died": "a worker process died (killed, out of memory)",
    "worker-failed": "a worker raised an exception",
    "job-closed": "`step` on a job that is closed",
    "bad-precision": "`precision=` other than 'fp32', 'bf16' or 'fp16'",
    "missing-op": "a worker cannot import the module that defines a custom op of the model's graph",
    "bad-clip": "`clip_grad_norm=` that is not a positive number",
    "no-trace": "`job.trace` before the job has run a step",
    "not-a-checkpoint": "`job.load` of a path that is not a checkpoint directory job.save wrote",
    "checkpoint-mismatch": "`job.load` of a checkpoint of another model (names, shapes or optimizer state differ)",
    "checkpoint-corrupt": "a checkpoint file missing, cut short or not matching its checksum, or unreadable",
    "checkpoint-save-failed": "`job.save` could not write (full disk, unwritable path, a path holding other files)",
    "checkpoint-dir-busy": "another `piper run` holds the --checkpoint-dir folder (its lock names the holder)",
    "bad-param-groups": "parameter groups that are not torch-style groups of the model's parameters",
    "param-in-two-groups": "a parameter in two of the optimizer's parameter groups",
    "param-not-in-group": "parameter groups that leave out some of the model's parameters",
    "no-decay-unmatched": "a `no_decay` pattern of `piper.param_groups` that names no parameter (warning)",
    "optimizer-pattern-unmatched": "a `piper.per_group` pattern that takes no parameter (warning)",
    "bad-lr-schedule": "`lr_schedule=` that is not a function of the step returning a multiplier >= 0",
    "bad-config": "`piper run --config` with a key that is no flag, a value of the wrong kind, or bad TOML",
    "bad-dataset": "`data=` that is not a dataset of samples forward takes, or a batch_size that does not fit it",
    "token-out-of-range": "a token id or target outside the model's vocabulary (a token file, or under `shard vocab`)",
    "token-file-shrank": "a token file cut short while a job reads it",
}
# The other commands: show, simulate, export, import; the IR's text form.
COMMANDS = {
    "bad-flag": "a flag that cannot be used (`piper export`'s, or `--regions` with several tags)",
    "export-unsupported": "a schedule torch's CSV cannot express (regions other than PP=k, no pipeline axis)",
    "bad-schedule-csv": "a torch schedule CSV that `piper import` cannot read",
    "bad-ir": "IR text that `parse_ir` cannot read",
    "bad-program-json": "a prototype JSON program that `piper import` cannot read (not JSON, a bad directive)",
    "prototype-unsupported": "a prototype directive the .pps language has no equivalent for",
    "prototype-dropped": "a prototype directive's streams or bucket size, dropped on import (warning)",
    "prototype-widened": "a prototype program's expert shards, widened on import to every MoE layer (warning)",
    "program-too-large": "a prototype JSON program past a size, nesting or number-length limit of `piper import`",
    "no-fit": "`piper tune` found no strategy that fits the memory budget",
}

# What a job is given and what a run writes, checked before workers start or as steps end
# (job/, frontend/model_checks.py, run_paths.py).
TRAINING_INPUTS = {
    "bad-output": "a `piper run` output path (--save, --trace, --metrics, --tensorboard, --checkpoint-dir) that cannot be written",
    "non-finite": "a step's loss is inf or NaN",
    "bad-nonfinite": "`nonfinite=` other than 'stop' or 'skip'",
    "loss-without-gradient": "forward returns an integer loss, or one detached from every parameter",
    "meta-parameters": "`piper.compile` of a model whose parameters are on the meta device",
    "not-enough-memory": "the workers' predicted memory does not fit in the Ray cluster's nodes",
}

CODES: dict[str, str] = {**SYNTAX, **NAMES_AND_TYPES, **VALUES, **FILES, **WARNINGS, **TOOLS, **PYTHON_API,
                         **STATEMENTS, **PLACEMENT, **SCHEDULE, **MODEL, **JOBS, **COMMANDS, **TRAINING_INPUTS}


def docs_dir():
    """The folder of pages: `codes/` of the installed package `piper.docs`, else docs/codes
    in the source tree this runs from. A `pathlib.Path` or another importlib Traversable."""
    try:
        installed = resources.files("piper.docs") / "codes"
    except ModuleNotFoundError:
        installed = None
    if installed is not None and installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / "docs" / "codes"


def page(code: str) -> str | None:
    """The docs page for `code`, or its one-line summary when pages are not installed, or None."""
    path = docs_dir() / f"{code}.md"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if code in CODES:
        return f"# {code}\n\n{CODES[code]}.\n\n(The full page is docs/codes/{code}.md in the Piper repository.)\n"
    return None


def known_codes() -> list[str]:
    """Codes with a page or a summary, for "did you mean"."""
    folder = docs_dir()
    pages = [p.name[:-3] for p in folder.iterdir() if p.name.endswith(".md")] if folder.is_dir() else []
    return sorted(set(pages) | set(CODES))
