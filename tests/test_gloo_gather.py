"""On Gloo an all-gather is one broadcast per member, in place (`collectives.broadcast_each`): the
same bytes as torch's all-gather, without Gloo's temporary of the whole output. Real Gloo groups
of three processes (no Ray); a subgroup of two checks that members map to their global ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from piper.runtime.communication import collectives
from piper.runtime.communication.tensor_groups import TensorGroup
from tests.helpers import allocation_rise, on_gloo

WORLD = 3
NUMEL = 3 * 4096          # per gathered buffer: 48 KiB of float32, divisible by both group sizes


def _gathered(group, members: int, member: int) -> dict:
    """Whether each way of gathering gives torch's all-gather bit for bit on this member, and the bytes
    `all_gather_into` allocated beside its output."""
    seed = torch.Generator().manual_seed(member)
    shard = torch.randn(NUMEL // members, generator=seed)
    shard[0] = -0.0                                   # the sign of a zero travels too
    expected = torch.empty(NUMEL)
    dist.all_gather_into_tensor(expected, shard, group=group)

    out = torch.full((NUMEL,), float("nan"))
    rise = allocation_rise(lambda: collectives.all_gather_into(out, shard, group).wait())

    own = torch.full((NUMEL,), float("nan"))          # ZeRO-1/2: the shard is this member's chunk of the output
    own.chunk(members)[member].copy_(shard)
    collectives.all_gather_into(own, own.chunk(members)[member], group).wait()

    x = torch.randn(2, 6, 5, generator=seed)          # TP under SP: gathered along the sequence
    tp = TensorGroup(group, tuple(range(members)), member)
    parts = [torch.empty_like(x) for _ in range(members)]
    dist.all_gather(parts, x, group=group)
    bits = expected.view(torch.int32)                 # tensors stay in the process: plain results cross
    return {"out": torch.equal(out.view(torch.int32), bits), "own": torch.equal(own.view(torch.int32), bits),
            "tp": torch.equal(tp.all_gather(x, 1), torch.cat(parts, 1)), "rise": rise}


def _every_way(rank: int) -> dict:
    pair = dist.new_group([0, 2])                     # every rank creates it; member 1 of it is rank 2
    results = {"world": _gathered(None, WORLD, rank)}
    if rank != 1:
        results["pair"] = _gathered(pair, 2, rank // 2)
    return results


def test_gloo_all_gather_is_exact_in_place_and_allocates_nothing_beside_its_output():
    results = on_gloo(_every_way, WORLD)
    assert set(results[0]) == {"world", "pair"} and set(results[1]) == {"world"}
    for per_rank in results.values():
        for got in per_rank.values():
            assert got["out"] and got["own"] and got["tp"], got
            # Gloo's all_gather_into_tensor allocates a temporary of the output's size (48 KiB);
            # broadcasts into the output's chunks allocate no tensor at all.
            assert got["rise"] < NUMEL * 4 // 8, got["rise"]
