"""The IR: one global training DAG holding every computation and communication
of a training step.

Nodes are small immutable values with a compact token in the style of
PyTorch's pipelining actions:

    2F0            region 2, forward, microbatch 0
    2BI0 / 2BW0    backward for inputs / for weights (zero-bubble split)
    0UPD           optimizer step for the parameters region 0 owns
    0SEND_F3>2.1   region 0 sends forward value 1 of microbatch 3 to region 2's devices
    2RECV_F3<0.1   ... and region 2's devices receive it
    2SEND_B3>0.1   region 2 sends the gradient of that value back (RECV_B likewise)
    0ALL_REDUCE    gradients of region 0's parameters (REDUCE_SCATTER likewise)
    0ALL_GATHER    parameters of region 0 after the update (ZeRO-1/2)
    0ALL_GATHER_F3 parameters of region 0 before 0F3 (ZeRO-3; _B3, _BI3, _BW3 too)
    0F3.1          piece 1 of 0F3, a pass cut at its collectives (`piper.ir.region_cut`)
    0ALL_TO_ALL_F3.0  exchange 0 of 0F3 (a MoE layer's dispatch; .1 its combine; _B3.1 their backward)
    0TP_F3.2       exchange 2 of 0F3: a tensor-parallel collective (0TP_F3 alone: those of a pass not cut)

`format_ir` prints an IR as text and `parse_ir` reads it back.
"""
from __future__ import annotations

import json
import re
from collections import namedtuple
from dataclasses import dataclass, field, replace
from operator import itemgetter

from ..diagnostics import Label, Span, error
from ..frontend.directives import TENSOR_KINDS, TENSOR_PARALLEL
from ..mesh import Mesh

COMPUTE = ("F", "B", "BI", "BW", "UPD")
P2P = ("SEND", "RECV")
COLLECTIVES = ("ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "ALL_TO_ALL", "TP")
DEFAULT_STREAM = {"F": "compute", "B": "compute", "BI": "compute", "BW": "compute", "UPD": "compute",
                  "SEND": "pp", "RECV": "pp", "ALL_REDUCE": "dp", "ALL_GATHER": "dp",
                  "REDUCE_SCATTER": "dp", "ALL_TO_ALL": "ep", "TP": "tp"}


def node_key(op: str, region: int, mb: int | None = None, phase: str | None = None,
             value: int | None = None, peer: int | None = None) -> str:
    """The token of the node these fields make: `node_key("F", 2, 0) == "2F0"`.

    Passes that only need a node's name (an edge's end, a transfer's tag) call
    this instead of building the node.
    """
    if op in _PASSES:       # `value`: a piece of a pass cut at its all-to-alls (`piper.ir.moe_cut`), 0F3.1
        return f"{region}{op}{mb}.{value}" if value else f"{region}{op}{mb}"
    if op == "UPD":
        return f"{region}UPD"
    if op == "SEND":
        return f"{region}SEND_{phase}{mb}>{peer}.{value}"
    if op == "RECV":
        return f"{region}RECV_{phase}{mb}<{peer}.{value}"
    if value is not None:   # one of a pass's expert exchanges, 0ALL_TO_ALL_F3.1
        return f"{region}{op}_{phase}{mb}.{value}"
    return f"{region}{op}_{phase}{mb}" if phase else f"{region}{op}"


_PASSES = frozenset(("F", "B", "BI", "BW"))
_COMPUTE = frozenset(COMPUTE)
_tuple_new = tuple.__new__
# Only for their C-level field accessors: Node and Edge below are tuples, which
# build several times faster than frozen dataclasses and are immutable as well.
_NodeFields = namedtuple("_NodeFields", "op region mb phase value peer devices stream key")
_EdgeFields = namedtuple("_EdgeFields", "src dst kind span")


def _not_same(other, ne: bool = False):
    """`==` (or `!=`) of a Node, Edge or Action with anything of another class:
    unequal to any other tuple (a plain tuple of the same fields included), as
    the dataclasses these were; anything else may still decide."""
    return ne if isinstance(other, tuple) else NotImplemented


class Node(tuple):
    """One action of the step, on a device group (`devices`, None until placed).

    For SEND/RECV, `phase` is "F" (an activation) or "B" (its gradient), `value`
    the value index in the producer's outputs and `peer` the region on the other
    side. For a collective, `phase` names the compute node it serves ("F", "B",
    ...) with `mb`, or is None for the once-per-step ones.

    An immutable value, compared and hashed by (op, region, mb, phase, value,
    peer) as the frozen dataclass it replaces was; `devices` and `stream` are
    attributes, not identity. `key` (the token) is computed once: edges name
    nodes by it. The IR holds hundreds of thousands of nodes, hence a tuple.
    """

    __slots__ = ()
    op, region, mb, phase, value, peer, devices, stream, key = (
        _NodeFields.op, _NodeFields.region, _NodeFields.mb, _NodeFields.phase, _NodeFields.value,
        _NodeFields.peer, _NodeFields.devices, _NodeFields.stream, _NodeFields.key)

    def __new__(cls, op: str, region: int, mb: int | None = None, phase: str | None = None,
                value: int | None = None, peer: int | None = None, devices: tuple[int, ...] | None = None,
                stream: str | None = None) -> "Node":
        return _tuple_new(cls, (op, region, mb, phase, value, peer, devices, stream,
                                node_key(op, region, mb, phase, value, peer)))

    def but(self, *, op: str | None = None, mb: int | None = None,
            devices: tuple[int, ...] | None = None) -> "Node":
        """A copy with `op`, `mb` or `devices` changed (`dataclasses.replace`, made cheap)."""
        o, region, m, phase, value, peer, devs, stream, key = self
        if devices is not None:
            devs = devices
        if op is None and mb is None:       # the same node on other devices: the key stays
            return _tuple_new(Node, (o, region, m, phase, value, peer, devs, stream, key))
        if op is not None:
            o = op
        if mb is not None:
            m = mb
        return _tuple_new(Node, (o, region, m, phase, value, peer, devs, stream,
                                 node_key(o, region, m, phase, value, peer)))

    def with_stream(self, stream: str | None) -> "Node":
        return _tuple_new(Node, self[:7] + (stream, self[8]))

    @property
    def is_compute(self) -> bool:
        return self[0] in _COMPUTE

    def on_stream(self) -> str:
        return self.stream or DEFAULT_STREAM[self.op]

    # Identity is the dataclass's: same class, same (op, region, mb, phase, value, peer).
    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return self[:6] == other[:6]
        return _not_same(other)

    def __ne__(self, other):
        if other.__class__ is self.__class__:
            return self[:6] != other[:6]
        return _not_same(other, True)

    def __hash__(self) -> int:
        return hash(self[:6])

    def __reduce__(self):
        return Node, self[:8]

    def __repr__(self) -> str:
        return ("Node(" + ", ".join(f"{f}={v!r}" for f, v in zip(_NodeFields._fields[:8], self)) + ")")

    def __str__(self) -> str:
        return self[8]


_KEY = re.compile(
    r"(?P<r>\d+)(?:"
    r"(?P<cop>BI|BW|F|B)(?P<cmb>\d+)(?:\.(?P<piece>\d+))?"
    r"|(?P<upd>UPD)"
    r"|(?P<pop>SEND|RECV)_(?P<pph>F|B)(?P<pmb>\d+)[<>](?P<peer>\d+)\.(?P<val>\d+)"
    r"|(?P<col>ALL_REDUCE|ALL_GATHER|REDUCE_SCATTER|ALL_TO_ALL|TP)(?:_(?P<cph>BI|BW|F|B)(?P<colmb>\d+)(?:\.(?P<part>\d+))?)?"
    r")$")


def parse_key(token: str) -> Node:
    """Read a node token back: `parse_key("2F0") == Node("F", 2, 0)`."""
    m = _KEY.match(token.strip())
    if not m:
        raise error("bad-ir", f"cannot read node token {token!r}",
                    hint="tokens look like 2F0, 0UPD, 0SEND_F3>1.0, 1RECV_F3<0.0, 0ALL_GATHER_F3")
    r = int(m["r"])
    if m["cop"]:
        return Node(m["cop"], r, int(m["cmb"]), value=int(m["piece"] or 0) or None)
    if m["upd"]:
        return Node("UPD", r)
    if m["pop"]:
        return Node(m["pop"], r, int(m["pmb"]), m["pph"], int(m["val"]), int(m["peer"]))
    mb = int(m["colmb"]) if m["colmb"] is not None else None
    return Node(m["col"], r, mb, m["cph"], int(m["part"]) if m["part"] is not None else None)


class Edge(tuple):
    """`src -> dst`: data (a tensor flows) or temporal (an order constraint).

    `span` points at the statement that made a temporal edge, for diagnostics.
    Compared and hashed by (src, dst, kind), as the frozen dataclass it
    replaces was; a tuple for the same reason as `Node`. `distinct_edges`
    deduplicates many at once.
    """

    __slots__ = ()
    src, dst, kind, span = _EdgeFields.src, _EdgeFields.dst, _EdgeFields.kind, _EdgeFields.span

    def __new__(cls, src: str, dst: str, kind: str = "data", span: Span | None = None) -> "Edge":
        return _tuple_new(cls, (src, dst, kind, span))

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return self[:3] == other[:3]
        return _not_same(other)

    def __ne__(self, other):
        if other.__class__ is self.__class__:
            return self[:3] != other[:3]
        return _not_same(other, True)

    def __hash__(self) -> int:
        return hash(self[:3])

    def __reduce__(self):
        return Edge, tuple(self)

    def __repr__(self) -> str:
        return f"Edge(src={self[0]!r}, dst={self[1]!r}, kind={self[2]!r}, span={self[3]!r})"


_IDENTITY = itemgetter(0, 1, 2)
_NODE_KEY = itemgetter(8)    # a Node's key, without the attribute lookup
_SRC, _DST = itemgetter(0), itemgetter(1)    # an Edge's ends


def distinct_edges(edges) -> tuple[Edge, ...]:
    """`tuple(dict.fromkeys(edges))`: the first of each set of equal edges, in
    order. Edges rarely repeat, so this first checks (in C) that none does."""
    edges = tuple(edges)
    if len(dict.fromkeys(map(_IDENTITY, edges))) == len(edges):
        return edges
    return tuple(dict.fromkeys(edges))


def data_edge(src: str, dst: str) -> Edge:
    """`Edge(src, dst)` without the call overhead, for passes that make hundreds of thousands."""
    return _tuple_new(Edge, (src, dst, "data", None))


@dataclass(frozen=True)
class RegionInfo:
    """What the IR needs to know of a captured region."""

    index: int
    tags: tuple[tuple[str, int], ...]
    params: tuple[str, ...]          # parameters it uses
    owned: tuple[str, ...]           # parameters it owns (updates)
    loss: bool = False

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.tags)


@dataclass(frozen=True)
class ValueInfo:
    """A tensor passed between regions; `index` is its position in the producer's outputs."""

    producer: int
    index: int
    consumers: tuple[int, ...]
    differentiable: bool = True


class _Indexed:
    """Indexes of an IR's nodes and edges, built on first use and kept in its `_indexes`."""

    def index(self) -> dict[str, Node]:
        """Nodes by key (built once per node tuple: most rewrites keep the nodes)."""
        found = self._indexes.get("key")
        if found is None:
            found = self._indexes["key"] = dict(zip(map(_NODE_KEY, self.nodes), self.nodes))
        return found

    def numbering(self) -> dict[str, int]:
        """Node key -> its position in `nodes` (built once per node tuple)."""
        found = self._indexes.get("number")
        if found is None:
            found = self._indexes["number"] = dict(zip(map(_NODE_KEY, self.nodes), range(len(self.nodes))))
        return found

    def edge_ids(self) -> tuple[list[int], list[int]]:
        """Each edge's ends as positions in `nodes`: (sources, destinations), parallel
        to `edges`. Passes walk the graph through these lists rather than looking
        keys up; a pass that makes an IR and knows them already passes them to
        `known_edge_ids`. KeyError for an edge to a node not in `nodes`."""
        found = self.known_ids()
        if found is None:
            number = self.numbering()
            found = (list(map(number.__getitem__, map(_SRC, self.edges))),
                     list(map(number.__getitem__, map(_DST, self.edges))))
            self.known_edge_ids(*found)
        return found

    def known_ids(self) -> tuple[list[int], list[int]] | None:
        """`edge_ids()` if they are at hand (handed on, or found before), else None."""
        return self.edge_fact("ids")

    def known_edge_ids(self, sources: list[int], destinations: list[int]) -> "IR":
        """This IR, with `edge_ids()` set to what its maker computed along the way."""
        return self.note_edge_fact("ids", (sources, destinations))

    def edge_fact(self, name: str):
        """What a pass noted about this IR's edges (`note_edge_fact`), or None: a rewrite that
        keeps the nodes shares the indexes, so a fact holds only while the edges are the same."""
        found = self._indexes.get(name)
        return found[1] if found is not None and found[0] is self.edges else None

    def note_edge_fact(self, name: str, value) -> "IR":
        """This IR, with `value` known of its edges under `name` (their ends' positions, where
        the temporal ones begin, that none repeats)."""
        self._indexes[name] = (self.edges, value)
        return self

    def keys_distinct(self) -> bool:
        """Whether no two nodes share a key: vouched for by the pass that made the nodes
        (`vouch_distinct`), else found by building `index()`."""
        return "ops" in self._indexes or len(self.index()) == len(self.nodes)

    def vouched_ops(self) -> frozenset | None:
        """The ops of the nodes, if the pass that made them vouched for them (`vouch_distinct`)."""
        return self._indexes.get("ops")

    def vouch_distinct(self, ops: frozenset) -> "IR":
        """This IR, marked by its maker as one whose node keys are distinct and whose
        nodes' ops are `ops`: `schedule` and the passes after it then need not build
        the 200k-entry `index()` to find out."""
        self._indexes["ops"] = ops
        return self

    def by_pass(self) -> dict[tuple[str, int], dict]:
        """Compute nodes by (pass, region), then by microbatch."""
        found = self._indexes.get("pass")
        if found is None:
            found = self._indexes["pass"] = {}
            for n in self.nodes:
                if n.op in _COMPUTE:
                    found.setdefault((n.op, n.region), {})[n.mb] = n
        return found


@dataclass(frozen=True)
class IR(_Indexed):
    """The global training DAG plus the attributes statements set on it.

    `placement` maps region -> device ranks; `sharding` holds (what, axis)
    records; the parallel `*_spans` say which statement made each.
    `tensor_patterns` holds the module patterns of tensor parallelism as
    (kind, pattern, span of the pattern), kind one of columns, rows, vocab
    (their axis is the `sharding` record of the kind); the spans are not part
    of the value.
    """

    mesh: Mesh
    regions: tuple[RegionInfo, ...]
    values: tuple[ValueInfo, ...]
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    microbatches: int = 1
    backward_split: bool = False
    placement: tuple[tuple[int, tuple[int, ...]], ...] = ()
    sharding: tuple[tuple[str, str], ...] = ()
    recompute: tuple[int, ...] = ()                 # regions that run forward again in backward
    # Where each placement / sharding record came from; not part of the value.
    placement_spans: tuple[Span | None, ...] = field(default=(), compare=False)
    sharding_spans: tuple[Span | None, ...] = field(default=(), compare=False)
    split_span: Span | None = field(default=None, compare=False)
    split_b_span: Span | None = field(default=None, compare=False)
    tensor_patterns: tuple[tuple[str, str, Span | None], ...] = field(default=(), compare=False)
    # (kind, pattern) of `tensor_patterns`: what equality compares, spans left out (set by __post_init__).
    _tensor_key: tuple[tuple[str, str], ...] = field(default=(), init=False, repr=False)
    # Indexes of `nodes`, built on first use; rewrites that keep the nodes share them.
    _indexes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.tensor_patterns:
            object.__setattr__(self, "_tensor_key", tuple((kind, pattern) for kind, pattern, _ in self.tensor_patterns))

    def node(self, key: str) -> Node:
        for n in self.nodes:
            if n.key == key:
                return n
        raise KeyError(key)

    def placed(self) -> dict[int, tuple[tuple[int, ...], Span | None]]:
        """Region -> (its ranks, the span that placed it), the first record of each: made once per
        placement tuple (the indexes are shared by rewrites that keep the nodes, so keyed by it)."""
        found = self._indexes.get("placed")
        if found is None or found[0] is not self.placement:
            spans = self.placement_spans or (None,) * len(self.placement)
            table: dict = {}
            for (r, ranks), span in zip(self.placement, spans):
                table.setdefault(r, (ranks, span))
            found = self._indexes["placed"] = (self.placement, table)
        return found[1]

    def devices_of(self, region: int) -> tuple[int, ...] | None:
        found = self.placed().get(region)
        return found[0] if found is not None else None

    def sharded(self, what: str) -> str | None:
        """The axis `what` ("batch", "optimizer", ...) is sharded over, or None."""
        for w, axis in self.sharding:
            if w == what:
                return axis
        return None

    def tensor_axis(self) -> str | None:
        """The axis tensor parallelism (columns, rows, vocab, sequence) divides over, or None.

        All of them use one axis; `shard` refuses a second, so an IR that has two was built by hand.
        """
        found = [(axis, span) for (w, axis), span in zip(self.sharding, self._sharding_spans())
                 if w in TENSOR_PARALLEL]
        axes = list(dict.fromkeys(axis for axis, _ in found))
        if len(axes) > 1:
            first = next(span for axis, span in found if axis == axes[0])
            second = next(span for axis, span in found if axis == axes[1])
            raise error("unsupported-sharding", f"tensor parallelism over both `{axes[0]}` and `{axes[1]}`",
                        span=second, labels=(Label(first, f"over `{axes[0]}` here"),) if first else (),
                        hint=f"shard columns, rows, vocab and sequence over one axis (`over {axes[0]}`)")
        return axes[0] if axes else None

    def tensor_patterns_of(self, kind: str) -> tuple[str, ...]:
        """The module patterns of `kind` ("columns", "rows" or "vocab"), in statement order."""
        return tuple(pattern for k, pattern, _ in self.tensor_patterns if k == kind)

    def _sharding_spans(self) -> tuple[Span | None, ...]:
        """`sharding_spans`, padded with None to the length of `sharding` (spans are not part of the value)."""
        return self.sharding_spans + (None,) * (len(self.sharding) - len(self.sharding_spans))

    def batch_axes(self) -> tuple[str, ...]:
        return tuple(axis for w, axis in self.sharding if w == "batch")

    def placement_span(self, region: int) -> Span | None:
        if len(self.placement_spans) != len(self.placement):     # spans are not part of the value
            for (r, _), span in zip(self.placement, self.placement_spans):
                if r == region:
                    return span
            return None
        found = self.placed().get(region)
        return found[1] if found is not None else None

    def sharding_span(self, what: str) -> Span | None:
        for (w, _), span in zip(self.sharding, self.sharding_spans):
            if w == what:
                return span
        return None

    def with_(self, **changes) -> "IR":
        new = replace(self, **changes)
        if "nodes" not in changes:
            object.__setattr__(new, "_indexes", self._indexes)
        return new


def format_ir(ir: IR) -> str:
    """The IR as text; `parse_ir(format_ir(ir)) == ir`."""
    lines = [f"mesh {ir.mesh}" if ir.mesh.axes else "mesh"]
    for r in ir.regions:
        own = ",".join(r.owned) or "-"
        use = ",".join(r.params) or "-"
        lines.append(f"region {r.index} {r.label or '-'} params={use} owns={own}{' loss' if r.loss else ''}")
    for v in ir.values:
        cons = ",".join(map(str, v.consumers))
        lines.append(f"value {v.producer}.{v.index} -> {cons}{'' if v.differentiable else ' nograd'}")
    lines.append(f"microbatches {ir.microbatches}{' backward-split' if ir.backward_split else ''}")
    for r, ranks in ir.placement:
        lines.append(f"place {r} @{','.join(map(str, ranks))}")
    for what, axis in ir.sharding:
        lines.append(f"shard {what} over {axis}")
    for kind, pattern, _ in ir.tensor_patterns:
        lines.append(f"pattern {kind} {json.dumps(pattern)}")
    placed = dict(ir.placement)
    for n in ir.nodes:
        devices = n.devices if n.devices is not None else placed.get(n.region) if n.is_compute else None
        dev = f" @{','.join(map(str, devices))}" if devices is not None else ""
        stream = f" {n.stream}" if n.stream else ""
        lines.append(f"node {n.key}{dev}{stream}")
    for e in ir.edges:
        lines.append(f"{'edge' if e.kind == 'data' else 'order'} {e.src} -> {e.dst}")
    return "\n".join(lines) + "\n"


def parse_ir(text: str) -> IR:
    """Read the text form of `format_ir` back into an IR."""
    mesh = Mesh(())
    regions, values, nodes, edges, placement, sharding, patterns = [], [], [], [], [], [], []
    microbatches, split = 1, False
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        word, _, rest = line.partition(" ")
        try:
            if word == "mesh":
                mesh = Mesh.of(rest.replace(" ", "") or None)
            elif word == "region":
                idx, label, *attrs = rest.split(" ")
                fields = dict(a.split("=", 1) for a in attrs if "=" in a)
                tags = () if label == "-" else tuple(
                    (k, int(v)) for k, v in (t.split("=") for t in label.split(" ")))
                uses = () if fields.get("params", "-") == "-" else tuple(fields["params"].split(","))
                owns = () if fields.get("owns", "-") == "-" else tuple(fields["owns"].split(","))
                regions.append(RegionInfo(int(idx), tags, uses, owns, "loss" in attrs))
            elif word == "value":
                src, _, cons = rest.partition(" -> ")
                producer, index = map(int, src.split("."))
                cons_list, *flags = cons.split(" ")
                values.append(ValueInfo(producer, index, tuple(map(int, cons_list.split(","))),
                                        "nograd" not in flags))
            elif word == "microbatches":
                count, *flags = rest.split(" ")
                microbatches, split = int(count), "backward-split" in flags
            elif word == "place":
                r, ranks = rest.split(" @")
                placement.append((int(r), tuple(map(int, ranks.split(",")))))
            elif word == "shard":
                what, _, axis = rest.partition(" over ")
                sharding.append((what.strip(), axis.strip()))
            elif word == "pattern":
                kind, _, quoted = rest.partition(" ")
                pattern = json.loads(quoted)
                if kind not in TENSOR_KINDS or not isinstance(pattern, str):
                    raise ValueError(f"not a tensor-parallel pattern: {rest!r}")
                patterns.append((kind, pattern, None))
            elif word == "node":
                key, *attrs = rest.split(" ")
                node = parse_key(key)
                for a in attrs:
                    if a.startswith("@"):
                        node = node.but(devices=tuple(map(int, a[1:].split(","))))
                    else:
                        node = node.with_stream(a)
                nodes.append(node)
            elif word in ("edge", "order"):
                src, _, dst = rest.partition(" -> ")
                edges.append(Edge(src.strip(), dst.strip(), "data" if word == "edge" else "temporal"))
            else:
                raise ValueError(f"unknown line kind {word!r}")
        except (ValueError, KeyError) as exc:
            raise error("bad-ir", f"line {lineno}: cannot read {raw!r} ({exc})") from None
    return IR(mesh, tuple(regions), tuple(values), tuple(nodes), tuple(edges), microbatches, split,
              tuple(placement), tuple(sharding), tensor_patterns=tuple(patterns))
