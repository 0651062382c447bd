"""Expert parallelism: `piper.nn.MoE` and its primitives, `shard experts over AXIS`,
and training with the experts divided, compared with one device in float64."""
import copy

import pytest
import torch
import torch.nn.functional as F

import piper
import piper.nn
from piper.frontend.capture import capture
from piper.diagnostics import PiperError
from piper.dsl import load_strategy
from piper.testing import train_both
from tests.helpers import assert_same


def dense_moe(moe: piper.nn.MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's meaning, token by token: no sorting, no grouping."""
    tokens = x.reshape(-1, moe.dim)
    probs = torch.softmax(tokens @ moe.router.weight.T, dim=-1)
    gates, experts = torch.topk(probs, moe.top_k, dim=-1)
    rows = []
    for t in range(tokens.shape[0]):
        out = 0
        for k in range(moe.top_k):
            e = experts[t, k]
            out = out + gates[t, k] * ((F.silu(tokens[t] @ moe.w1[e]) * (tokens[t] @ moe.w3[e])) @ moe.w2[e])
        rows.append(out)
    out = torch.stack(rows)
    if moe.shared is not None:
        out = out + moe.shared(tokens)
    return out.reshape(x.shape)


@pytest.mark.parametrize("shared", [0, 6])
def test_moe_equals_the_dense_formula(shared):
    torch.manual_seed(0)
    moe = piper.nn.MoE(8, 12, 4, 2, shared_hidden=shared).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    out, ref = moe(x), dense_moe(moe, x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    params = [x, *moe.parameters()]
    grads = torch.autograd.grad((out * out.detach().cos()).sum(), params)
    ref_grads = torch.autograd.grad((ref * ref.detach().cos()).sum(), params)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


def test_moe_parameters_and_attributes():
    moe = piper.nn.MoE(8, 12, 4, 2, shared_hidden=6)
    shapes = {k: tuple(v.shape) for k, v in moe.named_parameters()}
    assert shapes == {"router.weight": (4, 8), "w1": (4, 8, 12), "w2": (4, 12, 8), "w3": (4, 8, 12),
                      "shared.w1.weight": (6, 8), "shared.w2.weight": (8, 6), "shared.w3.weight": (6, 8)}
    assert (moe.num_experts, moe.top_k) == (4, 2)


def test_router_runs_in_float32_for_16_bit_inputs():
    torch.manual_seed(0)
    moe = piper.nn.MoE(8, 12, 4, 2).bfloat16()
    x = torch.randn(6, 8).bfloat16()
    gates, experts = moe.route(x)
    assert gates.dtype == torch.float32
    probs = torch.softmax(x.float() @ moe.router.weight.float().T, -1)
    torch.testing.assert_close(gates, torch.topk(probs, 2, -1).values)
    assert moe(x).dtype == torch.bfloat16


@pytest.mark.parametrize("args,kw,words", [
    ((8, 12, 4, 5), {}, "top_k=5 is more than its num_experts=4"),
    ((8, 12, 0, 1), {}, "num_experts must be a positive integer"),
    ((8, -1, 4, 2), {}, "hidden must be a positive integer"),
    ((8, 12, 4, 2), {"shared_hidden": -3}, "shared_hidden must be a non-negative integer"),
])
def test_bad_sizes_are_errors_at_construction(args, kw, words):
    with pytest.raises(PiperError) as info:
        piper.nn.MoE(*args, **kw)
    assert info.value.diagnostics[0].code == "bad-moe" and words in info.value.diagnostics[0].message


class SkewedMoE(torch.nn.Module):
    """A layer of one's own on the primitives: every token goes to expert 0 (and, for top-2,
    expert 1); the other experts get no token at all."""

    def __init__(self, dim, hidden, num_experts, top_k, scale=None):
        super().__init__()
        self.router = torch.nn.Linear(dim, num_experts, bias=False)
        self.w_in = torch.nn.Parameter(torch.randn(num_experts, dim, hidden) * 0.1)
        self.w_out = torch.nn.Parameter(torch.randn(num_experts, hidden, dim) * 0.1)
        self.top_k = top_k
        self.scale = scale         # a number: w_in reaches expert_mm through a multiplication

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(tokens), -1)
        experts = torch.arange(self.top_k, device=x.device).expand(tokens.shape[0], self.top_k)
        gates = probs[:, :self.top_k]
        routed, counts, handle = piper.nn.dispatch(tokens, experts, self.w_in.shape[0])
        w_in = self.w_in if self.scale is None else self.w_in * self.scale
        y = piper.nn.expert_mm(torch.tanh(piper.nn.expert_mm(routed, counts, w_in)), counts, self.w_out)
        return piper.nn.combine(y, gates, handle).reshape(x.shape)


class Tiny(torch.nn.Module):
    """Embedding, a MoE layer per region, a head: regions PP=0..n-1."""

    def __init__(self, regions=2, layer=None, vocab=11, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(layer() for _ in range(regions))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        x = None
        for i, layer in enumerate(self.layers):
            with piper.annotate("PP"):
                if i == 0:
                    x = self.embed(idx)
                x = x + layer(x)
                if i == len(self.layers) - 1:
                    loss = F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())
        return loss


def tiny_batches(steps=2, batch=8, seq=4, vocab=11):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(vocab, (batch, seq), generator=gen), torch.randint(vocab, (batch, seq), generator=gen))
            for _ in range(steps)]


def moe_layer(experts=4, top_k=2):
    return lambda: piper.nn.MoE(8, 8, experts, top_k, shared_hidden=4)


def script(text):
    return load_strategy(text)


# ---- capture and compile (no workers)

def test_capture_keeps_each_primitive_as_one_node():
    model = Tiny(1, moe_layer())
    program = capture(copy.deepcopy(model), tiny_batches(1)[0])
    targets = [str(n.target) for n in program.regions[0].graph.graph.nodes if n.op == "call_function"]
    assert targets.count("piper.moe_dispatch.default") == 1
    assert targets.count("piper.expert_mm.default") == 3
    assert targets.count("piper.moe_combine.default") == 1


_captured = {}


def compile_only(model, strategy, mesh, key=None):
    """Compile without workers; `key` names a capture to reuse (export takes seconds)."""
    from piper.ir import experts
    from piper.frontend.microbatches import microbatch_inputs
    from piper.job import build_strategy, compile_directives

    mesh, directives = build_strategy(strategy, mesh)
    inputs, *_ = microbatch_inputs(tiny_batches(1)[0], mesh, directives)
    cache = (key, tuple(inputs[0].shape))
    if key is None or cache not in _captured:
        _captured[cache] = capture(copy.deepcopy(model), inputs)
    return compile_directives(_captured[cache], mesh, directives), experts


def test_indivisible_experts_is_a_diagnostic_on_the_statement():
    with pytest.raises(PiperError) as info:
        compile_only(Tiny(1, moe_layer(experts=6)), script("mesh dp=4\nuse dp() on dp\nshard experts over dp\n"),
                     None)
    d = info.value.diagnostics[0]
    assert d.code == "indivisible-experts" and "6 experts" in d.message and "size 4" in d.message
    assert d.span is not None and d.span.line == 3 and "multiple of 4" in d.hint


def test_shard_experts_without_moe_layers_is_a_diagnostic():
    dense = lambda: torch.nn.Linear(8, 8)  # noqa: E731
    with pytest.raises(PiperError) as info:
        compile_only(Tiny(1, dense), script("mesh dp=2\nuse dp() on dp\nuse expert_parallel() on dp\n"), None)
    d = info.value.diagnostics[0]
    assert d.code == "no-experts" and d.span is not None


def test_experts_need_the_batch_on_their_axis():
    with pytest.raises(PiperError) as info:
        compile_only(Tiny(1, moe_layer()), script("mesh dp=2\nshard experts over dp\n"), None)
    assert info.value.diagnostics[0].code == "undivided-work"      # nothing divides the batch at all
    with pytest.raises(PiperError) as info:
        compile_only(Tiny(1, moe_layer()), script(
            "mesh dp=2, pp=2\nshard batch over dp\nshard batch over pp\nshard experts over dp\n"), None)
    d = info.value.diagnostics[0]
    assert d.code == "unsupported-sharding" and d.span.line == 4 and "alone" in d.hint


def test_holdings_divide_the_expert_rows():
    compiled, experts = compile_only(Tiny(2, moe_layer()), script(
        "mesh dp=2, pp=2\nuse one_f_one_b(microbatches=2) on pp\nuse zero1() on dp\nuse expert_parallel() on dp\n"),
        None)
    model = Tiny(2, moe_layer())
    program = capture(copy.deepcopy(model), tiny_batches(1, batch=2)[0])
    assert sorted(experts.expert_params(program)) == [f"layers.{i}.{w}" for i in (0, 1) for w in ("w1", "w2", "w3")]
    ir = compiled.ir
    groups = experts.groups(ir)
    assert sorted(groups) == sorted(tuple(sorted(ir.devices_of(r.index), key=lambda x: ir.mesh.coords(x)["dp"]))
                                    for r in ir.regions)
    held = {rank: experts.holdings(program, ir, rank) for rank in range(4)}
    rows = sorted(lo for h in held.values() for names in h.values() for name, (lo, hi) in names.items()
                  if name == "layers.0.w1")
    assert rows == [0, 2]


# ---- training against one device (float64, losses and every parameter within 1e-9)

EP = "use expert_parallel() on dp\n"


@pytest.mark.usefixtures("ray_cluster")
def test_plain_dp_replicates_the_experts():
    assert_same(train_both(Tiny(1, moe_layer()).double(), script("use dp() on dp\n"), mesh={"dp": 2},
                           batches=tiny_batches()))


@pytest.mark.usefixtures("ray_cluster")
def test_expert_parallel_over_dp2_holds_half_the_experts():
    model = Tiny(1, moe_layer()).double()
    seen = {}

    def hook(job):
        seen["memory"] = job.memory()
        seen["timings"] = job.timings()
        seen["plans"] = dict(job.compiled.plans)
    assert_same(train_both(model, script("use dp() on dp\n" + EP), mesh={"dp": 2}, batches=tiny_batches(),
                           job_hook=hook))
    experts = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-1] in ("w1", "w2", "w3")
                  and p.dim() == 3) * 8
    dense = sum(p.numel() for p in model.parameters()) * 8 - experts
    for rank in (0, 1):
        # parameters: the dense flat unit (padded to the group) and half of every expert weight
        padded = -(-dense // 8 // 2) * 2 * 8
        assert seen["memory"][rank]["params"] == padded + experts // 2
        assert seen["memory"][rank]["step_peak"] > seen["memory"][rank]["params"]
    # Each piece and each exchange the executor issued is timed under its own plan node, and prices a simulation.
    from piper.compiler.simulate import simulate

    timings = seen["timings"][0]
    pieces = {"0F0", "0F0.1", "0F0.2", "0B0.2", "0B0.1", "0B0"}
    exchanges = {"0ALL_TO_ALL_F0.0", "0ALL_TO_ALL_F0.1", "0ALL_TO_ALL_B0.1", "0ALL_TO_ALL_B0.0"}
    assert pieces | exchanges <= set(timings) and all(timings[k] > 0 for k in exchanges)
    sim = simulate(seen["plans"], costs=timings, comm_cost=lambda node: timings.get(node.key, 0.0))
    assert sim.step_time >= sum(timings[k] for k in pieces | exchanges if "B" not in k)


@pytest.mark.usefixtures("ray_cluster")
def test_expert_parallel_with_zero1_over_dp4_one_expert_each():
    seen = {}
    assert_same(train_both(Tiny(1, moe_layer(experts=4, top_k=2)).double(), script("use zero1() on dp\n" + EP),
                           mesh={"dp": 4}, batches=tiny_batches(), job_hook=lambda job: seen.update(m=job.memory())))
    params = {seen["m"][r]["params"] for r in range(4)}
    assert len(params) == 1        # every device holds one expert of each weight


@pytest.mark.usefixtures("ray_cluster")
def test_skewed_router_and_empty_experts():
    # Every token to experts 0 and 1: dp rank 1 holds experts 2 and 3, which never get a token.
    layer = lambda: SkewedMoE(8, 8, 4, 2)  # noqa: E731
    assert_same(train_both(Tiny(1, layer).double(), script("use dp() on dp\n" + EP), mesh={"dp": 2},
                           batches=tiny_batches()))


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("data", [pytest.param("dp", marks=pytest.mark.full), "zero3"])
def test_one_f_one_b_pp2_with_expert_parallel_dp2(data):
    strategy = script(f"use one_f_one_b(microbatches=2) on pp\nuse {data}() on dp\n" + EP)
    assert_same(train_both(Tiny(2, moe_layer()).double(), strategy, mesh={"dp": 2, "pp": 2},
                           batches=tiny_batches()))


@pytest.mark.usefixtures("ray_cluster")
def test_dualpipev_pp2_with_expert_parallel_dp2_in_lanes():
    strategy = script("use dualpipev(microbatches=4) on pp\nuse dp() on dp\n" + EP)
    seen = {}

    def hook(job):
        slots = [k for k in job.timings()[0] if "&" in k]
        seen["slots"] = slots
    assert_same(train_both(Tiny(4, moe_layer()).double(), strategy, mesh={"dp": 2, "pp": 2},
                           batches=tiny_batches(batch=16), job_hook=hook))
    assert seen["slots"], "the overlapped slots ran in lanes"


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("schedule,regions", [("one_f_one_b", 2), ("dualpipev", 4)])
def test_recomputed_moe_regions_train_exactly_as_pieces(schedule, regions):
    """`recompute`: each piece keeps its inputs and runs again in its backward (B, or BI and BW in
    lanes), so no exchange runs twice."""
    strategy = script(f"use {schedule}(microbatches=4) on pp\nuse dp() on dp\n" + EP + "recompute PP=*\n")
    seen = {}
    assert_same(train_both(Tiny(regions, moe_layer()).double(), strategy, mesh={"dp": 2, "pp": 2},
                           batches=tiny_batches(batch=16), job_hook=lambda job: seen.update(plan=job.compiled.plans[0])))
    keys = [a.key for a in seen["plan"]]
    assert "0F0.2" in keys and keys.count("0ALL_TO_ALL_F0.0") == 1


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_expert_parallel_in_16_bits_computes_on_float32_rows(precision):
    """16-bit compute over float32 expert rows; fp16's loss scale seeds the pieces' backward too."""
    losses, ref_losses, state, _ = train_both(Tiny(1, moe_layer()), script("use dp() on dp\n" + EP), mesh={"dp": 2},
                                              batches=tiny_batches(), precision=precision)
    assert all(abs(a - b) < 0.05 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    assert state["layers.0.w1"].dtype == torch.float32


@pytest.mark.usefixtures("ray_cluster")
def test_dualpipev_in_turn_switches_items_at_their_exchanges(tmp_path):
    """`overlap=False`: one thread runs an overlapped slot's two items, switching from one to the
    other after each expert exchange it issues (`piper.compiler.slots.interleaved`)."""
    import json

    strategy = script("use dualpipev(microbatches=4) on pp\nuse dp() on dp\n" + EP)
    seen = {}

    def hook(job):
        events = json.load(open(job.trace(str(tmp_path / "trace.json"), steps=1)))["traceEvents"]
        computes = sorted((e for e in events if e.get("pid") == 0 and e.get("ph") == "X" and e.get("cat") != "step"
                           and e["name"][1] in "FB"), key=lambda e: e["ts"])
        seen["order"] = [e["name"] for e in computes]
        seen["lanes"] = {e["tid"] for e in computes}
    assert_same(train_both(Tiny(4, moe_layer()).double(), strategy, mesh={"dp": 2, "pp": 2},
                           batches=tiny_batches(batch=16), job_hook=hook, overlap=False))
    order = seen["order"]
    assert len(seen["lanes"]) == 1                       # one thread
    # a forward's pieces with another microbatch's backward pieces between them
    first, last = order.index("0F3"), order.index("0F3.2")
    assert any(k.startswith("3B") for k in order[first:last]), order


def test_all_to_alls_are_nodes_of_the_ir_and_the_plans():
    from piper.ir.dag import format_ir, parse_ir
    from piper.compiler.simulate import check_collective_order, simulate

    compiled, _ = compile_only(Tiny(4, moe_layer()), script(
        "mesh dp=2, pp=2\nuse dualpipev(microbatches=4) on pp\nuse dp() on dp\n" + EP), None)
    text = format_ir(compiled.ir)
    assert "node 0ALL_TO_ALL_F3.0 @" in text and "node 0F3.1 @" in text and " ep\n" in text
    assert parse_ir(text) == compiled.ir
    for rank, plan in compiled.plans.items():
        keys = [a.key for a in plan]
        for i, a in enumerate(plan):
            n = a.node
            # each pass cut into pieces with the MoE layer's dispatch and combine between them
            if n.op == "F" and not n.value:
                assert keys[i:i + 5] == [f"{n.region}F{n.mb}", f"{n.region}ALL_TO_ALL_F{n.mb}.0", f"{n.region}F{n.mb}.1",
                                         f"{n.region}ALL_TO_ALL_F{n.mb}.1", f"{n.region}F{n.mb}.2"]
                assert plan[i + 1].group == n.devices and plan[i + 2].waits == (keys[i + 1],)
            if n.op == "BI" and n.value == 2:
                assert keys[i:i + 5] == [f"{n.region}BI{n.mb}.2", f"{n.region}ALL_TO_ALL_BI{n.mb}.1",
                                         f"{n.region}BI{n.mb}.1", f"{n.region}ALL_TO_ALL_BI{n.mb}.0",
                                         f"{n.region}BI{n.mb}"]
    check_collective_order(dict(compiled.plans))      # every member of every group, not one replica
    # Priced by the simulator's communication costs like any collective; a pass's unit cost falls on its
    # piece 0, so the cut changes no default cost.
    cheap = simulate(dict(compiled.plans)).step_time
    dear = simulate(dict(compiled.plans), comm_cost=lambda n: 0.5 if n.op == "ALL_TO_ALL" else 0.0).step_time
    assert dear > cheap
    assert sum(end - start for start, end, key in simulate(dict(compiled.plans)).timeline[0]) == \
        sum(a.node.op in ("F", "BI", "BW") and not a.node.value for a in compiled.plans[0])
    # An overlapped slot is one unit with its items' pieces and exchanges inside, named by the passes.
    from piper.frontend.interop import overlapped_slots

    fused = simulate(dict(compiled.plans), overlap=overlapped_slots(compiled))
    units = [key for _, _, key in fused.timeline[0] if "&" in key]
    assert units and all("." not in key for key in units)


def test_an_overlapped_slot_takes_its_items_pieces_and_exchanges_into_their_lanes():
    from piper.frontend.interop import compute_slots
    from piper.ir.dag import node_key
    from piper.compiler.slots import interleaved, spans

    compiled, _ = compile_only(Tiny(4, moe_layer()), script(
        "mesh dp=2, pp=2\nuse dualpipev(microbatches=4) on pp\nuse dp() on dp\n" + EP), None, key="tiny4")
    plan = compiled.plans[0]
    slots = [s for s in compute_slots(compiled, 0) if len(s) > 1]
    found = spans(plan, slots, {r: {r} for r in range(4)}, {r: {r - 1} if r else set() for r in range(4)})
    assert found, "DualPipeV's main phase has overlapped slots"
    switched = {"yes": 0, "no": 0}
    for span in found.values():
        members = set(span.key.split("&"))
        for lane in span.lanes:
            # one item per lane (a B may be its BI and BW): its pieces and its exchanges, then its sends
            assert len({(a.node.region, a.node.mb) for a in lane}) == 1, lane
            for a in lane:
                n = a.node
                if n.is_compute or n.op == "ALL_TO_ALL":
                    assert node_key(n.phase if n.op == "ALL_TO_ALL" else n.op, n.region, n.mb) in members
                else:
                    assert n.op == "SEND"
            assert sum("ALL_TO_ALL" in a.key for a in lane) == 2
        # in turn: the thread switches items after every exchange, unless the second item waits for a
        # pipeline message (which may need the first item's sends): then the items run as planned
        order = [a.key for a in interleaved(span)]
        assert sorted(a.key for lane in span.lanes for a in lane) == sorted(order)
        switches = [order[i + 1][0] != k[0] for i, k in enumerate(order[:-1]) if "ALL_TO_ALL" in k]
        if any("RECV" in k for a in span.lanes[1] for k in a.waits):
            switched["no"] += 1
            assert order == [a.key for lane in span.lanes for a in lane]
        else:
            switched["yes"] += 1
            assert switches == [True] * 4, order
    assert switched["yes"] and switched["no"]       # device 0 has slots of both kinds


def test_memory_prediction_counts_a_cut_pass_once():
    from piper.compiler.memory_model import predict_memory

    peaks = {}
    for name, extra in (("replicated", ""), ("ep", EP)):
        compiled, _ = compile_only(Tiny(4, moe_layer()), script(
            "mesh dp=2, pp=2\nuse dualpipev(microbatches=4) on pp\nuse dp() on dp\n" + extra), None, key="tiny4")
        program = next(v for k, v in _captured.items() if k[0] == "tiny4")
        predicted = predict_memory(compiled, program, saved={r: 1000 for r in range(4)})
        peaks[name] = {r: p.activations for r, p in predicted.items()}
    assert any(a.node.value for a in compiled.plans[0]) and peaks["ep"] == peaks["replicated"]


def test_no_all_to_alls_when_the_experts_are_replicated():
    compiled, _ = compile_only(Tiny(2, moe_layer()), script(
        "mesh dp=2, pp=2\nuse one_f_one_b(microbatches=2) on pp\nuse dp() on dp\n"), None)
    assert not any(a.node.op == "ALL_TO_ALL" for plan in compiled.plans.values() for a in plan)


@pytest.mark.parametrize("schedule,regions", [("one_f_one_b(microbatches=4)", 2),
                                              ("interleaved_1f1b(microbatches=4, virtual=2)", 4),
                                              ("zbv(microbatches=4)", 4), ("dualpipev(microbatches=4)", 4)])
@pytest.mark.parametrize("data", ["dp", "zero1", "zero2", "zero3"])
def test_expert_parallel_composes_with_every_schedule(schedule, regions, data):
    compiled, _ = compile_only(Tiny(regions, moe_layer()), script(
        f"mesh dp=2, pp=2\nuse {schedule} on pp\nuse {data}() on dp\n" + EP), None, key=f"tiny{regions}")
    a2a = [a for plan in compiled.plans.values() for a in plan if a.node.op == "ALL_TO_ALL"]
    # each region runs on 2 devices; per microbatch its forward and its backward (B or BI) dispatch and combine
    assert len(a2a) == regions * 2 * 4 * 2 * 2


def test_expert_parallel_is_shard_experts():
    from piper.frontend.capture import Program
    from piper.ir.statements import apply_all, initial_ir

    @piper.strategy
    def python_form(s):
        s.shard("batch", over="dp")
        s.shard("experts", over="dp")

    def ir_of(strategy):
        from piper.job import build_strategy
        mesh, directives = build_strategy(strategy, {"dp": 2})
        return apply_all(initial_ir(Program.chain("PP=1"), mesh), directives)

    assert ir_of(python_form) == ir_of(script("use dp() on dp\nuse expert_parallel() on dp\n"))
    assert ir_of(python_form).sharded("experts") == "dp"


def test_each_lane_has_its_own_expert_group():
    import threading

    from piper.runtime.moe import expert_groups

    lanes = [expert_groups.ExpertGroup(None, (0, 1), 1), expert_groups.ExpertGroup(None, (0, 1), 1)]
    seen = {}

    def lane(k):
        with expert_groups.lane_group(lanes, k):
            seen[k] = expert_groups.current()

    threads = [threading.Thread(target=lane, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen[0] is lanes[0] and seen[1] is lanes[1] and lanes[0].index == 1
    assert expert_groups.current() is None          # nothing installed on this thread: the local meaning


@pytest.mark.parametrize("mesh,model,code", [("dp=3, pp=2", "examples/moe.py:moe_two_regions", "indivisible-experts"),
                                             ("dp=2, pp=2", "examples/gpt.py:two_stage_gpt", "no-experts")])
def test_piper_check_reports_expert_mistakes_without_a_traceback(tmp_path, capsys, mesh, model, code):
    from piper.cli import main

    path = tmp_path / "ep.pps"
    path.write_text(f"mesh {mesh}\nuse one_f_one_b(microbatches=2) on pp\nuse dp() on dp\nshard experts over dp\n")
    assert main(["check", str(path), "--model", model]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert f"error[{code}]" in text and "ep.pps:4:1" in text and "Traceback" not in text


def test_the_example_dualpipev_ep_script_checks_clean(capsys):
    from piper.cli import main

    assert main(["check", "examples/moe_dualpipev_ep.pps", "--model", "examples/moe.py:moe_four_regions"]) == 0


@pytest.mark.usefixtures("ray_cluster")
def test_an_expert_weight_that_is_not_passed_straight_in_stays_replicated_and_exact():
    # w_in * 2 is not a parameter at expert_mm: it stays in the dense unit (all-reduced over dp),
    # and each device's expert_mm takes its own experts' rows of it.
    layer = lambda: SkewedMoE(8, 8, 4, 2, scale=2.0)  # noqa: E731
    model = Tiny(1, layer).double()
    from piper.ir import experts
    program = capture(copy.deepcopy(model), tiny_batches(1, batch=4)[0])
    assert sorted(experts.expert_params(program)) == ["layers.0.w_out"]
    assert_same(train_both(model, script("use dp() on dp\n" + EP), mesh={"dp": 2}, batches=tiny_batches()))
