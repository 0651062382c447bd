"""Chrome / Perfetto traces of a step: what each device did, and when.

`job.trace("run.json")` writes the last steps of a real run (the executor
records each action's start and end, and when each communication completed);
`simulation_trace(plans, sim)` writes a simulated step in the same form, so
a prediction and a measurement open side by side in ui.perfetto.dev or
chrome://tracing.

The format is the JSON trace-event format: one process per device, one
thread (track) per lane of compute (lane 0 runs the plan; lanes 1.. run the
other items of an overlapped slot), one track for communication (a receive
or collective spans from its issue to its completion), and a flow arrow from
each send to its receive. Every slice is named as in `piper show` (`1F3`,
`0SEND_F3>1.0`, `0ALL_GATHER_F3`).
"""
from __future__ import annotations

import json

STEP_TID, COMM_TID = 0, 99          # the step track and the communication track of every device
_LANE_TID = 1                        # lane k is thread _LANE_TID + k


def _category(node) -> str:
    if node.is_compute:
        return node.op
    if node.op in ("SEND", "RECV"):
        return "p2p"
    return "collective"


def _args(node) -> dict:
    out = {"region": node.region, "op": node.op}
    if node.mb is not None:
        out["microbatch"] = node.mb
    if node.phase:
        out["pass"] = node.phase
    return out


def build(spans: dict[int, list[tuple]], plans, *, names: dict[int, str] | None = None,
          steps: dict[int, list[tuple[float, float, int]]] | None = None, scale: float = 1e6,
          meta: dict | None = None) -> dict:
    """The trace-event document for `spans`: rank -> [(key, start, end, lane)], `lane` an int for
    computes and None for communication, times in seconds (`scale` converts to microseconds).

    `plans` (rank -> that device's actions) give each action's node, and pair
    each SEND with its RECV (same tag, each the other's peer) for the flow arrows.
    `steps`: rank -> [(start, end, step number)] drawn on a track of their own.
    """
    origin = min([s[1] for ss in spans.values() for s in ss] +
                 [s[0] for ss in (steps or {}).values() for s in ss] + [0.0])
    events: list[dict] = []

    def us(t: float) -> float:
        return round((t - origin) * scale, 3)

    flows_out: dict[tuple, list] = {}         # (src, dst, tag) -> [send ts, ...]
    flows_in: dict[tuple, list] = {}
    for rank in sorted(spans):
        actions = {a.key: a for a in plans[rank]}
        lanes = sorted({lane for *_, lane in spans[rank] if lane is not None} | {0})
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": (names or {}).get(rank, f"device {rank}")}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        tracks = [(STEP_TID, "step")] + [(_LANE_TID + k, f"lane {k}" + (" (plan)" if k == 0 else ""))
                                         for k in lanes] + [(COMM_TID, "communication")]
        for tid, name in tracks:
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
        for start, end, number in (steps or {}).get(rank, ()):
            events.append({"ph": "X", "name": f"step {number}", "cat": "step", "pid": rank, "tid": STEP_TID,
                           "ts": us(start), "dur": max(round((end - start) * scale, 3), 0.001)})
        for key, start, end, lane in spans[rank]:
            action = actions.get(key)
            node = action.node if action is not None else None
            tid = COMM_TID if lane is None else _LANE_TID + lane
            ts, dur = us(start), max(round((end - start) * scale, 3), 0.001)
            event = {"ph": "X", "name": key, "pid": rank, "tid": tid, "ts": ts, "dur": dur,
                     "cat": _category(node) if node is not None else "compute"}
            if node is not None:
                event["args"] = _args(node)
                if node.op == "SEND":
                    flows_out.setdefault((rank, action.peer, action.tag), []).append(ts)
                elif node.op == "RECV":
                    flows_in.setdefault((action.peer, rank, action.tag), []).append(ts + dur)
            events.append(event)
    flow = 0
    for (src, dst, tag), sends in sorted(flows_out.items()):
        recvs = flows_in.get((src, dst, tag), [])
        for ts_send, ts_recv in zip(sends, recvs):   # one per traced step, in step order
            flow += 1
            events.append({"ph": "s", "id": flow, "name": "message", "cat": "p2p", "pid": src, "tid": COMM_TID,
                           "ts": ts_send})
            events.append({"ph": "f", "bp": "e", "id": flow, "name": "message", "cat": "p2p", "pid": dst,
                           "tid": COMM_TID, "ts": max(ts_send, round(ts_recv - 0.0005, 4))})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(meta or {})}


def _device_names(mesh, ranks) -> dict[int, str]:
    out = {}
    for r in ranks:
        coords = mesh.coords(r) if mesh is not None and mesh.world_size > 1 else {}
        where = ", ".join(f"{a}={c}" for a, c in coords.items())
        out[r] = f"device {r}" + (f" ({where})" if where else "")
    return out


def _split_slots(line):
    """Simulated (start, end, key) with an overlapped slot's `a&b` key as one entry per member, one lane each."""
    for start, end, key in line:
        for lane, part in enumerate(key.split("&")):
            yield part, start, end, lane


def simulation_trace(plans, sim, *, mesh=None, scale: float = 1e6, meta: dict | None = None) -> dict:
    """A simulated step (`simulate(..., record_comm=True)`) as a trace document."""
    spans = {}
    for rank in plans:
        out = list(_split_slots(sim.timeline.get(rank, ())))
        out += [(key, start, end, None) for start, end, key in sim.comm.get(rank, ())]
        spans[rank] = sorted(out, key=lambda s: (s[1], s[2]))
    steps = {rank: [(0.0, sim.step_time, 0)] for rank in plans}
    return build(spans, plans, names=_device_names(mesh, plans), steps=steps, scale=scale,
                 meta={"source": "piper simulate", **(meta or {})})


def run_trace(compiled, recorded: list[dict], *, steps: int | None = None, meta: dict | None = None,
              steps_done: int | None = None) -> dict:
    """A real run's last `steps` steps (default: every step the workers kept) as a trace document.

    `steps_done`: the job's steps so far (`job.steps`, a loaded checkpoint's included), so the steps
    are labelled with the job's own numbers, from 1 as everywhere a user reads them (the last one
    `steps_done`); without it, the kept steps are numbered as the workers kept them, from 1.

    `recorded[rank]` is what `Worker.trace()` returned: the clocks of that
    process (perf_counter, time) at one instant, and per step its start, its
    actions' (key, start, end, thread), the completion time of each waited
    communication, and the thread that ran the plan. Times become wall-clock
    seconds through each process's clock pair, so devices line up.
    """
    spans: dict[int, list] = {}
    step_spans: dict[int, list] = {}
    for rank, rec in enumerate(recorded):
        pc, wall = rec["clock"]
        shift = wall - pc
        kept = rec["steps"][-steps:] if steps else rec["steps"]
        plan = {a.key: a for a in compiled.plans[rank]}
        out, marks = [], []
        first = len(rec["steps"]) - len(kept)
        if steps_done is not None:
            first = steps_done - len(kept)
        for number, (t0, actions, done, main) in enumerate(kept, first + 1):
            lanes = {main: 0}
            end_of_step = t0
            for key, start, end, thread in actions:
                action = plan.get(key)
                compute = action is not None and action.node.is_compute
                if compute:
                    lane = lanes.setdefault(thread, len(lanes))
                    out.append((key, start + shift, end + shift, lane))
                else:
                    finished = max(done.get(key, end), end)
                    out.append((key, start + shift, finished + shift, None))
                    end = finished
                end_of_step = max(end_of_step, end)
            marks.append((t0 + shift, end_of_step + shift, number))
        spans[rank] = out
        step_spans[rank] = marks
    mesh = compiled.ir.mesh
    return build(spans, compiled.plans, names=_device_names(mesh, range(len(recorded))), steps=step_spans,
                 meta={"source": "piper run", **(meta or {})})


def write(document: dict, path: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f)
    return path


def job_trace(job, path: str, steps: int | None = None) -> str:
    """`job.trace(path)`: fetch every worker's record of its last steps and write the trace."""
    recorded = job.traced()
    if not any(rec["steps"] for rec in recorded):
        from ..diagnostics import error

        raise error("no-trace", "this job has not run a step yet, so there is nothing to trace",
                    hint="call job.step(...) first; job.trace keeps the last steps")
    return write(run_trace(job.compiled, recorded, steps=steps, steps_done=job.steps,
                           meta={"mesh": str(job.mesh), "batch": job.batch_size,
                                 "microbatches": job.microbatches}), path)
