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

from itertools import compress
from operator import itemgetter, not_

from ..diagnostics import Diagnostic, error
from .dag import _DST, _IDENTITY, _SRC, COMPUTE, IR, Edge, Node, data_edge, node_key
from .tied import share_across_devices

_tuple_new = tuple.__new__
_OP = itemgetter(0)
_TRANSFER_OPS = frozenset(("SEND", "RECV"))
_COMPUTE = frozenset(COMPUTE)


def resolve_placement(ir: IR, warnings: list[Diagnostic]) -> IR:
    """Check placement and fill the default.

    A strategy that places nothing runs every region on every device (pure
    DP/ZeRO). Otherwise every region must be placed, and each region's group
    must span exactly the axes the batch is sharded over: that is what makes
    the replicas of a region divide its work rather than repeat it.
    """
    mesh = ir.mesh
    if not ir.placement:
        everyone = mesh.group().ranks
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
    spans = {r: ir.placement_span(r) for r, _ in ir.placement}
    for region in ir.regions:
        ranks = ir.devices_of(region.index)
        coords = [mesh.coords(rank) for rank in ranks]
        varying = {a for a in mesh.names if len({c[a] for c in coords}) > 1}
        expected = 1
        for a in batch_axes:
            expected *= mesh.size(a)
        # Where nothing was placed, the statement to blame is the `shard batch`.
        span = spans.get(region.index) or ir.sharding_span("batch")
        if varying - set(batch_axes):
            extra = sorted(varying - set(batch_axes))
            raise error("undivided-work", f"region {region.label} runs on {len(ranks)} devices across "
                        f"`{', '.join(extra)}` but nothing divides its work over {'them' if len(extra) > 1 else 'it'}",
                        span=span,
                        hint=f"add `shard batch over {extra[0]}`, or place the region on a group that fixes "
                             f"`{extra[0]}` (and every other axis the batch is not sharded over)")
        # An axis of size 1 never varies: sharding over it covers nothing and needs nothing.
        missing = {a for a in batch_axes if mesh.size(a) > 1} - varying
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
    ir = ir.with_(nodes=tuple([_tuple_new(Node, (op, r, mb, phase, value, peer, placed[r], stream, key))
                               for op, r, mb, phase, value, peer, _, stream, key in ir.nodes]))
    for (what, axis), span in zip(ir.sharding, ir.sharding_spans + (None,) * len(ir.sharding)):
        if mesh.size(axis) == 1:
            warnings.append(Diagnostic("shard-size-one", f"`shard {what} over {axis}` divides over an axis "
                                       "of size 1: it does nothing", "warning", span,
                                       hint=f"grow `{axis}` in the mesh or drop the statement"))
    return ir


def zero_levels(ir: IR) -> int:
    """0: replicated state, 1: optimizer sharded, 2: + gradients, 3: + parameters."""
    axes = {what: axis for what, axis in ir.sharding if what not in ("batch", "experts")}
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

    The new IR's `edge_ids` come with it: every new edge's ends are known
    positions (a new node's, or a compute's in the IR before).
    """
    group = {r: ir.devices_of(r) for r in range(len(ir.regions))}
    split = ir.backward_split
    back = "BI" if split else "B"
    by_pass = ir.by_pass()
    number = ir.numbering()
    microbatches = list(range(ir.microbatches))    # one int object per microbatch, shared by every node
    known = True        # every edge's ends are nodes of the IR, so their positions are known

    def keys(op: str, region: int) -> tuple[list[str], list[int | None]]:
        """The keys of `op` of `region` by microbatch (shared with the nodes' own), and their positions."""
        nonlocal known
        found = by_pass.get((op, region), {})
        out = [found[mb].key if mb in found else node_key(op, region, mb) for mb in microbatches]
        at = list(map(number.get, out))
        known = known and None not in at
        return out, at

    nodes = list(ir.nodes)
    drop: set[tuple[str, str, str]] = set()     # the data edges the transfers replace
    edges: list[Edge] = []
    src_ids: list[int] = []                      # the new edges' ends, as positions in `nodes`
    dst_ids: list[int] = []
    for v in ir.values:
        p = v.producer
        # One activation transfer per receiving group, named after its first consumer.
        first_on: dict[tuple, int] = {}
        recvs_at: dict[int, list[int]] = {}      # first consumer -> its receives' positions by microbatch
        consumers = tuple(dict.fromkeys(v.consumers))
        for c in consumers:
            first_on.setdefault(group[c], c)
        for c in consumers:
            if group[p] == group[c]:
                continue
            first = first_on[group[c]]
            (forward_p, fp_at), (forward_c, fc_at), (back_c, bc_at) = keys("F", p), keys("F", c), keys(back, c)
            grads = [keys(op, p) for op in (("BI", "BW") if split else ("B",))]
            grads_p, gp_at = list(zip(*(k for k, _ in grads))), list(zip(*(at for _, at in grads)))
            if c == first:
                sends = _transfers("SEND", p, "F", v.index, first, group[p], microbatches)
                recvs = _transfers("RECV", first, "F", v.index, p, group[c], microbatches)
                recv_at = recvs_at[c] = []
            else:
                recv_keys = [node_key("RECV", first, mb, "F", v.index, p) for mb in microbatches]
                recv_at = recvs_at[first]
            if v.differentiable:
                gsends = _transfers("SEND", c, "B", v.index, p, group[c], microbatches)
                grecvs = _transfers("RECV", p, "B", v.index, c, group[p], microbatches)
            for mb in microbatches:
                f_p, f_c = forward_p[mb], forward_c[mb]
                if c == first:
                    send, recv = sends[mb], recvs[mb]
                    at = len(nodes)
                    nodes += (send, recv)
                    recv_key = recv[8]
                    recv_at.append(at + 1)
                    edges += (data_edge(f_p, send[8]), data_edge(send[8], recv_key))
                    src_ids += (fp_at[mb], at)
                    dst_ids += (at, at + 1)
                else:
                    recv_key = recv_keys[mb]
                drop.add((f_p, f_c, "data"))
                edges.append(data_edge(recv_key, f_c))
                src_ids.append(recv_at[mb])
                dst_ids.append(fc_at[mb])
                if not v.differentiable:
                    continue
                gsend, grecv = gsends[mb], grecvs[mb]
                at = len(nodes)
                nodes += (gsend, grecv)
                b_c = back_c[mb]
                for t, t_at in zip(grads_p[mb], gp_at[mb]):
                    drop.add((b_c, t, "data"))
                    edges.append(data_edge(grecv[8], t))
                    src_ids.append(at + 1)
                    dst_ids.append(t_at)
                edges += (data_edge(b_c, gsend[8]), data_edge(gsend[8], grecv[8]))
                src_ids += (bc_at[mb], at)
                dst_ids += (at, at + 1)
    return _with_transfers(ir, nodes, edges, drop, (src_ids, dst_ids), number, known)


def _with_transfers(ir: IR, nodes: list, edges: list, drop: set, ids: tuple[list[int], list[int]], number: dict,
                    known: bool) -> IR:
    """`ir` with the transfers' nodes and edges in place of the data edges they replace; its
    `edge_ids` set from `ids` (the new edges' ends) when every end's position is known."""
    src_ids, dst_ids = ids
    kept = list(compress(ir.edges, map(not_, map(drop.__contains__, map(_IDENTITY, ir.edges)))))
    # Every new edge ends at or starts from a new SEND/RECV, once per (value, consumer,
    # microbatch): none repeats another or one kept, and the IR's own are distinct.
    out = ir.with_(nodes=tuple(nodes), edges=(*kept, *edges))
    ops = frozenset(map(_OP, ir.nodes))
    if len(number) == len(ir.nodes) and ops <= _COMPUTE:
        # The IR's keys were distinct and its nodes all computes; the new ones are one
        # per (value, sending region, receiving region, microbatch): all distinct.
        out.vouch_distinct(ops | _TRANSFER_OPS if edges else ops)
    if known:
        try:
            kept_src = list(map(number.__getitem__, map(_SRC, kept)))
            kept_dst = list(map(number.__getitem__, map(_DST, kept)))
        except KeyError:       # an edge to an unknown node: `schedule` reports it
            return out
        out.known_edge_ids(kept_src + src_ids, kept_dst + dst_ids)
    return out


def _transfers(op: str, region: int, phase: str, value: int, peer: int, devices: tuple[int, ...],
               microbatches: list[int]) -> list[Node]:
    """`Node(op, region, mb, phase, value, peer, devices=devices)` for every
    microbatch `mb`: the keys differ only in the microbatch, so each is one
    join rather than a `node_key` call (add_transfers makes 100k+ of these)."""
    head = f"{region}{op}_{phase}"
    tail = f"{'>' if op == 'SEND' else '<'}{peer}.{value}"
    return [_tuple_new(Node, (op, region, mb, phase, value, peer, devices, None, f"{head}{mb}{tail}"))
            for mb in microbatches]


def temporal_edges(ir: IR) -> list[tuple[Edge, Node, Node]]:
    """The `order` statements' edges, each with the nodes at its ends."""
    index = ir.index()
    return [(e, index[e.src], index[e.dst]) for e in ir.edges if e.kind == "temporal"]


def check_orders(ir: IR, warnings: list[Diagnostic], temporal: list[tuple[Edge, Node, Node]] | None = None) -> None:
    """Warn where an `order` covers a pass for some microbatches but not all, or
    orders a BI but not its BW: the rest then run wherever the default puts them.
    `temporal` is `temporal_edges(ir)`, if the caller has it."""
    if temporal is None:
        temporal = temporal_edges(ir)
    statements: dict[tuple, dict[str, Node]] = {}    # (span, devices) -> the nodes it orders
    ordered: dict[str, Node] = {}
    span = devices = object()
    for e, src, dst in temporal:
        # A statement's edges come one after another: look its entry up again only
        # when the span or devices change (hashing a span is not free).
        if e.span is not span or src.devices is not devices:
            span, devices = e.span, src.devices
            ordered = statements.setdefault((span, devices), {})
        ordered[e.src] = src
        ordered[e.dst] = dst
    for (span, _), ordered in statements.items():
        by_pass: dict[tuple[str, int], set[int]] = {}
        for n in ordered.values():
            by_pass.setdefault((n.op, n.region), set()).add(n.mb)
        for (op, region), mbs in sorted(by_pass.items()):
            if len(mbs) < ir.microbatches:
                missing = sorted(set(range(ir.microbatches)) - mbs)
                warnings.append(Diagnostic(
                    "partial-order", f"this order lists {op} of region {ir.regions[region].label} for "
                    f"{len(mbs)} of {ir.microbatches} microbatches (not {', '.join(map(str, missing[:6]))}"
                    f"{', ...' if len(missing) > 6 else ''})", "warning", span,
                    hint="list every microbatch, or check the loop bounds against `split MB into N`"))
            if op == "BI" and ("BW", region) in by_pass:
                orphans = sorted(mbs - by_pass[("BW", region)])
                if orphans:
                    warnings.append(Diagnostic(
                        "bi-without-bw", f"this order runs BI of region {ir.regions[region].label} for "
                        f"microbatch {orphans[0]} but never its BW", "warning", span,
                        hint="add the BW(MB=...) slot; without it the weight gradient runs wherever the "
                             "default order puts it"))
