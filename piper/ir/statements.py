"""The four statements as rewrites of the IR: `split`, `place`, `shard`, `order`.

Each takes an IR and a directive and returns a new IR; none mutates its input.
The `.pps` interpreter and `@piper.strategy` both end here, through `apply`.
Communication is not inserted here: the compiler's lowering passes add
SEND/RECV and collectives once every statement has run, so `place` and `shard`
commute.
"""
from __future__ import annotations

from itertools import chain
from operator import attrgetter, itemgetter

from ..frontend.capture import Program
from ..diagnostics import Label, PiperError, error
from ..frontend.directives import TENSOR_PARALLEL, Directive, Order, Place, Recompute, Shard, Split, shard_problem
from .dag import _COMPUTE, _IDENTITY, _PASSES, IR, Edge, Node, RegionInfo, ValueInfo, distinct_edges
from ..mesh import Mesh
from .region_match import regions_by_tag, regions_matching
from .size import check_placement, check_split
from .tensor_shards import add_patterns, check_axes, check_sequence
from ..frontend.selectors import Selector

_tuple_new = tuple.__new__
_KEY = itemgetter(8)
_SRC, _DST = itemgetter(0), itemgetter(1)
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_TAGS, _ITEM_OP = attrgetter("tags"), attrgetter("op")


def initial_ir(program: Program, mesh: Mesh) -> IR:
    """The unsplit, unplaced DAG of a captured program: one microbatch.

    For a chain of two regions:  0F0 -> 1F0 -> 1B0 -> 0B0 -> 0UPD, 1B0 -> 1UPD
    (plus 0F0 -> 0B0: backward needs what forward saved).
    """
    owner = {}
    for region in program.regions:
        for p in region.params:
            owner.setdefault(p, region.index)
    regions = tuple(RegionInfo(r.index, r.tags, r.params, tuple(p for p in r.params if owner[p] == r.index), r.loss)
                    for r in program.regions)
    values = tuple(ValueInfo(v.producer, v.index, v.consumers, v.differentiable) for v in program.values)
    nodes = []
    for r in regions:
        nodes += [Node("F", r.index, 0), Node("B", r.index, 0)]
    nodes += [Node("UPD", r.index) for r in regions if r.owned]
    edges: dict[tuple, Edge] = {}

    def add(src: Node, dst: Node):
        edges.setdefault((src.key, dst.key), Edge(src.key, dst.key))

    for v in values:
        for c in v.consumers:
            add(Node("F", v.producer, 0), Node("F", c, 0))
            if v.differentiable:
                add(Node("B", c, 0), Node("B", v.producer, 0))
    for r in regions:
        add(Node("F", r.index, 0), Node("B", r.index, 0))
        for o in sorted({owner[p] for p in r.params}):
            add(Node("B", r.index, 0), Node("UPD", o))
    return IR(mesh, regions, values, tuple(nodes), tuple(edges.values()))


def apply(ir: IR, directive: Directive) -> IR:
    """Apply one directive; dispatch to the function for its statement."""
    if isinstance(directive, Split):
        return split_backward(ir, directive) if directive.what == "B" else split_microbatches(ir, directive)
    if isinstance(directive, Place):
        return place(ir, directive)
    if isinstance(directive, Shard):
        return shard(ir, directive)
    if isinstance(directive, Order):
        return order(ir, directive)
    if isinstance(directive, Recompute):
        from .recompute import recompute

        return recompute(ir, directive)
    raise TypeError(f"not a directive: {directive!r}")


def apply_all(ir: IR, directives) -> IR:
    """Apply the directives in turn.

    A run of `order` statements (a pipeline schedule has one per stage) adds
    its edges in one go: `order` reads the nodes, never the edges, so this is
    `apply` one at a time without copying the growing edge tuple per statement.
    Two statements may order the same pair: the IR keeps its edges distinct.
    Last, the checks that need every statement: `shard sequence` needs `shard columns` or `rows`.
    """
    pending: list[Edge] = []
    ends: tuple[list[int], list[int]] | None = ([], [])     # their ends' positions, while all are known
    members: list[str] = []          # the nodes each statement orders, all statements in turn
    for d in directives:
        if isinstance(d, Order):
            edges, at, ordered = _order_edges(ir, d)
            pending += edges
            members += ordered
            if ends is not None and at is not None:
                ends[0].extend(at[:-1])
                ends[1].extend(at[1:])
            else:
                ends = None
            continue
        if pending:
            ir = _add_ordered(ir, pending, ends, len(set(members)) == len(members))
            pending, ends, members = [], ([], []), []
        ir = apply(ir, d)
    if pending:
        ir = _add_ordered(ir, pending, ends, len(set(members)) == len(members))
    check_sequence(ir)
    return ir


def split_microbatches(ir: IR, d: Split) -> IR:
    """`split MB into n`: copy every F/B/BI/BW per microbatch; UPD waits for all.

    before: 0F0 -> 0B0 -> 0UPD
    after (n=2): 0F0 -> 0B0 -> 0UPD, 0F1 -> 0B1 -> 0UPD
    """
    if d.what != "MB":
        raise error("bad-split", f"cannot split `{d.what}`", span=d.span,
                    hint="write `split MB into N` for microbatches or `split B into BI, BW`")
    if ir.microbatches != 1:
        raise error("split-twice", f"the batch is already split into {ir.microbatches} microbatches",
                    span=d.span, labels=(Label(ir.split_span, "split here first"),) if ir.split_span else (),
                    hint="keep one `split MB into N`")
    if any(e.kind == "temporal" for e in ir.edges):
        raise error("order-before-split", "`split MB` comes after an `order` statement", span=d.span,
                    hint="split the batch first, then order the microbatches")
    check_split(ir, d)
    n = d.count
    mbs = list(range(n))       # one int object per microbatch, shared by every copy
    nodes = []
    copies: dict[str, list[Node]] = {}     # key -> the node in each microbatch
    at: dict[str, list[int]] = {}         # key -> the copies' positions in `nodes`
    for node in ir.nodes:
        if node.mb is not None:
            copies[node.key] = per = _per_microbatch(node, mbs)
            at[node.key] = list(range(len(nodes), len(nodes) + n))
            nodes += per
        else:
            copies[node.key] = [node] * n
            at[node.key] = [len(nodes)] * n
            nodes.append(node)
    keys = {key: [c[8] for c in per] for key, per in copies.items()}
    edges, src_ids, dst_ids = [], [], []
    for src, dst, kind, span in ir.edges:
        edges += [_tuple_new(Edge, (s, t, kind, span)) for s, t in zip(keys[src], keys[dst])]
        src_ids += at[src]
        dst_ids += at[dst]
    # Copies of distinct edges are distinct unless both ends are once-per-step nodes (UPD).
    once = {node.key for node in ir.nodes if node.mb is None}
    if len(set(ir.edges)) != len(ir.edges) or any(e.src in once and e.dst in once for e in ir.edges):
        return ir.with_(nodes=tuple(nodes), edges=distinct_edges(edges), microbatches=n, split_span=d.span)
    out = ir.with_(nodes=tuple(nodes), edges=tuple(edges), microbatches=n, split_span=d.span)
    # Each edge's ends are known positions: passes that walk edges by position need no look-up.
    # So are each pass's nodes by microbatch, where the IR held one of each pass.
    passes = [(node[0], node[1]) for node in ir.nodes if node[0] in _PASSES and not node[4]]
    if len(set(passes)) == len(passes) == sum(node.mb is not None for node in ir.nodes):
        out._indexes["pass_at"] = {(n[0], n[1]): at[n[8]] for n in ir.nodes if n.mb is not None}
        # `by_pass()` as its loop would find it: each compute's copies by microbatch
        out._indexes["pass"] = {(n[0], n[1]): dict(zip(mbs, copies[n[8]])) if n.mb is not None else {None: n}
                                for n in ir.nodes if n[0] in _COMPUTE}
    if len({node[8] for node in ir.nodes}) == len(ir.nodes):      # copies of distinct nodes are distinct
        out.vouch_distinct(frozenset(node[0] for node in ir.nodes))
    out.note_edge_fact("distinct", True)        # no edge repeats (`split B` need not look)
    return out.known_edge_ids(src_ids, dst_ids)


def _per_microbatch(node: Node, mbs: list[int]) -> list[Node]:
    """`[node.but(mb=m) for m in mbs]`; a pass's keys differ only in the
    microbatch, so each is one join rather than a `node_key` call."""
    op, region, _, phase, value, peer, devices, stream, _ = node
    if op not in _PASSES or value:
        return [node.but(mb=m) for m in mbs]
    head = f"{region}{op}"
    return [_tuple_new(Node, (op, region, m, phase, value, peer, devices, stream, f"{head}{m}")) for m in mbs]


def split_backward(ir: IR, d: Split) -> IR:
    """`split B into BI, BW`: backward for inputs, then backward for weights.

    before: 1F0 -> 1B0 -> 0B0, 1B0 -> 1UPD
    after:  1F0 -> 1BI0 -> 1BW0 -> 1UPD, 1BI0 -> 0BI0, 1BI0 -> 0BW0
    BI carries the gradient on to earlier regions; BW may run later, filling bubbles.
    """
    if ir.backward_split:
        raise error("split-twice", "backward is already split into BI and BW", span=d.span,
                    labels=(Label(ir.split_b_span, "split here first"),) if ir.split_b_span else (),
                    hint="keep one `split B into BI, BW`")
    index = ir.index()
    nodes = []
    halves: dict[str, tuple[str, str]] = {}       # a B's key -> its BI's and its BW's
    for node in ir.nodes:
        if node[0] == "B":
            bi, bw = _halves(node)
            nodes += (bi, bw)
            halves[node[8]] = (bi[8], bw[8])
        else:
            nodes.append(node)
    edges = []
    for e in ir.edges:
        if e[0] not in index or e[1] not in index:
            raise KeyError(e[0] if e[0] not in index else e[1])
        src, dst = halves.get(e[0]), halves.get(e[1])
        kind, span = e[2], e[3]
        if src is not None and dst is not None:       # gradient to an earlier region
            edges += [_tuple_new(Edge, (src[0], dst[0], kind, span)), _tuple_new(Edge, (src[0], dst[1], kind, span))]
        elif src is not None:                       # to UPD: weights' gradients
            edges.append(_tuple_new(Edge, (src[1], e[1], kind, span)))
        elif dst is not None:                       # saved activations: both halves need them
            edges += [_tuple_new(Edge, (e[0], dst[0], kind, span)), _tuple_new(Edge, (e[0], dst[1], kind, span))]
        else:
            edges.append(e)
    edges += [Edge(bi, bw) for bi, bw in halves.values()]
    # Distinct edges rewrite to distinct ones (each new edge names the B it came from by its
    # half), unless one joins a B to itself: only then, or where `split MB` did not say its
    # edges are distinct, are they checked.
    if not ir.edge_fact("distinct") or any(e[0] == e[1] for e in ir.edges):
        edges = distinct_edges(edges)
    return ir.with_(nodes=tuple(nodes), edges=tuple(edges), backward_split=True, split_b_span=d.span)


def _halves(node: Node) -> tuple[Node, Node]:
    """`(node.but(op="BI"), node.but(op="BW"))` of a B: where it is a whole pass of a
    microbatch, its keys differ only in the op, so each is one join."""
    op, region, mb, phase, value, peer, devices, stream, _ = node
    if value or mb is None:
        return node.but(op="BI"), node.but(op="BW")
    return (_tuple_new(Node, ("BI", region, mb, phase, value, peer, devices, stream, f"{region}BI{mb}")),
            _tuple_new(Node, ("BW", region, mb, phase, value, peer, devices, stream, f"{region}BW{mb}")))


def place(ir: IR, d: Place) -> IR:
    """`place PP=1 on pp[1]`: the regions the selector picks run on that device group.

    before: node 1F0          after: place 1 @1,3   (mesh dp=2, pp=2)
    """
    if d.selector.op is not None:
        raise error("bad-place", f"place takes regions, not passes: `{d.selector}`", span=d.span,
                    hint="write `place PP=1 on pp[1]`")
    if d.group.mesh != ir.mesh:
        raise error("mesh-mismatch", "this device group belongs to another mesh", span=d.span,
                    hint="take groups from the job's mesh (s.mesh)")
    chosen = regions_matching(ir, d.selector, d.span)
    pairs = check_placement(ir, d, d.group.size, len(chosen))
    ranks = d.group.ranks
    placed = ir.placed()                    # region -> (its ranks, the span that placed it)
    for region in chosen:
        if region.index in placed:
            first = ir.placement_span(region.index)
            labels = (Label(first, "first placed here"),) if first else ()
            raise error("placed-twice", f"region {region.label} is placed twice", span=d.span, labels=labels,
                        hint="place each region once; to run one region on several devices, place it on a "
                             "group such as pp[0] and shard the batch over the other axis")
    targets = {r.index for r in chosen}
    placement = ir.placement + tuple((r, ranks) for r in sorted(targets))
    spans = ir.placement_spans + tuple(d.span for _ in targets)
    # Nodes get their devices in lowering (`resolve_placement`), in one pass.
    out = ir.with_(placement=placement, placement_spans=spans)
    # What `placed()` and the size check read, carried over rather than made again per statement.
    if len(spans) == len(placement):
        table = dict(placed)
        for r in sorted(targets):
            table.setdefault(r, (ranks, d.span))
        out._indexes["placed"] = (placement, table)
    out._indexes["placed_pairs"] = (placement, pairs + len(ranks) * len(targets))
    return out


def shard(ir: IR, d: Shard) -> IR:
    """`shard batch over dp` (data parallel), `shard optimizer, grads, params over dp` (ZeRO-3),
    `shard experts over dp`; tensor parallelism: `shard columns of "**.q_proj" over tp` (likewise
    rows and vocab) and `shard sequence over tp`.

    Records what is divided over which axis (and tensor parallelism's module patterns in
    `tensor_patterns`); lowering inserts the collectives (ALL_REDUCE for DP, REDUCE_SCATTER +
    ALL_GATHER for ZeRO). Several `shard columns of` statements accumulate their patterns under
    one record; tensor parallelism takes an axis of its own, one for all its kinds.
    """
    ir.mesh.check_axis(d.over, span=d.span)
    problem = shard_problem(d.what, d.of, d.span, of_spans=d.of_spans)    # as the front ends do: a
    if problem is not None:                                                # directive may be built by hand
        raise PiperError(problem)
    records, spans = list(ir.sharding), list(ir._sharding_spans())
    for what in d.what:
        previous = ir.sharded(what) if what != "batch" else (d.over if d.over in ir.batch_axes() else None)
        if previous is not None and what in TENSOR_PARALLEL and what != "sequence":
            check_axes(records, spans, what, d.over, d.span)    # more patterns of a kind: on its axis
            continue
        if previous is not None:
            first = ir.sharding_span(what)
            raise error("sharded-twice", f"`{what}` is already sharded over `{previous}`", span=d.span,
                        labels=(Label(first, "sharded here first"),) if first else (),
                        hint="shard each thing once")
        check_axes(records, spans, what, d.over, d.span)
        records.append((what, d.over))
        spans.append(d.span)
    return ir.with_(sharding=tuple(records), sharding_spans=tuple(spans), tensor_patterns=add_patterns(ir, d))


def order(ir: IR, d: Order) -> IR:
    """`order PP=0: F(MB=0); F(MB=1); B(MB=0); ...`: the slots run one after another.

    Adds a temporal edge from every node of a slot to every node of the next;
    items inside one slot may overlap, so get no edge between them.
    before: 0F0, 0F1, 0B0 unordered     after: order 0F0 -> 0F1, order 0F1 -> 0B0
    After `split B into BI, BW`, an item `B(MB=m)` still names the whole
    backward: its BI and BW together, in that slot (DualPipeV mixes whole and
    split backwards in one schedule).
    """
    edges, at, _ = _order_edges(ir, d)
    return _add_ordered(ir, edges, (at[:-1], at[1:]) if at is not None else None, True)


def _add_ordered(ir: IR, new: list[Edge], ends: tuple[list[int], list[int]] | None = None,
                 disjoint: bool = False) -> IR:
    """`ir` with the temporal edges `new`, its edges distinct. Two statements may order the
    same pair; a new temporal edge can repeat only another temporal edge, so only those are
    checked. `disjoint`: no node is in two of the statements that made `new` (a statement's
    own edges never repeat: each node is in one of its slots), so none repeats. Where `ir`
    knows its edges' ends as positions and `ends` gives the new ones', the new IR knows them too."""
    edges = ir.edges
    temporal = [e for e in edges if e[2] == "temporal"]
    if (temporal or not disjoint) and len(dict.fromkeys(map(_IDENTITY, temporal + new))) != len(temporal) + len(new):
        return ir.with_(edges=distinct_edges(edges + tuple(new)))
    ids = ir.known_ids()
    out = ir.with_(edges=edges + tuple(new))
    if not temporal:        # the temporal edges are the new ones, at the end
        out.note_edge_fact("temporal", len(edges))
    if ids is not None:
        if ends is None:
            number = ir.numbering()
            if not all(map(number.__contains__, chain(map(_SRC, new), map(_DST, new)))):
                return out       # an order naming a node the IR lacks: the compiler reports it
            ends = list(map(number.__getitem__, map(_SRC, new))), list(map(number.__getitem__, map(_DST, new)))
        out.known_edge_ids(ids[0] + ends[0], ids[1] + ends[1])
    return out


def order_edges(ir: IR, d: Order) -> list[Edge]:
    """The temporal edges `order` adds (each node is in one slot, so none repeats)."""
    return _order_edges(ir, d)[0]


def _order_edges(ir: IR, d: Order) -> tuple[list[Edge], list[int] | None, list[str]]:
    """`order_edges`; where each slot is one node found directly (a stdlib schedule), the
    positions of those nodes in order (the edges join each to the next); the nodes' keys."""
    scope = sorted({r.index for r in regions_matching(ir, d.selector, d.span)})
    by_pass = ir.by_pass()
    # The usual item, F(MB=3) in an order of one region, names one node: found directly.
    ops = ("F", "BI", "BW") if ir.backward_split else ("F", "B", "BI", "BW")
    direct = {op: by_pass.get((op, scope[0]), {}) for op in ops} if len(scope) == 1 else {}
    found = _one_per_slot(d, direct)
    if found is not None:
        span = d.span
        at = ir._indexes.get("pass_at")
        if at is not None:      # positions by (pass, region), then microbatch: from `split MB`
            at = {op: at.get((op, scope[0])) for op in ops}
            at = [at[n[0]][n[2]] for n in found]
        keys = list(map(_KEY, found))
        return [_tuple_new(Edge, (a, b, "temporal", span)) for a, b in zip(keys, keys[1:])], at, keys
    seen: dict[str, object] = {}
    slots: list[list[Node]] = []
    for s, slot in enumerate(d.slots):
        spans = d.item_spans[s] if d.item_spans and len(d.item_spans) > s else ()
        chosen: list[Node] = []
        for i, item in enumerate(slot):
            span = spans[i] if len(spans) > i else d.span
            matches = _named_nodes(ir, by_pass, item, direct) or _item_nodes(ir, by_pass, item, scope, span, d)
            for n in matches:
                if n.key in seen:
                    raise error("ordered-twice", f"`{item}` ({n.key}) appears twice in this order", span=span,
                                labels=(Label(seen[n.key], "first here"),) if seen[n.key] else (),
                                hint="list each pass of each microbatch once")
                seen[n.key] = span
                chosen.append(n)
        slots.append(chosen)
    added, span = [], d.span
    for before, after in zip(slots, slots[1:]):
        for a in before:
            for b in after:
                added.append(_tuple_new(Edge, (a[8], b[8], "temporal", span)))
    return added, None, list(seen)


def _one_per_slot(d: Order, direct: dict[str, dict]) -> list[Node] | None:
    """The nodes an order names, when each slot is one item `PASS(MB=m)` found directly (a
    stdlib schedule's every slot) and no node comes twice; else None, and `order_edges`
    takes the general way, which also reports what is wrong. Found column by column:
    a schedule at 64 x 512 has 65k items."""
    slots = d.slots
    if not direct or set(map(len, slots)) != {1}:
        return None
    items = list(map(_FIRST, slots))
    tags = list(map(_TAGS, items))
    if set(map(len, tags)) != {1}:
        return None
    tags = list(map(_FIRST, tags))           # ("MB", m)
    if set(map(_FIRST, tags)) != {"MB"}:
        return None
    by_item = {(op, mb): node for op, nodes in direct.items() for mb, node in nodes.items()}
    try:
        nodes = list(map(by_item.__getitem__, zip(map(_ITEM_OP, items), map(_SECOND, tags))))
    except (KeyError, TypeError):
        return None
    return nodes if len(set(map(_KEY, nodes))) == len(nodes) else None


_NONE: dict = {}


def _named_nodes(ir: IR, by_pass: dict, item: Selector, direct: dict[str, dict]) -> tuple[Node, ...] | None:
    """The nodes an item `PASS(MB=m)` (in an order of one region) or `PASS(TAG=t, MB=m)` (the tag
    picking one region: an interleaved schedule's items) names, found directly: one, or a split
    backward's BI and BW for `B`. None where it is anything else, or names a node that is not
    there; `_item_nodes` then finds what it names, or says why not."""
    tags, op = item.tags, item.op
    if len(tags) == 1 and tags[0][0] == "MB":
        per_op, mb = direct, tags[0][1]
    elif len(tags) == 2:
        (name, value), (other, mb) = tags
        if name == "MB":
            name, value, other, mb = other, mb, name, value
        if other != "MB" or type(value) is not int:
            return None
        regions = regions_by_tag(ir).get((name, value))
        if regions is None or len(regions) != 1:
            return None
        region = regions[0].index
        per_op = {o: by_pass.get((o, region), _NONE) for o in ("F", "B", "BI", "BW")}
    else:
        return None
    if type(mb) is not int:
        return None
    if op == "B" and ir.backward_split:       # the whole backward: its two halves, in this order
        bi, bw = per_op.get("BI", _NONE).get(mb), per_op.get("BW", _NONE).get(mb)
        return (bi, bw) if bi is not None and bw is not None else None
    node = per_op.get(op, _NONE).get(mb)
    return (node,) if node is not None else None


def _item_nodes(ir: IR, by_pass: dict, item: Selector, scope: list[int], span, d: Order) -> list[Node]:
    """The compute nodes one order item names, by (mb, region, op); an error if none."""
    if item.op is None or item.op == "UPD":
        raise error("bad-order-item", f"`{item}` is not a pass of a microbatch", span=span,
                    hint="order items are F, B, BI or BW with a microbatch, e.g. F(MB=0)")
    tags = item.tags
    if len(tags) == 1 and tags[0][0] == "MB":      # the usual item, F(MB=3): no region tags
        regions, mb = scope, tags[0][1]
    else:
        region_tags = item.region_tags()
        regions = (sorted({r.index for r in regions_matching(ir, Selector(None, region_tags), span)})
                   if region_tags else scope)
        mb = item.tag("MB")
    ops = ("BI", "BW") if item.op == "B" and ir.backward_split else (item.op,)
    if mb is None or mb == "*":
        matches = [n for op in ops for r in regions for n in by_pass.get((op, r), {}).values()]
    else:
        matches = [by_pass[(op, r)][mb] for op in ops for r in regions if mb in by_pass.get((op, r), ())]
    if not matches:
        raise error("unknown-node", f"no node `{item}` in {d.selector}", span=span,
                    notes=(f"the batch is split into {ir.microbatches} microbatch(es)"
                           + ("; backward is split into BI and BW" if ir.backward_split else
                              "; backward is one B (split B into BI, BW to order them apart)"),),
                    hint="order only microbatches that exist, after `split MB into N`")
    if len(matches) > 1:
        matches.sort(key=lambda n: (n.mb, n.region, n.op))
    return matches
