"""The MoE models people have: Hugging Face MoE families (tiny configs, no download) trained
unchanged, with their experts divided by `shard experts`, equal to one device.

Float64 with the library's "eager" experts unless a test says otherwise; 3 AdamW steps on one
batch, losses and every parameter within 1e-9. Capture runs each family's experts module on
Piper's MoE primitives (`piper/frontend/hf_experts.py`); the model itself is untouched.
"""
import copy
import functools
import os
import subprocess
import sys
import types

import pytest
import torch

import piper
from piper.dsl import load_strategy
from piper.frontend.capture import capture
from piper.frontend.hf_experts import experts_forward, is_hf_experts
from piper.ir.experts import expert_params
from piper.testing import train_both
from tests.helpers import assert_same

transformers = pytest.importorskip("transformers")
from tests import hf_moe_models as hf  # noqa: E402  (needs transformers)

EP = "use expert_parallel() on dp\n"


def _ops(program) -> set[str]:
    return {str(n.target).split(".")[0] for r in program.regions if r.graph is not None
            for n in r.graph.graph.nodes if n.op == "call_function" and hasattr(n.target, "namespace")}


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_each_family_captures_its_experts_as_piper_ops(family):
    model = hf.make(family, experts="grouped_mm", dtype=torch.float32)
    x, y = hf.batches(1, 2)[0]
    program = capture(model, (x, y))
    weights = expert_params(program)
    sparse = sum(1 for m in model.modules() if is_hf_experts(m))
    assert sparse and len([w for w in weights if w.endswith("down_proj")]) == sparse
    assert all(".mlp.experts." in name and e == hf.EXPERTS for name, e in weights.items())
    assert not any(op.startswith("transformers") for op in _ops(program))     # no library kernel travels
    assert not any(type(m).forward is not m.forward.__func__ for m in model.modules()
                   if is_hf_experts(m) and hasattr(m.forward, "__func__"))  # the user's model is untouched


@pytest.mark.parametrize("family", hf.FAMILIES)
@pytest.mark.parametrize("experts,dtype,tol", [("eager", torch.float64, 1e-12),
                                               ("grouped_mm", torch.float32, 1e-5)])   # no float64 grouped_mm
def test_the_primitives_compute_what_the_library_computes(family, experts, dtype, tol):
    model = hf.make(family, experts=experts, dtype=dtype)
    x, y = hf.batches(1, 2)[0]
    ours = copy.deepcopy(model)
    for m in ours.modules():
        if is_hf_experts(m):
            m.forward = types.MethodType(experts_forward, m)
    loss, ref = ours(x, y), model(x, y)
    torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)
    loss.backward()
    ref.backward()
    for (name, p), q in zip(ours.named_parameters(), model.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=tol * 100, atol=tol, msg=lambda m: f"{name}: {m}")


def _train(family, strategy, mesh, *, pieces=1, layers=2, batch=4, hook=None, dtype=torch.float64,
           experts="eager", lr=1e-2, **kw):
    model = hf.make(family, layers=layers, dtype=dtype, experts=experts)
    if pieces > 1:
        piper.annotate_modules(model, "PP", hf.stages(model, pieces))
    return train_both(model, load_strategy(strategy), mesh=mesh, batches=hf.batches(1, batch) * 3,
                      optimizer=functools.partial(torch.optim.AdamW, lr=lr), job_hook=hook, **kw)


def _expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


@pytest.mark.usefixtures("ray_cluster")
def test_qwen3_moe_expert_parallel_over_dp2_holds_half_the_experts():
    seen = {}
    result = _train("qwen3_moe", "use dp() on dp\n" + EP, {"dp": 2},
                    hook=lambda job: seen.update(memory=job.memory(), job=job, names=list(job.state_dict())))
    assert_same(result)
    assert result[0][-1] < result[0][0]
    assert "m.model.layers.1.mlp.experts.gate_up_proj" in seen["names"]       # the model's own names
    full = _expert_bytes(hf.make("qwen3_moe"))
    dense = sum(p.numel() * 8 for n, p in hf.make("qwen3_moe").named_parameters() if ".experts." not in n)
    for rank in (0, 1):
        held = seen["memory"][rank]["params"]
        assert held - full // 2 in range(dense, dense + 8 * 2)     # the dense unit (padded to 2) and half the experts


@pytest.mark.usefixtures("ray_cluster")
def test_deepseek_v3_dualpipev_pp2_dp2_with_expert_parallel():
    """MLA attention, a dense first layer, one shared expert and the grouped sigmoid router
    (its `e_score_correction_bias` buffer stays dense) under DualPipeV's overlapped slots.

    Within 1e-7, not 1e-9: DeepSeek-V3 runs its router's matmul and its RMSNorms in float32
    by design, also in a float64 model, so its gradients sum each token's part in float32,
    and any split of the batch (plain dp=2 too, without Piper's experts) moves them at
    float32's resolution; AdamW carries that into the weights, most where a gradient is near its
    epsilon, in proportion to the learning rate (measured: 6e-9 under plain dp at lr 1e-2,
    1e-15 for Qwen3-MoE, whose router runs in the model's dtype, under the same strategies)."""
    assert_same(_train("deepseek_v3", "use dualpipev(microbatches=4) on pp\nuse dp() on dp\n" + EP,
                       {"dp": 2, "pp": 2}, pieces=4, layers=4, batch=16, lr=1e-3), tol=1e-7)


@pytest.mark.usefixtures("ray_cluster")
def test_gpt_oss_expert_parallel_divides_its_biases_too():
    seen = {}
    assert_same(_train("gpt_oss", "use dp() on dp\n" + EP, {"dp": 2},
                       hook=lambda job: seen.update(weights=dict(job._expert_weights))))
    assert "m.model.layers.0.mlp.experts.gate_up_proj_bias" in seen["weights"]


@pytest.mark.usefixtures("ray_cluster")
def test_float32_with_the_default_experts_kernel():
    """transformers' default kernel on the reference, Piper's primitives on the workers: float32 close
    (at lr 1e-3: AdamW turns float32 rounding of a gradient near its epsilon into lr-sized steps)."""
    assert_same(_train("qwen3_moe", "use dp() on dp\n" + EP, {"dp": 2}, dtype=torch.float32,
                       experts="grouped_mm", lr=1e-3), tol=1e-5)


@pytest.mark.full
@pytest.mark.usefixtures("ray_cluster")
def test_qwen3_moe_one_f_one_b_pp2_dp2_with_expert_parallel():
    assert_same(_train("qwen3_moe", "use one_f_one_b(microbatches=2) on pp\nuse dp() on dp\n" + EP,
                       {"dp": 2, "pp": 2}, pieces=2, batch=8))


@pytest.mark.full
@pytest.mark.usefixtures("ray_cluster")
def test_mixtral_zero1_dp2_with_expert_parallel():
    assert_same(_train("mixtral", "use zero1() on dp\n" + EP, {"dp": 2}))


@pytest.mark.full
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_expert_parallel_over_dp2(family):
    assert_same(_train(family, "use dp() on dp\n" + EP, {"dp": 2}))


@pytest.mark.usefixtures("ray_cluster")
def test_without_expert_parallel_under_zero3_and_1f1b():
    """No `shard experts`: the experts are one more parameter of their unit, under any strategy."""
    assert_same(_train("olmoe", "use one_f_one_b(microbatches=2) on pp\nuse zero3() on dp\n", {"dp": 2, "pp": 2},
                       pieces=2, batch=8))


def test_experts_of_an_implementation_piper_cannot_divide_are_named():
    from piper.compiler.planning import compile_directives

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

    ALL_EXPERTS_FUNCTIONS["my_kernel"] = grouped_mm_experts_forward     # a user's registered kernel
    try:
        model = hf.make("qwen3_moe", dtype=torch.float32, experts="my_kernel")
        program = capture(model, hf.batches(1, 2)[0])                   # kept as it is, and captured
    finally:
        del ALL_EXPERTS_FUNCTIONS["my_kernel"]
    assert program.undivided_experts and "m.m.model.layers.0.mlp.experts" not in program.undivided_experts[0]
    assert "`m.model.layers.0.mlp.experts`: its config names the experts implementation 'my_kernel'" \
        in program.undivided_experts[0]
    mesh, directives = load_strategy("use dp() on dp\n" + EP).build({"dp": 2})
    with pytest.raises(piper.PiperError) as err:
        compile_directives(program, mesh, directives)
    assert err.value.code == "no-experts" and "my_kernel" in str(err.value)


def test_routing_state_lives_in_the_call_not_on_the_module():
    """Two microbatches in flight (DualPipeV's lanes) each keep their routing: nothing is stored on the module."""
    model = hf.make("gpt_oss")
    experts = next(m for m in model.modules() if is_hf_experts(m))
    before = dict(vars(experts))
    hidden = torch.randn(6, 16, dtype=torch.float64)
    index = torch.randint(0, hf.EXPERTS, (6, hf.TOP_K))
    experts_forward(experts, hidden, index, torch.rand(6, hf.TOP_K, dtype=torch.float64))
    assert vars(experts).keys() == before.keys()
    assert all(vars(experts)[k] is v for k, v in before.items())


@pytest.mark.usefixtures("ray_cluster")
def test_a_checkpoint_saved_with_the_experts_divided_loads_replicated_and_into_the_plain_model(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    batch = hf.batches(1, 4)[0]
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    with piper.compile(hf.make("olmoe"), batch, strategy=load_strategy("use dp() on dp\n" + EP), mesh={"dp": 2},
                       optimizer=adamw) as job:
        job.step(*batch)
        job.save(tmp_path / "step-1")
        saved = job.state_dict()
    other = hf.make("olmoe", seed=7)          # other initial weights: all must come from the checkpoint
    with piper.compile(other, batch, strategy=load_strategy("use dp() on dp\n"), mesh={"dp": 2},
                       optimizer=adamw) as job:
        job.load(tmp_path / "step-1")
        loaded = job.state_dict()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    dcp_to_torch_save(tmp_path / "step-1", tmp_path / "model.pt")
    plain = hf.make("olmoe", seed=7)
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True)["model"])
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
