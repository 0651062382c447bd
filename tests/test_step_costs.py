"""Costs that follow the training options (piper/compiler/step_costs.py): a recomputed region's backward
costs its forward again, and 16-bit precision halves the bytes of ZeRO-3 gathers and of the
activations sent between stages (reductions stay float32). No Ray."""
from __future__ import annotations

from piper.frontend.capture import Program
from piper.cli import main
from piper.dsl import load_strategy
from piper.ir.dag import Node
from piper.job import plan
from piper.compiler.simulate import UNIT_COSTS, simulate
from piper.compiler.step_costs import comm_bytes, comm_cost, recompute_costs


def _plan(text, regions=2):
    return plan(load_strategy(text), program=Program.chain({"PP": regions}))


def test_recompute_adds_the_forward_to_the_first_backward_pass():
    compiled = _plan("mesh pp=2\nuse one_f_one_b(microbatches=4) on pp\nrecompute PP=1\n")
    costs = recompute_costs(compiled, {"F": 1.0, "B": 2.0})
    assert costs["1B0"] == 3.0 and "0B0" not in costs and costs["F"] == 1.0
    # a measured action (job.timings() of a job that recomputed) is taken as measured
    assert recompute_costs(compiled, {"1B0": 5.0})["1B0"] == 5.0
    # estimates per key (piper tune's): each backward plus its own region's forward
    estimates = {"1F0": 0.25, "1B0": 0.5, "0F0": 9.0, "0B0": 9.0}
    got = recompute_costs(compiled, estimates, measured=())
    assert got["1B0"] == 0.75 and got["0B0"] == 9.0 and got["1B1"] == UNIT_COSTS["B"] + UNIT_COSTS["F"]
    # split backward: BI reruns the forward, BW does not
    zb = _plan("mesh pp=2\nuse zero_bubble(microbatches=4) on pp\nrecompute PP=*\n")
    costs = recompute_costs(zb, {"F": 1.0, "BI": 1.0, "BW": 1.0})
    assert costs["0BI2"] == costs["1BI2"] == 2.0 and "0BW2" not in costs
    # without the statement, nothing changes
    assert recompute_costs(_plan("mesh pp=2\nuse one_f_one_b(microbatches=4) on pp\n"), {"F": 1}) == {"F": 1}


def test_simulated_step_of_a_recomputing_1f1b(tmp_path, capsys):
    """(m + p - 1)(F + B) becomes (m + p - 1)(F + F + B) with every region recomputed."""
    script = tmp_path / "rc.pps"
    script.write_text("use one_f_one_b(microbatches=8) on pp\nrecompute PP=*\n")
    assert main(["simulate", str(script), "--regions", "PP=4", "--mesh", "pp=4"]) == 0
    assert "predicted step 44" in capsys.readouterr().out        # 11 x (1 + 1 + 2)
    plain = _plan("mesh pp=4\nuse one_f_one_b(microbatches=8) on pp\n", 4)
    assert simulate(plain.plans).step_time == 33


def test_16_bit_moves_half_the_gathered_parameters_and_activations():
    group = (0, 1)
    gather = Node("ALL_GATHER", 0, 0, "F", devices=group)
    updated = Node("ALL_GATHER", 0, devices=group)               # ZeRO-1/2: float32 updated shards
    scatter = Node("REDUCE_SCATTER", 0, devices=group)
    reduce = Node("ALL_REDUCE", 0, devices=group)
    send = Node("SEND", 0, 0, "F", value=0, peer=1)
    for node, fp32, bf16 in ((gather, 500, 250), (updated, 500, 500), (scatter, 500, 500), (reduce, 1000, 1000)):
        assert comm_bytes(node, unit_bytes=1000) == fp32, node.key
        assert comm_bytes(node, unit_bytes=1000, precision="bf16") == bf16, node.key
    import torch

    assert comm_bytes(send, unit_bytes=0, value_bytes=64, value_dtype=torch.float32, precision="fp16") == 32
    assert comm_bytes(send, unit_bytes=0, value_bytes=64, value_dtype=torch.bfloat16, precision="bf16") == 64
    assert comm_bytes(send, unit_bytes=0, value_bytes=64, value_dtype=torch.int64, precision="bf16") == 64


def test_16_bit_zero3_gathers_price_a_shorter_simulated_step():
    """Compute free, communication priced by bytes: ZeRO-3's step is its gathers and reductions."""
    compiled = _plan("mesh dp=2\nuse zero3() on dp\nsplit MB into 2\n")
    program = Program.chain({"PP": 2})
    zero = {"F": 0.0, "B": 0.0, "UPD": 0.0}
    steps = {p: simulate(compiled.plans.representatives(), costs=zero,
                         comm_cost=comm_cost(compiled, program, bandwidth=1.0, precision=p)).step_time
             for p in ("fp32", "bf16")}
    assert 0 < steps["bf16"] < steps["fp32"]


def test_simulate_predicts_memory_with_precision(capsys):
    """`piper simulate --precision bf16` captures the model in 16 bits (float32 masters) and predicts
    less memory than float32: half-size gathers and activations, against a 16-bit copy only
    ZeRO-3 does not keep."""
    from piper.compiler.analysis import compile_with_program
    from piper.compiler.memory_model import predict_memory

    script, model = "examples/gpt_zero3_1f1b.pps", "examples/gpt.py:two_stage_gpt"
    assert main(["simulate", script, "--model", model, "--precision", "bf16"]) == 0
    assert "KiB" in capsys.readouterr().out            # the memory columns
    peaks = {}
    for precision in ("fp32", "bf16"):
        compiled, program = compile_with_program(load_strategy(script), model_spec=model, precision=precision)
        assert {str(s.dtype) for s in program.params.values()} == {"torch.float32"}     # the masters
        predicted = predict_memory(compiled, program, ranks=[0], precision=precision)[0]
        peaks[precision] = predicted
    assert peaks["bf16"].activations < 0.6 * peaks["fp32"].activations
    assert peaks["bf16"].peak < peaks["fp32"].peak
