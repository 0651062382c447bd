"""Where the suites run: the local Ray cluster, the machine described for the report's
header, and the command that reruns the harness.
"""
from __future__ import annotations

import os
import platform
import sys
from contextlib import contextmanager

import torch


# -- the Ray cluster ---------------------------------------------------------------------------------

@contextmanager
def ray_cluster():
    """A local Ray cluster for the suites that start workers; reuses one already running.

    Workers take a sliver of CPU each (as Piper's do), so a 4-device mesh and a
    4-process baseline can both be alive on a 2-core machine.
    """
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    owned = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
        owned = True
    try:
        yield
    finally:
        if owned:
            ray.shutdown()


# -- the machine -------------------------------------------------------------------------------------

def commit() -> str:
    """The checkout's commit, `-dirty` added when the tree has changes: what a result was measured on."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("-dirty" if dirty else "")) if sha else "unknown"


def machine(device: str = "cpu") -> dict[str, str]:
    """Cores, memory, CPU model and library versions (and the GPUs on CUDA), for the results header."""
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "cores": str(os.cpu_count()), "torch": torch.__version__, "commit": commit()}
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        info["ray"] = "not installed"
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        info["memory"] = f"{kb / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        info["memory"] = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or "unknown"
    try:
        info["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    if device == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["gpus"] = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
        info["cuda"] = str(torch.version.cuda)
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (AttributeError, RuntimeError):
            info["nccl"] = "unknown"
    else:
        info["threads per worker"] = ("1 (Ray sets OMP_NUM_THREADS=1 in actors; baselines call "
                                      "torch.set_num_threads(1))")
    return info


def python_command(args: list[str]) -> str:
    """The shell command that reruns the harness with `args`."""
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    return " ".join([exe, "-m", "benchmarks", *args])
