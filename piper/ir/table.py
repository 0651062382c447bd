"""The lowered DAG by node number: what the compiler's passes after `add_transfers` read.

At 64 stages x 512 microbatches x dp 8 the lowered DAG holds 225k nodes and
390k edges, and 129k of the nodes are SEND/RECVs that differ only in their
microbatch. The passes from `schedule` to `project` read a few fields of each
node (its op, its devices, the transfer it belongs to) and walk the edges by
position. So a `Table` keeps those fields as columns and the edges as two
lists of node numbers, and makes a transfer's `Node`, and any `Edge`, only
when something reads it: `piper check` never does, a device's plan makes the
nodes of its own actions, and `Compiled.ir` makes them all.

Node numbers are positions in the lowered IR's `nodes`, and the edges are in
the order of its `edges`, so `lowered_ir()` is exactly what the passes would
have built as objects.
"""
from __future__ import annotations

from bisect import bisect_right
from itertools import compress
from operator import itemgetter

from .dag import COMPUTE, IR, Node, data_edge

_tuple_new = tuple.__new__
_OP, _DEVICES, _KEY, _FIRST = itemgetter(0), itemgetter(6), itemgetter(8), itemgetter(0)
_SRC, _DST = itemgetter(0), itemgetter(1)
_AS_SEND = itemgetter(5, 2, 3, 4, 1)     # a RECV's (peer, mb, phase, value, region): its SEND's fields
_COMPUTE = frozenset(COMPUTE)
_TRANSFER = frozenset(("SEND", "RECV"))


class _Growth:
    """How the passes add nodes to a `Table`: transfers by the block, made on first read
    (`add_block`), and nodes made elsewhere (`append`, `extend`)."""

    __slots__ = ()

    def add_block(self, count: int, specs: list[tuple], peers: list[tuple], pairs: list) -> int:
        """Number `count` x len(specs) transfers, made on first read: spec `off` of microbatch
        `mb` is node `base + mb * len(specs) + off`. `specs[off]`: (op, region, phase, value,
        peer region, devices); `peers[off]`: the peer's devices; `pairs`: each node's pair entry
        in the same layout. Returns `base`."""
        base, stride = len(self.nodes), len(specs)
        full = []
        for op, region, phase, value, peer, devices in specs:
            full.append((op, region, phase, value, peer, devices, f"{region}{op}_{phase}",
                         f"{'>' if op == 'SEND' else '<'}{peer}.{value}"))
        self.nodes += [None] * (stride * count)
        self.ops += [s[0] for s in specs] * count
        self.groups += [s[5] for s in specs] * count
        self.peer_groups += peers * count
        self.pairs += pairs
        self._blocks.append((base, stride, count, full))
        return base

    def append(self, node: Node) -> int:
        """Number a node made elsewhere (an exchange of tied weights); returns its number."""
        self.nodes.append(node)
        self.ops.append(node[0])
        self.groups.append(node[6])
        self.pairs.append(_pair(node))
        self.peer_groups.append(self.ir.devices_of(node[5]) if node[0] in _TRANSFER else None)
        self.mirrored = self.mirrored and node[0] not in _TRANSFER
        return len(self.nodes) - 1

    def extend(self, nodes: list[Node]) -> None:
        """Number nodes made elsewhere (the collectives `place_collectives` adds), in turn."""
        if not _TRANSFER.isdisjoint(map(_OP, nodes)):
            for n in nodes:
                self.append(n)
            return
        self.nodes += nodes
        self.ops += map(_OP, nodes)
        self.groups += map(_DEVICES, nodes)
        self.pairs += [None] * len(nodes)
        self.peer_groups += [None] * len(nodes)


class _Objects:
    """A `Table`'s nodes and edges as objects, made when read."""

    __slots__ = ()

    def node(self, k: int) -> Node:
        n = self.nodes[k]
        if n is None:
            base, stride, _, specs = self._blocks[bisect_right(self._blocks, k, key=_FIRST) - 1]
            mb, off = divmod(k - base, stride)
            op, region, phase, value, peer, devices, head, tail = specs[off]
            n = self.nodes[k] = _tuple_new(Node, (op, region, mb, phase, value, peer, devices, None,
                                                  f"{head}{mb}{tail}"))
        return n

    def key(self, k: int) -> str:
        return self.node(k)[8]

    def make_all(self) -> list[Node]:
        """Every node, made."""
        nodes = self.nodes
        for base, stride, count, specs in self._blocks:
            end = base + stride * count
            for off, (op, region, phase, value, peer, devices, head, tail) in enumerate(specs):
                nodes[base + off:end:stride] = [
                    _tuple_new(Node, (op, region, mb, phase, value, peer, devices, None, f"{head}{mb}{tail}"))
                    for mb in range(count)]
        self._blocks = []
        return nodes

    def edge_objects(self, start: int, stop: int) -> list:
        """Edges `start` to `stop` as `Edge`s (data edges made from their ends' keys)."""
        kept = len(self.kept)
        out = list(self.kept[start:min(stop, kept)])
        if stop > kept:
            keys = list(map(_KEY, self.make_all()))
            lo = max(start, kept)
            out += map(data_edge, map(keys.__getitem__, self.src[lo:stop]), map(keys.__getitem__, self.dst[lo:stop]))
        return out

    def lowered_ir(self) -> IR:
        """The lowered IR as objects: what `add_transfers` returns (made once)."""
        if self._lowered is None:
            nodes = tuple(self.make_all()[:self.lowered_nodes])
            edges = tuple(self.edge_objects(0, self.lowered_edges))
            out = self.ir.with_(nodes=nodes, edges=edges)
            if self.vouched:
                out.vouch_distinct(frozenset(self.ops[:self.lowered_nodes]))
            self._lowered = out.known_edge_ids(self.src[:self.lowered_edges], self.dst[:self.lowered_edges])
        return self._lowered


class Table(_Growth, _Objects):
    """Nodes by number as columns, edges as number pairs; objects made on first read.

    - `nodes[k]`: the `Node`, or None for a transfer not made yet (`node(k)` makes it);
    - `ops[k]`, `groups[k]`: its op and devices;
    - `pairs[k]`: for a SEND or RECV, what names the transfer (both ends share it;
      `project` numbers tags by it), else None; `peer_groups[k]`: the other side's devices;
    - `src[i]`, `dst[i]`: edge i's ends. The first `len(kept)` are `kept`'s (the IR's
      own edges, as objects: temporal ones carry spans); the rest are data edges.
    """

    __slots__ = ("ir", "nodes", "ops", "groups", "pairs", "peer_groups", "src", "dst", "kept", "distinct",
                 "vouched", "passes", "mirrored", "lowered_nodes", "lowered_edges", "_blocks", "_lowered")

    def __init__(self, ir: IR, nodes: list, src: list[int], dst: list[int], kept: list):
        self.ir = ir
        self.nodes = nodes
        self.ops = list(map(_OP, nodes))
        self.groups = list(map(_DEVICES, nodes))
        if _COMPUTE.issuperset(self.ops):
            self.pairs, self.peer_groups = [None] * len(nodes), [None] * len(nodes)
        else:
            placed = dict(ir.placement)
            self.pairs = list(map(_pair, nodes))
            self.peer_groups = [placed.get(n[5]) if n[0] in _TRANSFER else None for n in nodes]
        self.src, self.dst, self.kept = src, dst, kept
        self.distinct = 0             # the first `distinct` edges repeat no (src, dst)
        self.vouched = False          # whether `lowered_ir()` may vouch for distinct keys and its ops
        # (pass, region) -> the number of its node for each microbatch (None where there is none),
        # where the maker knows them (`lower_transfers`); the scheduler then reads no compute node.
        self.passes: dict[tuple[str, int], list] | None = None
        # Whether every transfer's receive is on its send's peer group and has the send's group
        # as its peer (`add_block` makes them so): then a receive names the member its send came from.
        self.mirrored = False
        self.lowered_nodes, self.lowered_edges = len(nodes), len(src)
        self._blocks: list[tuple] = []     # (base, stride, count, specs): transfers not made yet, by base
        self._lowered: IR | None = None

    @classmethod
    def of_nodes(cls, ir: IR, nodes, *, strict: bool = True) -> "Table":
        """A table of `nodes` (every one made) and `ir`'s edges between them. A key twice is one
        node (the last made, at the first's place). `strict`: an edge to a node not in `nodes` is
        an error (`schedule`'s); else it is left out (what waits and plans never read)."""
        nodes = list(nodes)
        number = dict(zip(map(_KEY, nodes), range(len(nodes))))
        if len(number) != len(nodes):
            nodes = list(dict(zip(map(_KEY, nodes), nodes)).values())
            number = dict(zip(map(_KEY, nodes), range(len(nodes))))
        edges = list(ir.edges)
        if not strict:
            edges = [e for e in edges if e[0] in number and e[1] in number]
        try:
            src = list(map(number.__getitem__, map(_SRC, edges)))
            dst = list(map(number.__getitem__, map(_DST, edges)))
        except KeyError:
            raise unknown_edge(edges, number) from None
        return cls(ir, nodes, src, dst, edges)

    def computes(self, order: list[int]) -> list[int]:
        """The positions in `order` of its computes."""
        ops = self.ops
        return list(compress(range(len(order)), map(_COMPUTE.__contains__, map(ops.__getitem__, order))))


def _pair(node: Node):
    """What names a SEND's or RECV's transfer: the SEND's (region, mb, phase, value, peer); else None."""
    op = node[0]
    return node[1:6] if op == "SEND" else _AS_SEND(node) if op == "RECV" else None


def unknown_edge(edges, number: dict) -> AssertionError:
    """The error for the first of `edges` with an end not in `number` (a key -> position)."""
    bad = next(e for e in edges if e[0] not in number or e[1] not in number)
    return AssertionError(f"edge to unknown node {bad}")
