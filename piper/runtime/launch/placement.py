"""Where a job's workers go on a Ray cluster: one placement group, shaped by the mesh.

The innermost mesh axes change fastest with the rank (`Mesh.coords`), and they
are the ones whose devices talk most (a pipeline's neighbours, a tensor-parallel
group): keep as many of them as fit inside one node, and spread the resulting
groups over the nodes.

    >>> plan_placement((("dp", 2), ("pp", 2)), [2, 2], "cpu")
    Placement(bundles=({'CPU': 2.0}, {'CPU': 2.0}), strategy='STRICT_SPREAD', bundle_of=(0, 0, 1, 1), claim=1.0)
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

# A CPU worker on a single node claims a sliver of a core, so any mesh fits on a laptop
# (devices share the cores; `simulate(cores=)` models that). Across nodes the claims are
# real shares of the cluster's cores, so Ray's placement sees how full each node is.
SLIVER = 0.01


@dataclass(frozen=True)
class Placement:
    bundles: tuple[dict, ...]        # Ray placement-group bundles
    strategy: str                    # PACK, SPREAD or STRICT_SPREAD
    bundle_of: tuple[int, ...]       # rank -> bundle index
    claim: float                     # CPUs (cpu) or GPUs (cuda) each worker asks for

    def resources(self, device: str) -> dict:
        """The actor options for one worker (num_cpus / num_gpus)."""
        if device == "cuda":
            return {"num_gpus": self.claim, "num_cpus": SLIVER}
        return {"num_cpus": self.claim}


def node_capacity(nodes: list[dict], device: str) -> list[int]:
    """Workers each alive node can host: its GPUs (cuda) or whole CPUs (cpu); nodes with none are left out.

    `nodes` is `ray.nodes()`.
    """
    key = "GPU" if device == "cuda" else "CPU"
    caps = [int(n.get("Resources", {}).get(key, 0)) for n in nodes if n.get("Alive")]
    return [c for c in caps if c > 0]


def plan_placement(axes: tuple[tuple[str, int], ...], capacity: list[int], device: str) -> Placement:
    """The bundles for a mesh on nodes that host `capacity[i]` workers each.

    - Everything fits on one node (or there is one node): one bundle per rank, PACK.
    - Otherwise ranks are grouped by the innermost axes whose product fits in the
      smallest node; one bundle per group, STRICT_SPREAD when there are no more groups
      than nodes (each group on its own node), else SPREAD.
    """
    world = 1
    for _, size in axes:
        world *= size
    if len(capacity) <= 1 or world <= max(capacity):
        claim = 1.0 if device == "cuda" else SLIVER
        bundle = {"GPU": 1.0, "CPU": SLIVER} if device == "cuda" else {"CPU": SLIVER}
        return Placement(tuple(dict(bundle) for _ in range(world)), "PACK", tuple(range(world)), claim)
    smallest = min(capacity)
    group = 1
    for _, size in reversed(axes):
        if group * size > smallest:
            # The axis spans nodes: still keep neighbouring ranks along it together.
            group *= max(d for d in range(1, size + 1) if size % d == 0 and group * d <= smallest)
            break
        group *= size
    groups = world // group
    if device == "cuda":
        claim = 1.0
        bundle = {"GPU": float(group), "CPU": SLIVER * group}
    else:
        # A fair share of the cluster's cores, at most one each, in hundredths (Ray's granularity).
        # Ray wants quantities over 1 whole: round the bundle down, then the claims to fit it.
        claim = max(SLIVER, min(1.0, int(100 * sum(capacity) / world) / 100))
        total = claim * group if claim * group <= 1 else float(int(claim * group))
        claim = int(100 * total / group) / 100
        bundle = {"CPU": total}
    strategy = "STRICT_SPREAD" if groups <= len(capacity) else "SPREAD"
    return Placement(tuple(dict(bundle) for _ in range(groups)), strategy,
                     tuple(rank // group for rank in range(world)), claim)


def describe_rank(rank: int, coords: dict[str, int], where: dict | None) -> str:
    """`rank 2 (dp=1, pp=0) on node 3f2a9c1e (10.0.0.5), pid 4242`."""
    text = f"rank {rank}"
    if coords:
        text += " (" + ", ".join(f"{k}={v}" for k, v in coords.items()) + ")"
    if where:
        text += f" on node {where['node'][:8]} ({where['ip']}), pid {where['pid']}"
    return text


def interface_of(ip: str) -> str | None:
    """The network interface holding the IPv4 address `ip` (Linux), or None.

    Gloo binds to the address the host name resolves to, which on many machines is
    127.0.0.1 (`/etc/hosts`): peers on other nodes then cannot connect. Workers set
    GLOO_SOCKET_IFNAME to the interface of their node's Ray address instead.
    """
    try:
        import fcntl
        import struct

        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None
