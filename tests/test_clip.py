"""`piper.compile(..., clip_grad_norm=...)`: clipping by the global norm over the whole model equals
torch.nn.utils.clip_grad_norm_ on one device, whatever the strategy (float64, 3 steps, every step clipped)."""
import os

import pytest
import torch

import piper
from examples.strategies import one_f_one_b_order as one_f_one_b
from piper.testing import train_both
from tests.test_train import assert_same_training, data_parallel, gpt, gpt_batches, pipeline

MAX_NORM = 0.5      # the example GPT's gradient norm is about 2.4 in these steps: every step clips
ZERO3 = ("optimizer", "grads", "params")

STRATEGIES = {
    "dp": (lambda: data_parallel(), {"dp": 2}),
    "zero3": (lambda: data_parallel(*ZERO3), {"dp": 2}),
    # ZeRO-1/2 all-gather the updated shards after each update: held back with it.
    "zero2": (lambda: data_parallel("optimizer", "grads"), {"dp": 2}),
    "1f1b": (lambda: pipeline(4, order=one_f_one_b), {"pp": 2}),
    "zero3x1f1b": (lambda: pipeline(4, order=one_f_one_b, batch_axis="dp", zero=ZERO3), {"dp": 2, "pp": 2}),
}
if os.environ.get("PIPER_FULL"):      # ZeRO-1's gathers after its updates, under a pipeline
    STRATEGIES["zero1x1f1b"] = (lambda: pipeline(4, order=one_f_one_b, batch_axis="dp", zero=("optimizer",)),
                                {"dp": 2, "pp": 2})


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_clip_grad_norm_equals_one_device(name):
    strategy, mesh = STRATEGIES[name]
    norms = []
    result = train_both(gpt(2, torch.float64), strategy(), mesh=mesh, batches=gpt_batches(),
                        clip_grad_norm=MAX_NORM, job_hook=lambda job: norms.append(job.grad_norm()))
    assert_same_training(result, rtol=1e-9, atol=1e-9)
    # The last step was clipped, by a norm over the whole model (so an update that skipped the
    # clipping, or clipped by a partial norm, would leave the parameters away from the reference's).
    assert norms[0] > 2 * MAX_NORM


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "1.0", True])
def test_bad_clip_is_a_diagnostic(value):
    model = gpt(2)
    with pytest.raises(piper.PiperError) as info:
        piper.compile(model, gpt_batches(1)[0], clip_grad_norm=value)
    assert info.value.code == "bad-clip"


@pytest.mark.usefixtures("ray_cluster")
def test_clip_counts_a_weight_tied_across_stages_once():
    """Both stages hold the tied weight and step on the summed gradient: the norm counts it once."""
    from piper.dsl import load_strategy
    from tests.test_modules import TiedToy

    torch.manual_seed(0)
    model = piper.annotate_modules(TiedToy().double(), "PP", [["emb"], ["mid", "head"]])
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 16, (8, 4), generator=g), torch.randint(0, 16, (8, 4), generator=g))
    norms = []
    result = train_both(model, load_strategy("use one_f_one_b(microbatches=4) on pp\n"), mesh={"pp": 2},
                        batches=[batch] * 3, clip_grad_norm=0.05, job_hook=lambda job: norms.append(job.grad_norm()))
    assert_same_training(result, rtol=1e-9, atol=1e-9)
    assert norms[0] > 2 * 0.05


@pytest.mark.usefixtures("ray_cluster")
def test_clip_includes_expert_rows_divided_by_shard_experts():
    """Under `shard experts` each device holds its expert rows outside the flat units: they count too."""
    from tests.test_experts import EP, Tiny, moe_layer, script, tiny_batches

    norms = []
    result = train_both(Tiny(1, moe_layer()).double(), script("use dp() on dp\n" + EP), mesh={"dp": 2},
                        batches=tiny_batches(steps=3), clip_grad_norm=0.05,
                        job_hook=lambda job: norms.append(job.grad_norm()))
    assert_same_training(result, rtol=1e-9, atol=1e-9)
    assert norms[0] > 2 * 0.05
