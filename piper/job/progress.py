"""What a job says while it starts: capture, planning, Ray, placement, torch.distributed, set-up.

Starting the workers takes tens of seconds on a busy machine; `piper.compile`
reports each stage so a script, a notebook or `piper tune --verify` is not
silent meanwhile. By default the lines go to stderr (`piper: placing 4
workers ...`); `progress=False` or `PIPER_PROGRESS=0` turns them off, and a
callable receives each message instead (`piper run` prints them its way).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable


def _to_stderr(message: str) -> None:
    print(f"piper: {message}", file=sys.stderr, flush=True)


def _silent(message: str) -> None:
    pass


def reporter(progress) -> Callable[[str], None]:
    """The function that reports each stage, from `piper.compile`'s `progress=`.

    A callable is used as it is; otherwise `progress` is a flag: None (the
    default) and True write to stderr unless `PIPER_PROGRESS=0`, False is silent.
    """
    if callable(progress):
        return progress
    if progress is False or (progress is None and os.environ.get("PIPER_PROGRESS", "1") == "0"):
        return _silent
    return _to_stderr if progress or progress is None else _silent
