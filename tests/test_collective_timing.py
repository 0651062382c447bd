"""`piper.runtime.communication.collective_timing`: a small collective's cost per call on each of a worker's groups,
timed on a real two-process Gloo group (no Ray)."""
from __future__ import annotations

import datetime
import socket
from types import SimpleNamespace

import torch.distributed as dist
import torch.multiprocessing as mp

from piper.runtime.communication.collective_timing import OPS, time_collectives


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        alone = dist.new_group([rank])        # a group of one is not timed
        worker = SimpleNamespace(executor=SimpleNamespace(groups={(0, 1): dist.group.WORLD, (rank,): alone}))
        out.put((rank, time_collectives(worker, repeats=2)))
    finally:
        dist.destroy_process_group()


def test_every_op_is_timed_per_call_on_each_group_of_two_or_more():
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs)
    for per_rank in results.values():
        assert set(per_rank) == {(op, 2) for op in OPS}
        assert all(wall > 0 and cpu >= 0 for wall, cpu in per_rank.values())
