"""Lowering passes: from the strategy's DAG to one with every communication.

Run by `piper.compiler.plans.compile_ir` in this order:

1. `resolve_placement`  every region on a device group; groups match the batch axes
2. `add_transfers`      SEND/RECV on every data edge that crosses device groups
3. `zero_levels`        which of optimizer / grads / params each region shards

Collectives (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER) are placed by the
scheduler once the compute order is known, since where a ZeRO-3 all-gather
goes depends on what runs before it.
"""
from __future__ import annotations

from collections import Counter
from itertools import chain, compress, repeat
from operator import add, itemgetter, mul, not_

from ..diagnostics import Diagnostic, Label, Span, error
from .dag import _DST, _SRC, COMPUTE, IR, Edge, Node, node_key
from .mesh_coords import varying_axes
from .table import Table, unknown_edge
from .tied import share_across_devices

_tuple_new = tuple.__new__
_OP_REGION_MB, _KIND = itemgetter(0, 1, 2), itemgetter(2)
_OP_REGION = itemgetter(0, 1)
_COMPUTE = frozenset(COMPUTE)
_PASS_OPS = frozenset(("F", "B", "BI", "BW"))


def resolve_placement(ir: IR, warnings: list[Diagnostic]) -> IR:
    """Check placement and fill the default.

    A strategy that places nothing runs every region on every device (pure
    DP/ZeRO). Otherwise every region must be placed, and each region's group
    must span exactly the axes the batch is sharded over: that is what makes
    the replicas of a region divide its work rather than repeat it.
    """
    mesh = ir.mesh
    if not ir.placement:
        everyone = tuple(range(mesh.world_size))      # `mesh.group().ranks`, without a dict per device
        ir = ir.with_(placement=tuple((r.index, everyone) for r in ir.regions))
    placed = {r for r, _ in ir.placement}
    missing = [r for r in ir.regions if r.index not in placed]
    if missing:
        names = ", ".join(r.label for r in missing)
        raise error("unplaced-region", f"region{'s' if len(missing) > 1 else ''} {names} "
                    f"{'are' if len(missing) > 1 else 'is'} never placed",
                    hint=f"add `place {missing[0].label} on ...` (or place nothing, to run every region "
                         "on every device)")
    batch_axes = ir.batch_axes()
    # The tensor-parallel axis divides a region's work too: its devices hold shards, not copies.
    tensor = ir.tensor_axis()
    dividing = batch_axes + ((tensor,) if tensor is not None else ())
    spans = {r: ir.placement_span(r) for r, _ in ir.placement}
    varying_of: dict[int, set] = {}
    for region in ir.regions:
        ranks = ir.devices_of(region.index)
        varying = found if (found := varying_of.get(id(ranks))) is not None else \
            varying_of.setdefault(id(ranks), varying_axes(mesh, ranks))     # regions share their groups
        expected = 1
        for a in dividing:
            expected *= mesh.size(a)
        # Where nothing was placed, the statement to blame is the `shard batch`.
        span = spans.get(region.index) or ir.sharding_span("batch")
        if varying - set(dividing):
            extra = sorted(varying - set(dividing))
            raise error("undivided-work", f"region {region.label} runs on {len(ranks)} devices across "
                        f"`{', '.join(extra)}` but nothing divides its work over {'them' if len(extra) > 1 else 'it'}",
                        span=span,
                        hint=f"add `shard batch over {extra[0]}`, or place the region on a group that fixes "
                             f"`{extra[0]}` (and every other axis the batch is not sharded over)")
        # An axis of size 1 never varies: sharding over it covers nothing and needs nothing.
        missing = {a for a in dividing if mesh.size(a) > 1} - varying
        if tensor in missing:
            raise error("batch-not-covered", f"the model is divided over `{tensor}` but region {region.label} runs "
                        f"on {len(ranks)} device(s) at one `{tensor}` index", span=span,
                        hint=f"place every region on a group that spans `{tensor}` (e.g. pp[s], not tp[0])")
        if len(ranks) != expected or missing:
            others = [a for a in mesh.names if a not in batch_axes]
            example = f", e.g. {others[0]}[s] with the batch sharded over {batch_axes[0]}" if others else ""
            raise error("batch-not-covered", f"the batch is sharded over `{', '.join(batch_axes)}` "
                        f"({expected} shards) but region {region.label} runs on {len(ranks)} device(s)",
                        span=span,
                        hint="place every region on a group that spans exactly the batch axes" + example)
    # A parameter used by regions on different devices (tied weights): each group holds a copy.
    ir = share_across_devices(ir, spans)
    placed = dict(ir.placement)
    known = ir._indexes
    ir = ir.with_(nodes=tuple([_tuple_new(Node, (op, r, mb, phase, value, peer, placed[r], stream, key))
                               for op, r, mb, phase, value, peer, _, stream, key in ir.nodes]))
    # The nodes keep their keys and positions: so do the indexes of them that hold no node.
    ir._indexes.update((k, v) for k, v in known.items() if k in ("number", "ids", "ops", "pass_at", "temporal"))
    # One warning per axis of size 1, naming all that is sharded over it (`shard optimizer, grads,
    # params over dp` is one statement, and zero3's two lines one `use`); further lines are labels.
    size_one: dict[str, list[tuple[str, Span | None]]] = {}
    for (what, axis), span in zip(ir.sharding, ir.sharding_spans + (None,) * len(ir.sharding)):
        if mesh.size(axis) == 1:
            size_one.setdefault(axis, []).append((what, span))
    for axis, items in size_one.items():
        spans = list(dict.fromkeys(span for _, span in items if span is not None))
        whats = ", ".join(dict.fromkeys(what for what, _ in items))
        warnings.append(Diagnostic("shard-size-one", f"`shard {whats} over {axis}` divides over an axis "
                                   "of size 1: it does nothing", "warning", spans[0] if spans else None,
                                   tuple(Label(s, f"also shards over `{axis}`") for s in spans[1:]),
                                   hint=f"grow `{axis}` in the mesh or drop the statement"))
    return ir


def zero_levels(ir: IR) -> int:
    """0: replicated state, 1: optimizer sharded, 2: + gradients, 3: + parameters."""
    axes = {what: axis for what, axis in ir.sharding if what in ("optimizer", "grads", "params")}
    spans = {what: ir.sharding_span(what) for what, _ in ir.sharding}
    batch = ir.batch_axes()
    for what, axis in axes.items():
        if axis not in batch:
            raise error("shard-without-batch", f"`{what}` is sharded over `{axis}` but the batch is not",
                        span=spans[what], hint=f"add `shard batch over {axis}`: ZeRO shards state over the "
                                               "data-parallel axis")
        if len(batch) > 1:
            raise error("unsupported-sharding", f"ZeRO over `{axis}` with the batch sharded over "
                        f"{', '.join(batch)} is not supported yet", span=spans[what],
                        hint="shard the batch over one axis")
    if "grads" in axes and "optimizer" not in axes:
        raise error("incomplete-zero", "gradients are sharded but optimizer state is not", span=spans["grads"],
                    hint="shard optimizer, grads over the same axis (ZeRO-2)")
    if "params" in axes and not {"grads", "optimizer"} <= set(axes):
        raise error("incomplete-zero", "parameters are sharded but not gradients and optimizer state",
                    span=spans["params"], hint="write `shard optimizer, grads, params over dp` (ZeRO-3)")
    if len(set(axes.values())) > 1:
        raise error("unsupported-sharding", "optimizer, grads and params are sharded over different axes",
                    span=spans.get("params") or spans.get("grads"), hint="shard them over one axis")
    return 3 if "params" in axes else 2 if "grads" in axes else 1 if "optimizer" in axes else 0


def add_transfers(ir: IR) -> IR:
    """Insert SEND/RECV on each value edge whose regions run on different groups.

    before: 0F0 -> 1F0, 1B0 -> 0B0            (regions 0 and 1 on different devices)
    after:  0F0 -> 0SEND_F0>1.0 -> 1RECV_F0<0.0 -> 1F0,
            1B0 -> 1SEND_B0>0.0 -> 0RECV_B0<1.0 -> 0B0
    One transfer per value, microbatch and receiving region.

    The IR as objects, with its `edge_ids`; the compiler reads `lower_transfers`' table.
    """
    return lower_transfers(ir).lowered_ir()


def lower_transfers(ir: IR) -> Table:
    """`add_transfers` as a `Table`: the transfers' nodes are numbered, not made.

    For each value crossing from its producer's group to a consumer's, every
    microbatch gets the same few transfers, so each (value, consumer) adds one
    block of nodes and its edges as whole columns (`_transfer_block`)."""
    distinct = ir.keys_distinct()
    if not distinct:         # a key twice names one node, as `schedule` has always taken it
        ir = ir.with_(nodes=tuple(ir.index().values()))
    nodes = list(ir.nodes)
    try:
        src0, dst0 = ir.edge_ids()      # handed on by the statements where they could
    except KeyError:
        raise unknown_edge(ir.edges, ir.numbering()) from None
    width = len(nodes)
    table = Table(ir, nodes, [], [], [])
    table.vouched = distinct and _COMPUTE.issuperset(table.ops)
    table.mirrored = "SEND" not in table.ops and "RECV" not in table.ops      # its own transfers are
    drop: set[int] = set()           # the data edges the transfers replace, as src * width + dst
    at = ir._indexes.get("pass_at")      # each pass's nodes by microbatch, from `split MB`
    table.passes = ({k: list(v) for k, v in at.items()} if at is not None and distinct
                    else _pass_positions(nodes, ir.microbatches))
    _add_transfers(ir, table, table.passes, drop, width)
    edges, hit = ir.edges, [False] * len(ir.edges)
    if drop:
        hit = list(map(drop.__contains__, map(add, map(mul, src0, repeat(width)), dst0)))
        for i in compress(range(len(edges)), hit):
            hit[i] = edges[i][2] == "data"      # an order between the same two passes stays
    keep = list(map(not_, hit))
    table.kept = list(compress(edges, keep))
    table.src = list(compress(src0, keep)) + table.src
    table.dst = list(compress(dst0, keep)) + table.dst
    table.lowered_nodes, table.lowered_edges = len(table.nodes), len(table.src)
    # New edges reach a new SEND/RECV or leave one, once per (value, consumer, microbatch).
    table.distinct = len(table.src)
    return table


def _pass_positions(nodes: list[Node], microbatches: int) -> dict[tuple[str, int], list[int | None]]:
    """(pass, region) -> the position of its node for each microbatch (None where missing)."""
    found: dict[tuple[str, int], list] = {}
    for i, (op, region, mb) in enumerate(map(_OP_REGION_MB, nodes)):
        if op in _PASS_OPS and mb is not None and mb < microbatches:
            at = found.get((op, region))
            if at is None:
                at = found[(op, region)] = [None] * microbatches
            at[mb] = i
    return found


def _add_transfers(ir: IR, table: Table, positions: dict, drop: set[int], width: int) -> None:
    """Every value's transfers into `table`, and the data edges they replace into `drop`."""
    group = {r: ir.devices_of(r) for r in range(len(ir.regions))}
    grad_ops = ("BI", "BW") if ir.backward_split else ("B",)

    def at(op: str, region: int) -> list[int]:
        found = positions.get((op, region))
        if found is None or None in found:
            mb = 0 if found is None else found.index(None)
            raise AssertionError(f"edge to unknown node {node_key(op, region, mb)}")
        return found

    for v in ir.values:
        p = v.producer
        # One activation transfer per receiving group, named after its first consumer.
        first_on: dict[tuple, int] = {}
        recvs_of: dict[int, list] = {}       # first consumer -> its receives' numbers by microbatch
        consumers = tuple(dict.fromkeys(v.consumers))
        for c in consumers:
            first_on.setdefault(group[c], c)
        for c in consumers:
            if group[p] == group[c]:
                continue
            first = first_on[group[c]]
            grads = [at(op, p) for op in grad_ops]
            ends = (at("F", p), at("F", c), at("BI" if ir.backward_split else "B", c), grads)
            recvs_of[c] = _transfer_block(table, v, p, c, first, group, ends, recvs_of.get(first))
            forward_p, forward_c, back_c, _ = ends
            drop.update(map(add, map(mul, forward_p, repeat(width)), forward_c))
            if v.differentiable:
                for t in grads:
                    drop.update(map(add, map(mul, back_c, repeat(width)), t))


def _transfer_block(table: Table, v, p: int, c: int, first: int, group: dict, ends: tuple,
                    received: list[int] | None) -> list[int] | None:
    """One (value, consumer)'s transfers and edges for every microbatch, as columns.

    Per microbatch, in the order the edges have always come: the consumer that
    names the transfer gets SEND, RECV (`fp -> S -> R -> fc`); another on the
    same group reads the first's receive (`R -> fc`); a differentiable value's
    gradient comes back (`GR -> each grad pass`, `bc -> GS -> GR`). Returns the
    numbers of the activation receives, when this consumer made them."""
    forward_p, forward_c, back_c, grads = ends
    count = len(forward_p)
    i, gp, gc = v.index, group[p], group[c]
    specs, peers = [], []
    if c == first:
        specs += [("SEND", p, "F", i, first, gp), ("RECV", first, "F", i, p, gc)]
        peers += [gc, gp]
    if v.differentiable:
        specs += [("SEND", c, "B", i, p, gc), ("RECV", p, "B", i, c, gp)]
        peers += [gp, gc]
    if not specs:       # a non-differentiable value a later consumer on the group reads from the first's receive
        table.src += received
        table.dst += forward_c
        return None
    base, stride = len(table.nodes), len(specs)
    # One int object per number, shared by the pairs and both ends of every edge it is on.
    column = [list(range(base + off, base + stride * count, stride)) for off in range(stride)]
    # A SEND's pair is its own number, its RECV's the SEND's (the node before it).
    table.add_block(count, specs, peers, list(chain.from_iterable(zip(*(column[off - off % 2]
                                                                       for off in range(stride))))))
    srcs, dsts = [], []
    if c == first:
        sends, received = column[0], column[1]
        srcs += [forward_p, sends, received]
        dsts += [sends, received, forward_c]
    else:
        srcs.append(received)
        dsts.append(forward_c)
    if v.differentiable:
        gsends, grecvs = column[-2], column[-1]
        srcs += [grecvs] * len(grads) + [back_c, gsends]
        dsts += [*grads, gsends, grecvs]
    table.src += chain.from_iterable(zip(*srcs))
    table.dst += chain.from_iterable(zip(*dsts))
    return column[1] if c == first else None


def temporal_edges(ir: IR) -> tuple[list[Edge], list[Node], list[Node]]:
    """The `order` statements' edges, and the nodes at their sources and at their ends."""
    ids = ir.known_ids()
    if ids is None:
        index = ir.index()
        edges = [e for e in ir.edges if e.kind == "temporal"]
        return edges, list(map(index.__getitem__, map(_SRC, edges))), list(map(index.__getitem__, map(_DST, edges)))
    nodes, edges = ir.nodes, ir.edges
    start = ir.edge_fact("temporal")       # where `order` says its edges begin: all the rest are its
    if start is not None:
        at = range(start, len(edges))
    else:
        at = list(compress(range(len(edges)), map("temporal".__eq__, map(_KIND, edges))))
    return (list(map(edges.__getitem__, at)), list(map(nodes.__getitem__, map(ids[0].__getitem__, at))),
            list(map(nodes.__getitem__, map(ids[1].__getitem__, at))))


def check_orders(ir: IR, warnings: list[Diagnostic], temporal: tuple[list, list, list] | None = None) -> None:
    """Warn where an `order` covers a pass for some microbatches but not all, or
    orders a BI but not its BW: the rest then run wherever the default puts them.
    `temporal` is `temporal_edges(ir)`, if the caller has it."""
    edges, srcs, dsts = temporal_edges(ir) if temporal is None else temporal
    statements: dict[tuple, dict[str, Node]] = {}    # (span, devices) -> the nodes it orders
    ordered: dict[str, Node] = {}
    span = devices = object()
    for e, src, dst in zip(edges, srcs, dsts):
        # A statement's edges come one after another: look its entry up again only
        # when the span or devices change (hashing a span is not free).
        if e[3] is not span or src[6] is not devices:
            span, devices = e[3], src[6]
            ordered = statements.setdefault((span, devices), {})
        ordered[e[0]] = src
        ordered[e[1]] = dst
    for (span, _), ordered in statements.items():
        counts = Counter(map(_OP_REGION, ordered.values()))
        for (op, region), count in sorted(counts.items()):
            if count < ir.microbatches:
                mbs = {n[2] for n in ordered.values() if n[0] == op and n[1] == region}
                missing = sorted(set(range(ir.microbatches)) - mbs)
                warnings.append(Diagnostic(
                    "partial-order", f"this order lists {op} of region {ir.regions[region].label} for "
                    f"{len(mbs)} of {ir.microbatches} microbatches (not {', '.join(map(str, missing[:6]))}"
                    f"{', ...' if len(missing) > 6 else ''})", "warning", span,
                    hint="list every microbatch, or check the loop bounds against `split MB into N`"))
            if op == "BI" and ("BW", region) in counts:
                passes = {(n[0], n[2]) for n in ordered.values() if n[1] == region}
                orphans = sorted(mb for o, mb in passes if o == "BI" and ("BW", mb) not in passes)
                if orphans:
                    warnings.append(Diagnostic(
                        "bi-without-bw", f"this order runs BI of region {ir.regions[region].label} for "
                        f"microbatch {orphans[0]} but never its BW", "warning", span,
                        hint="add the BW(MB=...) slot; without it the weight gradient runs wherever the "
                             "default order puts it"))
