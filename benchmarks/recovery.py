"""Time from a lost worker to training again: a worker of a running job kills itself
(SIGKILL, `PIPER_FAULT`) and `piper.job.recovery.train` restarts the job and reloads the
last checkpoint.

    python -m benchmarks.recovery                  # pp=2 and dp=2 x pp=2, 3 trials each
    python -m benchmarks.recovery --trials 1 --mesh pp=2
    python -m benchmarks.recovery --at save        # killed while writing a checkpoint instead

Reported per mesh (medians over trials; wall-clock seconds, so on a shared machine
they include whatever else runs):
  detect   the worker's death (the fault's timestamp) -> `job.step` raising `worker-died`
  restart  that error -> the new job started, set up, and the checkpoint loaded
  step     the first step after the restart (replay from the checkpoint)
  total    death -> the first step after the restart done
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch

RANKS_TO_KILL = {"pp=2": (1, "1F0"), "dp=2,pp=2": (2, "0F0")}


def _two_stages(data_parallel: bool):
    import piper

    @piper.strategy
    def two_stages(s):
        s.split("MB", 2)
        for stage in range(2):
            s.place(f"PP={stage}", s.mesh["pp"][stage])
        if data_parallel:
            s.shard("batch", over="dp")
    return two_stages


def one_trial(mesh: str, steps: int = 4, kill_at: int = 2, at: str = "step") -> dict[str, float]:
    """`at="step"`: killed in step `kill_at` (checkpoints every `kill_at` steps); `at="save"`: killed
    as it starts writing the checkpoint after step `kill_at` (checkpoints every step)."""
    import piper
    from examples.gpt import batches, _corpus_tokens, make_model
    from piper.mesh import Mesh
    from piper.job.recovery import Checkpoints, StepData, train

    m = Mesh.of(mesh)
    rank, action = RANKS_TO_KILL[mesh]
    model = make_model(n_layer=2, n_regions=2, n_embd=32, n_head=2, block_size=16)[0]
    stream = functools.partial(batches, _corpus_tokens()[1], 8, 16, seed=1)
    data = StepData(stream)
    strategy = _two_stages(data_parallel="dp" in m.names)
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "killed")
        if at == "save":
            action = "save"
        os.environ["PIPER_FAULT"] = f"rank={rank} action={action} do=kill step={kill_at} once={marker}"
        times: dict[str, float] = {}

        def on_step(step, loss, seconds):
            if "restart" in times and "step" not in times:
                times["step"] = seconds
                times["done"] = time.time()

        def on_restart(r):
            times["detect"] = r.detected_at - os.path.getmtime(marker)
            times["restart"] = r.seconds

        try:
            train(lambda: piper.compile(model, data(0), strategy=strategy, mesh=dict(m.axes), timeout=60),
                  data, steps, max_restarts=1,
                  checkpoints=Checkpoints(os.path.join(tmp, "ckpt"), every=1 if at == "save" else kill_at),
                  on_step=on_step, on_restart=on_restart)
        finally:
            os.environ.pop("PIPER_FAULT", None)
        times["total"] = times.pop("done") - os.path.getmtime(marker)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", action="append", choices=sorted(RANKS_TO_KILL))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--at", choices=("step", "save"), default="step",
                        help="kill the worker in a step (default) or while it writes a checkpoint")
    args = parser.parse_args(argv)
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    torch.manual_seed(0)
    print(f"{'mesh':<12} {'detect s':>9} {'restart s':>10} {'step s':>7} {'total s':>8}   (median of {args.trials})")
    try:
        for mesh in args.mesh or ["pp=2", "dp=2,pp=2"]:
            trials = [one_trial(mesh, at=args.at) for _ in range(args.trials)]
            med = {k: statistics.median(t[k] for t in trials) for k in ("detect", "restart", "step", "total")}
            print(f"{mesh:<12} {med['detect']:>9.2f} {med['restart']:>10.2f} {med['step']:>7.2f} {med['total']:>8.2f}"
                  f"   detect range {min(t['detect'] for t in trials):.2f}-{max(t['detect'] for t in trials):.2f}")
            sys.stdout.flush()
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
