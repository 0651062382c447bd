"""Tied weights across pipeline stages (Megatron's embedding group).

A parameter used by regions on two device groups (GPT-2's token embedding,
read by the first stage's embedding and the last stage's head) is held by
both: the first region using it on each group owns a copy, in a bucket of
its own in that region's unit. After each copy's gradient is reduced over
its data-parallel group, the two stages exchange it (SEND_T/RECV_T, device i
of one group with device i of the other) and both add the other's, so each
steps its optimizer on the summed gradient and the copies stay identical.
Under ZeRO each copy is sharded over its group like any parameter, and the
exchange is of the gradient shards, which line up because both buckets hold
the one parameter with the same padding.

    lowering:   resolve_placement -> share_across_devices   (copies, UPD nodes)
    compiler:   add_collectives -> add_tie_exchanges        (SEND_T/RECV_T, UPD after them)
    runtime:    runtime/communication/tied_weights.py       (send, receive, add)
"""
from __future__ import annotations

from ..diagnostics import Label, error
from .dag import IR, Edge, Node

GRADS = ("B", "BW")


def share_across_devices(ir: IR, spans: dict) -> IR:
    """Give each device group using a parameter a copy: its first region using it owns one.

    before: region 0 @0 owns wte; region 1 @1 uses wte
    after:  region 0 @0 owns wte; region 1 @1 owns wte (a copy), with 1UPD
    More than two device groups sharing a parameter is refused.
    """
    placed = dict(ir.placement)
    owners: dict[str, list[int]] = {}
    for region in ir.regions:
        for p in region.params:
            groups = [placed[o] for o in owners.get(p, ())]
            if placed[region.index] not in groups:
                owners.setdefault(p, []).append(region.index)
    ties = {p: rs for p, rs in owners.items() if len(rs) > 1}
    if not ties:
        return ir
    for p, rs in ties.items():
        if len(rs) > 2:
            labels = ", ".join(ir.regions[r].label for r in rs)
            raise error("tied-across-devices", f"parameter `{p}` is used by regions on {len(rs)} device groups "
                        f"({labels}); tied weights are shared by two groups at most",
                        span=spans.get(rs[2]), labels=tuple(Label(spans[r], "placed here") for r in rs[:2]
                                                            if spans.get(r)),
                        hint="place the regions using it on at most two device groups (e.g. the first and "
                             "last stage), or untie the weights")
    regions = list(ir.regions)
    nodes, edges = list(ir.nodes), list(ir.edges)
    have_upd = {n.region for n in ir.nodes if n.op == "UPD"}
    by_pass = ir.by_pass()
    for p, rs in ties.items():
        for r in rs[1:]:
            info = regions[r]
            regions[r] = type(info)(info.index, info.tags, info.params, info.owned + (p,), info.loss)
            if r not in have_upd:
                nodes.append(Node("UPD", r))
                have_upd.add(r)
            upd = Node("UPD", r).key
            # Every region on these devices that reads the copy writes its gradient.
            for user in ir.regions:
                if p in user.params and placed[user.index] == placed[r]:
                    for op in GRADS:
                        for n in by_pass.get((op, user.index), {}).values():
                            edges.append(Edge(n.key, upd))
    return ir.with_(regions=tuple(regions), nodes=tuple(nodes), edges=tuple(dict.fromkeys(edges)))


def tied_params(ir: IR) -> dict[str, tuple[int, int]]:
    """Parameter -> the two regions owning a copy, for every tied parameter (sorted by name)."""
    owners: dict[str, list[int]] = {}
    for r in ir.regions:
        for p in r.owned:
            owners.setdefault(p, []).append(r.index)
    return {p: tuple(rs) for p, rs in sorted(owners.items()) if len(rs) > 1}


def tie_ids(ir: IR) -> dict[str, int]:
    """Tied parameter -> its number: the `value` field of its SEND_T/RECV_T nodes."""
    return {p: i for i, p in enumerate(tied_params(ir))}


def units_used(ir: IR) -> dict[int, tuple[int, ...]]:
    """Region -> the owner regions whose units it reads: for each parameter, the owner on its devices."""
    placed = dict(ir.placement)
    owners: dict[str, list[int]] = {}
    for r in ir.regions:
        for p in r.owned:
            owners.setdefault(p, []).append(r.index)
    out = {}
    for r in ir.regions:
        mine = placed.get(r.index)
        units = set()
        for p in r.params:
            rs = owners[p]
            units.add(next((o for o in rs if placed.get(o) == mine), rs[0]))
        out[r.index] = tuple(sorted(units))
    return out


def add_tie_exchanges(ir: IR, order: list[Node], units: dict[int, tuple[int, ...]]):
    """Insert each tied parameter's gradient exchange into the global order.

    before: ... 0B3 0ALL_REDUCE ... 1B3 1ALL_REDUCE ... 0UPD 1UPD
    after:  ... 1ALL_REDUCE 0SEND_T0>1.0 1SEND_T0>0.0 1RECV_T0<0.0 0RECV_T0<1.0 0UPD 1UPD
    The exchange goes after the last gradient (or reduction) of either copy,
    and each copy's UPD (with a ZeRO-1/2 gather after it) after the exchange.
    Returns (order, extra edges).
    """
    ties = tied_params(ir)
    if not ties:
        return order, []
    order = list(order)
    edges: list[Edge] = []
    placed = dict(ir.placement)
    for tie, (p, (a, b)) in enumerate(ties.items()):
        feeds = {a: [], b: []}       # per copy: what its final gradient waits for
        last = 0
        for i, n in enumerate(order):
            for u in (a, b):
                reduced = n.op in ("ALL_REDUCE", "REDUCE_SCATTER") and n.region == u
                computed = n.op in GRADS and u in units.get(n.region, ())
                if reduced or computed:
                    feeds[u].append(n)
                    last = max(last, i)
        for u in (a, b):
            reductions = [n for n in feeds[u] if not n.is_compute]
            feeds[u] = reductions or feeds[u]
        send_a = Node("SEND", a, 0, "T", tie, b, devices=placed[a])
        send_b = Node("SEND", b, 0, "T", tie, a, devices=placed[b])
        recv_b = Node("RECV", b, 0, "T", tie, a, devices=placed[b])
        recv_a = Node("RECV", a, 0, "T", tie, b, devices=placed[a])
        exchange = [send_a, send_b, recv_b, recv_a]
        edges += [Edge(n.key, send_a.key) for n in feeds[a]] + [Edge(n.key, send_b.key) for n in feeds[b]]
        edges += [Edge(send_a.key, recv_b.key), Edge(send_b.key, recv_a.key)]
        edges += [Edge(recv_a.key, Node("UPD", a).key), Edge(recv_b.key, Node("UPD", b).key)]
        # Each copy's update (and the gather of updated shards after it) moves behind the exchange.
        moved = {Node("UPD", a).key, Node("UPD", b).key, Node("ALL_GATHER", a).key, Node("ALL_GATHER", b).key}
        early = [n for n in order[:last + 1] if n.key in moved]
        kept = [n for n in order[:last + 1] if n.key not in moved]
        order = kept + exchange + early + order[last + 1:]
    return order, edges


def state_keys(model) -> dict[str, str]:
    """`model.state_dict()` key -> the name Piper keeps that tensor under.

    Capture names each parameter once (a tied weight by its first name), and
    keeps every buffer; the state dict lists a tied weight under each of its
    names and leaves non-persistent buffers out.
    """
    canonical: dict[int, str] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        canonical.setdefault(id(t), name)
    return {k: canonical.get(id(t), k) for k, t in model.state_dict(keep_vars=True).items()}
