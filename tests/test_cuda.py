"""The CUDA path: workers on GPUs, NCCL between them, compute timed by CUDA events.

Skipped without a CUDA GPU (CI has none). On a machine with one GPU the
single-device checks run; the NCCL ones need two GPUs (NCCL refuses two
ranks on one GPU). Run them with `pytest -q tests/test_cuda.py`.
"""
import json
import math

import pytest
import torch

from piper.testing import train_both

from tests.test_benchmarks import run_harness
from tests.test_train import assert_same_training, data_parallel, gpt, gpt_batches, pipeline

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.usefixtures("ray_cluster"),
              pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs (NCCL refuses two ranks on one GPU)")


def test_one_gpu_trains_the_model_the_cpu_trains():
    # float64: the GPU's kernels round differently from the CPU's, so compare where rounding is negligible.
    timings = {}
    result = train_both(gpt(2, torch.float64), pipeline(2, regions_per_device=2), mesh={"pp": 1},
                        batches=gpt_batches(), device="cuda", job_hook=lambda job: timings.update(job.timings()))
    assert_same_training(result, rtol=1e-9, atol=1e-9)
    # CUDA events time each compute on the device: every one positive and finite.
    assert set(timings[0]) >= {"0F0", "1F1", "1B0", "0B1", "0UPD"}
    assert all(0 < t < 60 and math.isfinite(t) for t in timings[0].values()), timings


@two_gpus
def test_1f1b_over_nccl_trains_the_model_one_device_trains():
    assert_same_training(train_both(gpt(2, torch.float64), pipeline(4), mesh={"pp": 2}, batches=gpt_batches(),
                                    device="cuda"), rtol=1e-9, atol=1e-9)


@two_gpus
@pytest.mark.parametrize("what", [(), ("optimizer", "grads", "params")], ids=["dp", "zero3"])
def test_data_parallel_over_nccl_trains_the_model_one_device_trains(what):
    assert_same_training(train_both(gpt(2, torch.float64), data_parallel(*what), mesh={"dp": 2},
                                    batches=gpt_batches(), device="cuda"), rtol=1e-9, atol=1e-9)


@two_gpus
def test_benchmark_harness_runs_on_cuda(tmp_path):
    report, metrics = tmp_path / "RESULTS.md", tmp_path / "metrics.json"
    code, out = run_harness("--device", "cuda", "--quick", "--suite", "data-parallel", "--out", str(report),
                            "--json", str(metrics))
    assert code == 0, out[-3000:]
    assert report.read_text().startswith("# Measured on GPU (CUDA, NCCL)")
    numbers = json.loads(metrics.read_text())["data-parallel"]
    assert numbers["dp.dp2.ratio"] > 0 and numbers["zero3.dp2.ratio"] > 0


def test_one_gpu_runs_the_tensor_parallel_plan_and_its_checkpoint_goes_to_the_cpu(tmp_path):
    """The Llama plan with sequence and vocab sharding at tp=1 on the GPU (the sharded capture,
    the vocab-parallel loss and the sequence-sharded norms as CUDA kernels; at tp=1 there are no
    exchanges), saved there and loaded by a Gloo job on the CPU at tp=2: every step equals one
    device's, whichever device ran it."""
    import copy

    import piper
    from piper.testing import single_device
    from tests.helpers import assert_same
    from tests.test_tensor_parallel import ADAMW, VOCAB, batches, make_model, strategy

    model, data = make_model(stages=1, vocab=VOCAB), batches(count=4, vocab=VOCAB)
    ref_losses, ref_state = single_device(copy.deepcopy(model), data, ADAMW)
    losses = []
    for device, mesh, steps in (("cuda", {"tp": 1}, data[:2]), ("cpu", {"tp": 2}, data[2:])):
        with piper.compile(copy.deepcopy(model), data[0], strategy=strategy(sequence=True), mesh=mesh,
                           optimizer=ADAMW, device=device, progress=False) as job:
            if device == "cpu":
                job.load(tmp_path / "gpu")
            losses += [job.step(*b) for b in steps]
            if device == "cuda":
                assert job.placement()[0]["device"].startswith("cuda:")
                job.save(tmp_path / "gpu")
            state = job.state_dict()
    assert_same((losses, ref_losses, state, ref_state))
