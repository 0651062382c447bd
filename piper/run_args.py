"""The flags of `piper run` and `piper tune`, in a module of their own (no torch, no Ray): `piper --help`
and `piper check` build the parser without loading what training and the search need.

Each group of flags is one function, so features add theirs beside the others.
"""
from __future__ import annotations

import importlib

OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop", "adagrad")


def add_run_arguments(run) -> None:
    """Every flag of `piper run`."""
    run.add_argument("script", metavar="SCRIPT", nargs="?", help="the strategy (or `script = ...` in --config)")
    run.add_argument("--model", metavar="PATH.py:FACTORY",
                     help="a function (or class) in PATH.py that builds the model with no arguments")
    run.add_argument("--mesh", metavar="AXIS=SIZE,...", help="the mesh (default: the script's own)")
    run.add_argument("--set", action="append", metavar="NAME=VALUE", help="set a strategy parameter")
    add_training_arguments(run)
    add_cluster_arguments(run)
    add_output_arguments(run)
    add_observation_arguments(run)
    add_checkpoint_arguments(run)
    add_recovery_arguments(run)
    add_numerics_arguments(run)
    add_recipe_arguments(run)
    remember_given(run)


def add_training_arguments(run) -> None:
    """What is trained and how: steps, batch, optimizer."""
    run.add_argument("--steps", type=int, default=None, metavar="N", help="optimizer steps (default 20)")
    run.add_argument("--batch-size", type=int, default=None, metavar="N",
                     help="the global batch, split over microbatches and data-parallel shards (default 16)")
    run.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="torch.optim's (default adamw)")
    run.add_argument("--lr", type=float, default=1e-3, metavar="RATE", help="learning rate (default 1e-3)")
    run.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the model is built (default 0)")


def add_cluster_arguments(run) -> None:
    """Where the workers run."""
    run.add_argument("--address", metavar="ADDR", default=None,
                     help="join this Ray cluster (e.g. auto, or ray://host:10001); default: start a local one")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="cuda: one GPU per device (NCCL); cpu: one process per device (Gloo); "
                          "auto: cuda when the cluster has a GPU for every device")


def add_recovery_arguments(run) -> None:
    """Going on after a lost worker or node (piper/job/recovery.py)."""
    run.add_argument("--max-restarts", type=int, default=0, metavar="R",
                     help="when a worker or node is lost, restart the workers (on whatever nodes the cluster has), "
                          "load the last checkpoint and go on, up to R times")
    run.add_argument("--timeout", type=float, default=300.0, metavar="S",
                     help="a step (or any call to the workers) that takes longer fails with worker-timeout, naming "
                          "the stalled workers (default 300); with --max-restarts it is then restarted")
    run.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                     help="the most seconds starting the workers may take (placement, torch.distributed, set-up; "
                          "default 600)")


def add_numerics_arguments(run) -> None:
    """How each step computes: precision, gradient clipping, steps with a non-finite loss or gradient."""
    run.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                     help="bf16/fp16: compute in 16 bits with float32 master weights, optimizer state and "
                          "reductions (fp16 also scales the loss); fp32: the model's own dtype (default)")
    run.add_argument("--clip-grad-norm", type=float, default=None, metavar="NORM",
                     help="clip the gradients by their global norm over the whole model before each update")
    run.add_argument("--skip-nonfinite", action="store_true",
                     help="skip (on every device) the update of a step whose loss or gradients hold an inf or a "
                          "NaN, and go on; default: stop with a non-finite error naming the step")


def add_output_arguments(run) -> None:
    """What is written when training ends."""
    run.add_argument("--save", metavar="FILE.pt|DIR", default=None,
                     help="FILE.pt (or .pth, .bin): the trained weights (model.state_dict() keys) with torch.save; "
                          "any other path: a checkpoint directory (job.save: weights, optimizer state, step)")


def add_observation_arguments(run) -> None:
    """What is recorded while training."""
    run.add_argument("--trace", metavar="FILE.json", default=None,
                     help="write the last steps as a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    run.add_argument("--metrics", metavar="FILE.jsonl", default=None, help="write one JSON line per step")
    run.add_argument("--peak-flops", type=float, default=None, metavar="FLOPS",
                     help="one device's peak FLOP/s for the MFU shown beside tokens/s (default: a table of known "
                          "GPUs, or a float32 GEMM measured on one CPU thread)")


def add_checkpoint_arguments(run) -> None:
    """Checkpoints during training, and going on from one (piper/job/checkpoint.py)."""
    run.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                     help="save checkpoints as DIR/step-N (the last two are kept)")
    run.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="save every N steps")
    run.add_argument("--resume", action="store_true",
                     help="start from the last checkpoint in --checkpoint-dir (any strategy or mesh may have saved it)")


def add_tune_parser(commands) -> None:
    """`piper tune` and its flags; the search itself (`piper.cli_tune.main`) loads on use."""
    tune = commands.add_parser("tune", help="search strategies that fit a memory budget, fastest first")
    tune.add_argument("--model", required=True, metavar="PATH.py:FACTORY")
    tune.add_argument("--devices", required=True, type=int, metavar="N")
    tune.add_argument("--memory", required=True, metavar="BYTES", help="per device: bytes, or 8MiB, 2GiB...")
    tune.add_argument("--batch-size", type=int, metavar="B", help="the global batch (default 16)")
    tune.add_argument("--verify", type=int, default=0, metavar="K", help="run the best K for a few steps")
    tune.add_argument("-o", "--output", metavar="BEST.pps", help="write the best strategy, with its mesh")
    tune.add_argument("--format", choices=("text", "json"), default="text")
    tune.add_argument("--top", type=int, default=15, metavar="N", help="rows to show (default 15)")
    tune.add_argument("--tensor-parallel", metavar="STRATEGY", dest="tensor_parallel",
                      help="also search tp sizes, dividing the model as STRATEGY says (a strategy used on tp, "
                           "e.g. llama_tensor_parallel)")
    tune.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                      help="predict from the computes alone: no short run to measure the runtime's costs")
    tune.add_argument("--recalibrate", action="store_true",
                      help="measure the runtime's costs anew (they are cached per model and device count)")
    tune.set_defaults(func=lambda args: importlib.import_module("piper.cli_tune").main(args))


# -- a training recipe: config file, schedule, weight decay, token files, evaluation, TensorBoard --------
# (piper/run_recipe.py reads these; kept together so other flags merge beside them)

LR_SCHEDULES = ("constant", "warmup-cosine")


def add_recipe_arguments(run) -> None:
    """A pretraining recipe's flags, each also a key of `--config run.toml`."""
    run.add_argument("--config", metavar="RUN.toml", default=None,
                     help="every flag as a key of a TOML file, in sections of your choice ([training] steps = 200, "
                          "lr = 3e-4; [data] data = 'train.bin'); flags given on the command line override it")
    run.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                     help="warmup-cosine: --warmup steps of linear warmup, then a cosine to --min-lr-ratio x lr at "
                          "the last step (default constant)")
    run.add_argument("--warmup", type=int, default=0, metavar="N", help="warmup steps of --lr-schedule (default 0)")
    run.add_argument("--min-lr-ratio", type=float, default=0.1, metavar="R",
                     help="the final learning rate of warmup-cosine as a fraction of --lr (default 0.1)")
    run.add_argument("--weight-decay", type=float, default=None, metavar="W",
                     help="weight decay on the matrices (parameters of 2+ dimensions) only; biases, norms and "
                          "other vectors get none (or name them: --no-decay)")
    run.add_argument("--no-decay", action="append", default=None, metavar="PATTERN",
                     help="with --weight-decay: no decay for parameters matching PATTERN ('**.bias', "
                          "'**.ln_*.weight'), instead of the by-dimension rule; repeatable")
    run.add_argument("--data", metavar="FILE.bin", default=None,
                     help="train on a token file (nanoGPT's .bin, uint16), read by the workers themselves")
    run.add_argument("--val-data", metavar="FILE.bin", default=None, help="a token file for --eval-every")
    run.add_argument("--block-size", type=int, default=None, metavar="N", help="tokens per sample of --data")
    run.add_argument("--shuffle", action="store_true", help="shuffle --data's blocks, a new permutation per epoch")
    run.add_argument("--eval-every", type=int, default=None, metavar="N",
                     help="every N steps, the loss on --val-data without an update")
    run.add_argument("--eval-batches", type=int, default=1, metavar="K",
                     help="global batches of --val-data per evaluation (default 1)")
    run.add_argument("--tensorboard", metavar="DIR", default=None,
                     help="log loss, learning rate, step time, tokens/s, grad norm and eval loss to DIR "
                          "(torch.utils.tensorboard; needs the tensorboard package)")


def remember_given(parser) -> None:
    """Note on the parsed namespace (`_given`) each flag the command line itself gave, so that
    `--config` fills in only the others."""
    for action in parser._actions:          # argparse calls an action only for what was given
        base = type(action)

        def call(self, parser, namespace, values, option_string=None, _base=base):
            _base.__call__(self, parser, namespace, values, option_string)
            namespace._given = getattr(namespace, "_given", frozenset()) | {self.dest}

        action.__class__ = type(base.__name__, (base,), {"__call__": call})
