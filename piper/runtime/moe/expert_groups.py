"""Expert parallelism on a worker: the expert groups the MoE ops move tokens
over, and the expert parameters each device holds.

Under `shard experts over AXIS` the devices that differ only along AXIS form
one expert group; member `i` holds experts `[i * E/n, (i + 1) * E/n)` of every
expert weight. `piper.nn`'s dispatch/combine ops ask `current()` for the group
of the calling thread and run their all-to-alls on it:

- counts first (`exchange_counts`: an even all-to-all of per-expert counts), so
  every member knows the split sizes before the uneven all-to-all of rows
  (Gloo does not check that split sizes agree across ranks);
- one process group per lane: the items of an overlapped slot run in two
  threads, and two threads on one Gloo group give silently wrong results. Every
  replica runs the same plan with the same lanes, so each group sees the same
  sequence of all-to-alls on every member.

Expert gradients need no reduction: with the batch sharded over AXIS alone,
the tokens of every replica reach an expert's one holder, whose gradient is
then already the sum over the global batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ... import expert_context
from ...expert_context import current, forget, lane_group  # noqa: F401 (the runtime's names for them)
from ..state import optimizers


class ExpertGroup:
    """One lane's process group over the devices that split the experts."""

    def __init__(self, group, ranks: tuple[int, ...], rank: int):
        self.group = group
        self.ranks = ranks
        self.size = len(ranks)
        self.index = ranks.index(rank)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """`counts[e]` rows for global expert `e` -> `[size * local]` rows each member sends here."""
        start = time.perf_counter()
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self.group)
        expert_context.add_seconds(time.perf_counter() - start)
        return out

    def all_to_all(self, rows: torch.Tensor, out_splits: torch.Tensor, in_splits: torch.Tensor) -> torch.Tensor:
        """Send `in_splits[j]` rows to member j, receive `out_splits[j]` from it."""
        start = time.perf_counter()
        outs, ins = out_splits.tolist(), in_splits.tolist()
        out = rows.new_empty(sum(outs), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), outs, ins, group=self.group)
        expert_context.add_seconds(time.perf_counter() - start)
        return out

    def all_to_all_async(self, rows: torch.Tensor, out_splits: torch.Tensor, in_splits: torch.Tensor):
        """`all_to_all` issued and not waited for: (the buffer it fills, its work handle)."""
        outs, ins = out_splits.tolist(), in_splits.tolist()
        out = rows.new_empty(sum(outs), *rows.shape[1:])
        work = dist.all_to_all_single(out, rows.contiguous(), outs, ins, group=self.group, async_op=True)
        return out, work


@dataclass(frozen=True)
class ExpertSpec:
    """What a worker needs for expert parallelism: the groups (every rank creates
    all of them, in this order), how many lanes, and its expert slices by unit."""

    groups: tuple[tuple[int, ...], ...]          # every expert group of the mesh
    lanes: int
    params: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)   # unit -> name -> (lo, hi)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> the whole weight's shape (checkpoints)


class Experts:
    """This device's expert parameters (leaves with their own `.grad`) and its groups."""

    def __init__(self, spec: ExpertSpec, rank: int, init: dict[str, torch.Tensor], optimizer, device):
        self.spec = spec
        self.lanes: list[ExpertGroup] = []
        for ranks in spec.groups:
            made = [dist.new_group(list(ranks)) for _ in range(spec.lanes)]
            if rank in ranks:
                self.lanes = [ExpertGroup(g, ranks, rank) for g in made]
        expert_context.set_default(self.lanes[0] if self.lanes else None)
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}
        self.optimizers = {}
        for unit, names in spec.params.items():
            leaves = {name: init[name].to(device).clone().requires_grad_() for name in names}
            self.leaves[unit] = leaves
            self.optimizers[unit] = optimizers.build(optimizer, list(leaves.values()),
                                                     [getattr(optimizer, "of", {}).get(n) for n in leaves])

    @staticmethod
    def exchanged() -> float:
        """Seconds the calling thread spent in expert all-to-alls since it last asked."""
        return expert_context.take_seconds()

    def account(self, node, timings: dict[str, float]) -> None:
        """Move the all-to-all seconds of the compute `node` just ran from its own time to its
        ALL_TO_ALL node's (`0ALL_TO_ALL_F3`), so a simulation priced from `job.timings()`
        (computes as `costs`, the node as `comm_cost`) counts them once."""
        seconds = self.exchanged()
        if seconds and node.op in ("F", "B", "BI"):
            timings[f"{node.region}ALL_TO_ALL_{node.op}{node.mb}"] = seconds
            timings[node.key] = max(0.0, timings[node.key] - seconds)

    def rows(self):
        """(unit, name, leaf, its first row, the whole weight's shape) of every expert weight held here."""
        for unit, leaves in self.leaves.items():
            for name, leaf in leaves.items():
                yield unit, name, leaf, self.spec.params[unit][name][0], self.spec.shapes[name]

    def views(self, unit: int) -> dict[str, torch.Tensor]:
        return self.leaves.get(unit, {})

    def storages(self) -> set[int]:
        """The `_cdata` of the expert rows' storages (parameters, not activations, when autograd saves them)."""
        return {leaf.untyped_storage()._cdata for leaves in self.leaves.values() for leaf in leaves.values()}

    def weights(self, unit: int) -> list[torch.Tensor]:
        return list(self.leaves.get(unit, {}).values())

    def gradients(self) -> list:
        """This device's expert-row gradients (for a global-norm clip)."""
        return [leaf.grad for leaves in self.leaves.values() for leaf in leaves.values()]

    def step(self, unit: int) -> None:
        if unit not in self.optimizers:
            return
        # An expert no token reached still has a (zero) gradient from expert_mm's backward, as on
        # one device; a weight no compute used has none, and the optimizer skips it, as torch's do.
        self.optimizers[unit].step()
        for leaf in self.leaves[unit].values():
            leaf.grad = None

    def shards(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().cpu().clone() for leaves in self.leaves.values() for name, t in leaves.items()}

    @property
    def held(self) -> int:
        """Bytes of expert parameters, gradients and optimizer state alive now (for `step_peak`)."""
        return sum(self.memory().values())

    def memory(self) -> dict[str, int]:
        params = sum(t.untyped_storage().nbytes() for ls in self.leaves.values() for t in ls.values())
        grads = sum(t.grad.untyped_storage().nbytes() for ls in self.leaves.values() for t in ls.values()
                    if t.grad is not None)
        opt = sum(v.untyped_storage().nbytes() for o in self.optimizers.values() for s in o.state.values()
                  for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": opt}
