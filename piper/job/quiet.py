"""Lines other libraries print that tell a Piper user nothing, each silenced where it is made and
only that line: no warning category, logger or stream is turned off as a whole.

- torch's "grad and param do not obey the gradient layout contract" (a UserWarning from autograd's
  AccumulateGrad, in the workers, when a gradient's strides differ from its parameter's): it is about
  speed, not results, and names nothing a user of a strategy script can change.
- Ray's "(raylet) WARNING: N PYTHON worker processes have been started ... maximum expected startup
  concurrency": a Piper worker is one Ray actor per device, taking no CPU of Ray's accounting, so a mesh
  larger than the machine's cores is what Piper asks for, not a runaway of tasks.
- torch.export's "always_classified is unsupported." (logged at ERROR by `torch.export._trace` when an
  export raises a TorchRuntimeError): the exception itself is what Piper reports, as a diagnostic.

    quiet_driver_noise()                              # in the driver, before capture and Ray start
    actor.__ray_call__.remote(quiet_worker_noise)     # in each worker (`piper.job.startup`)
"""
from __future__ import annotations

import logging
import re
import warnings

GRADIENT_LAYOUT = r"grad and param do not obey the gradient layout contract"
STARTUP_CONCURRENCY = re.compile(r"WARNING: \d+ \w+ worker processes have been started on node: .*maximum "
                                 r"expected startup concurrency")
EXPORT_CASE = "always_classified is unsupported."


def quiet_worker_noise(worker=None) -> None:
    """In a worker process: drop torch's gradient-layout warning (and only it)."""
    warnings.filterwarnings("ignore", message=GRADIENT_LAYOUT, category=UserWarning)


class _ExportCaseFilter(logging.Filter):
    """Drops torch.export's one classification line; every other record of its logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != EXPORT_CASE


_installed = False


def quiet_driver_noise() -> None:
    """In the driver: drop torch.export's classification line and Ray's start-up concurrency warning;
    worker processes get `quiet_worker_noise` when they start. Idempotent."""
    global _installed
    quiet_worker_noise()
    if _installed:
        return
    _installed = True
    logging.getLogger("torch.export._trace").addFilter(_ExportCaseFilter())
    _filter_ray_error_lines()


def _filter_ray_error_lines() -> None:
    """Ray prints what its raylet publishes to drivers through `ray._private.worker.print_to_stdstream`
    (looked up by name on each call): wrap it so the raylet's start-up concurrency lines are left out.
    Without that function (another Ray), nothing changes."""
    try:
        from ray._private import worker as ray_worker
    except ImportError:
        return
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_piper_quiet", False):
        return

    def print_to_stdstream(data, *args, **kwargs):
        if isinstance(data, dict) and data.get("pid") == "raylet" and isinstance(data.get("lines"), list):
            lines = [line for line in data["lines"] if not STARTUP_CONCURRENCY.search(str(line))]
            if not lines:
                return None
            data = {**data, "lines": lines}
        return original(data, *args, **kwargs)

    print_to_stdstream._piper_quiet = True
    ray_worker.print_to_stdstream = print_to_stdstream
