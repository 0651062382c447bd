"""Which arrivals prove a send delivered: a worker can let go of a sent tensor mid-step.

A send's work holds the tensor it sends until it is waited for, and Gloo reports a send
complete only once it is waited for; waiting for one the peer has not received yet blocks
the step, and may deadlock it (the peer may be waiting on this device). So the runtime
waits for a send only where the plans prove it delivered: device `a` sent S to `b`; `b`
waited for S before it sent R back to `a`; once `a` has R, S has arrived, and waiting for
it returns at once. In a pipeline the gradient of microbatch k proves its activation
delivered, and an interleaved schedule's next activation the one before it. Without this a
device held every sent activation and gradient of the step until the step's end (torch's
schedules wait for each send within the step too).

An overlapped slot (`slots.spans`) runs its actions in an order of its own: inside one, a
wait counts as its stretch's last position and a send as its first, so the proof never
rests on an order the lanes do not keep.
"""
from __future__ import annotations

import bisect


def sends_received(plans: dict, stretches: dict | None = None) -> dict[int, dict[str, tuple[str, ...]]]:
    """rank -> {RECV key: the keys of that rank's SENDs whose delivery its arrival proves}.

    `plans` maps rank -> its plan (`Action`s); `stretches` rank -> [(start, stop)] of its
    overlapped slots' plan ranges. A send no arrival proves is left out (waited at the step's end).

        a: SEND_F0>b  RECV_B0<b        b: RECV_F0<a  F0 (waits RECV_F0)  B0  SEND_B0>a
        -> {a: {"RECV_B0<b": ("SEND_F0>b",)}}
    """
    stretches = stretches or {}
    waited, sent, recv_of = {}, {}, {}
    for rank, plan in plans.items():
        ranges = sorted(stretches.get(rank, ()))
        first_wait: dict[str, int] = {}
        for i, action in enumerate(plan):
            for key in action.waits:
                first_wait.setdefault(key, i)
        waited[rank] = {k: _latest(i, ranges) for k, i in first_wait.items()}
        for i, action in enumerate(plan):
            op = action.node.op
            if op == "SEND":
                sent.setdefault((rank, action.peer), []).append((_earliest(i, ranges), action.tag, action.key))
            elif op == "RECV":
                recv_of[(action.peer, rank, action.tag)] = action.key
    out: dict[int, dict[str, list]] = {}
    for (a, b), sends in sent.items():
        # b's sends back to a, in b's order, each with where a first waits for it
        back = sorted((pos, waited[a].get(recv_of.get((b, a, tag)), _NEVER), recv_of.get((b, a, tag)))
                      for pos, tag, _ in sent.get((b, a), ()))
        if not back:
            continue
        positions = [pos for pos, _, _ in back]
        soonest = _suffix_soonest(back)
        for _, tag, key in sends:
            at_b = waited[b].get(recv_of.get((a, b, tag)))
            if at_b is None:
                continue
            k = bisect.bisect_right(positions, at_b)       # b's first send after it waited for this one
            if k < len(back) and soonest[k][0] != _NEVER:
                out.setdefault(a, {}).setdefault(soonest[k][1], []).append(key)
    return {rank: {k: tuple(v) for k, v in by_recv.items()} for rank, by_recv in out.items()}


_NEVER = float("inf")


def _suffix_soonest(back: list) -> list[tuple]:
    """For each position of `back`, the (wait position, RECV key) of the soonest-waited arrival at or after it."""
    out, best = [None] * len(back), (_NEVER, None)
    for k in range(len(back) - 1, -1, -1):
        _, wait, key = back[k]
        if key is not None and wait < best[0]:
            best = (wait, key)
        out[k] = best
    return out


def _span_of(i: int, ranges: list) -> tuple | None:
    k = bisect.bisect_right(ranges, (i, _NEVER)) - 1
    if k >= 0 and ranges[k][0] <= i < ranges[k][1]:
        return ranges[k]
    return None


def _latest(i: int, ranges: list) -> int:
    """Where a wait at plan position `i` has surely happened by."""
    span = _span_of(i, ranges)
    return span[1] - 1 if span else i


def _earliest(i: int, ranges: list) -> int:
    """Where a send at plan position `i` may already be issued."""
    span = _span_of(i, ranges)
    return span[0] if span else i
