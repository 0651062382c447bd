"""`piper.compile(..., clip_grad_norm=...)`: clipping by the global norm over the whole model equals
torch.nn.utils.clip_grad_norm_ on one device, whatever the strategy (float64, 3 steps, every step clipped)."""
import pytest
import torch

import piper
from examples.strategies import one_f_one_b_order as one_f_one_b
from piper.testing import train_both
from tests.test_train import assert_same_training, data_parallel, gpt, gpt_batches, pipeline

pytestmark = pytest.mark.usefixtures("ray_cluster")

MAX_NORM = 0.5      # the example GPT's gradient norm is about 2.4 in these steps: every step clips
ZERO3 = ("optimizer", "grads", "params")

STRATEGIES = {
    "dp": (lambda: data_parallel(), {"dp": 2}),
    "zero3": (lambda: data_parallel(*ZERO3), {"dp": 2}),
    # ZeRO-1/2 all-gather the updated shards after each update: held back with it.
    "zero1x1f1b": (lambda: pipeline(4, order=one_f_one_b, batch_axis="dp", zero=("optimizer",)), {"dp": 2, "pp": 2}),
    "zero2": (lambda: data_parallel("optimizer", "grads"), {"dp": 2}),
    "1f1b": (lambda: pipeline(4, order=one_f_one_b), {"pp": 2}),
    "zero3x1f1b": (lambda: pipeline(4, order=one_f_one_b, batch_axis="dp", zero=ZERO3), {"dp": 2, "pp": 2}),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_clip_grad_norm_equals_one_device(name):
    strategy, mesh = STRATEGIES[name]
    norms = []
    result = train_both(gpt(2, torch.float64), strategy(), mesh=mesh, batches=gpt_batches(),
                        clip_grad_norm=MAX_NORM, job_hook=lambda job: norms.append(job.grad_norm()))
    assert_same_training(result, rtol=1e-9, atol=1e-9)
    assert norms[0] > 2 * MAX_NORM          # the last step was clipped, by a norm over the whole model


def test_clipping_changes_the_result():
    # Without clipping the same steps end elsewhere: the test above would notice a no-op.
    strategy, mesh = STRATEGIES["zero3"]
    clipped = train_both(gpt(2, torch.float64), strategy(), mesh=mesh, batches=gpt_batches(1), clip_grad_norm=MAX_NORM)
    plain = train_both(gpt(2, torch.float64), strategy(), mesh=mesh, batches=gpt_batches(1))
    differs = [not torch.allclose(clipped[2][k], plain[2][k], rtol=1e-12, atol=1e-12) for k in plain[2]]
    assert any(differs)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "1.0", True])
def test_bad_clip_is_a_diagnostic(value):
    model = gpt(2)
    with pytest.raises(piper.PiperError) as info:
        piper.compile(model, gpt_batches(1)[0], clip_grad_norm=value)
    assert info.value.code == "bad-clip"
