"""`piper.runtime.communication.collective_timing`: a small collective's cost per call on each of a worker's groups,
timed on a real two-process Gloo group (no Ray)."""
from __future__ import annotations

from types import SimpleNamespace

import torch.distributed as dist

from piper.runtime.communication.collective_timing import OPS, time_collectives
from tests.helpers import on_gloo


def _timed(rank: int):
    alone = dist.new_group([rank])        # a group of one is not timed
    worker = SimpleNamespace(executor=SimpleNamespace(groups={(0, 1): dist.group.WORLD, (rank,): alone}))
    return time_collectives(worker, repeats=2)


def test_every_op_is_timed_per_call_on_each_group_of_two_or_more():
    for per_rank in on_gloo(_timed, 2).values():
        assert set(per_rank) == {(op, 2) for op in OPS}
        assert all(wall > 0 and cpu >= 0 for wall, cpu in per_rank.values())
