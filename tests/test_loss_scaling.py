"""`precision="fp16"`: dynamic loss scaling (`piper.FP16`), against torch.amp.GradScaler on one device.

The model is made so that the loss scale overflows the second region's fp16 gradients while the
first region's stay finite: a step with an overflow must still be skipped on the first stage too.
"""
import copy
import functools

import pytest
import torch

import piper
from examples.strategies import one_f_one_b_order as one_f_one_b
from tests.test_train import data_parallel, pipeline

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
MICROBATCHES = 4
OFFSET = 300.0


class Overflowing(torch.nn.Module):
    """Two regions. The second reads activations near OFFSET (the first's bias), so its weight's
    gradient is about OFFSET / |its weight| (~1e4) times any gradient of the first region."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)
        with torch.no_grad():
            self.a.bias.fill_(OFFSET)
            self.b.weight.mul_(0.01)

    def forward(self, x, y):
        with piper.annotate("PP"):
            h = self.a(x)
        with piper.annotate("PP"):
            loss = ((self.b(h).squeeze(-1) - y) ** 2).mean()
        return loss


def batches(steps, rows=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, generator=g)) for _ in range(steps)]


def grad_scaler_reference(model, steps, pieces, config, clip=None):
    """One device, torch.amp.GradScaler over the master-weights recipe: an fp16 copy computes each
    of the `pieces` microbatches of every batch (Piper's microbatches, every shard's, in turn), each
    backward seeded as Piper seeds it (scale / pieces), its fp16 gradients added in float32 to the
    float32 master; GradScaler unscales, then the gradients are clipped (with `clip`), and
    GradScaler skips or steps. On one thread, as each CPU worker runs (a kernel's sums can follow
    the thread count), so it is what Piper computes to the bit (`tests/test_precision.py` says why
    not torch.autocast)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _grad_scaler_steps(model, steps, pieces, config, clip)
    finally:
        torch.set_num_threads(threads)


def _grad_scaler_steps(model, steps, pieces, config, clip):
    master = copy.deepcopy(model)
    low = copy.deepcopy(model).half()
    opt = ADAMW(list(master.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=config.init_scale, growth_factor=config.growth_factor,
                                  backoff_factor=config.backoff_factor, growth_interval=config.growth_interval)
    losses, scales = [], []
    for x, y in steps:
        with torch.no_grad():
            for p16, p32 in zip(low.parameters(), master.parameters()):
                p16.copy_(p32)
        scales.append(scaler.get_scale())
        for p in master.parameters():
            p.grad = torch.zeros_like(p)
        total = 0.0
        for xm, ym in zip(x.chunk(pieces), y.chunk(pieces)):
            loss = low(xm.half(), ym.half())
            scaler.scale(loss * (1.0 / pieces)).backward()
            for p16, p32 in zip(low.parameters(), master.parameters()):
                p32.grad += p16.grad.float()
                p16.grad = None
            total += loss.item() / pieces
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        losses.append(total)
    scales.append(scaler.get_scale())
    return losses, scales, master.state_dict()


CASES = {    # strategy, mesh, microbatches x shards, clip_grad_norm
    # 1F1B on 2 stages: only the second stage's gradients overflow; the first must skip with it.
    # Clipping (the norm is far above 1) follows the unscaling, as with GradScaler.unscale_.
    "1f1b-pp2-clip": (lambda: pipeline(MICROBATCHES, order=one_f_one_b), {"pp": 2}, MICROBATCHES, 1.0),
    # ZeRO-3: each device unscales and checks its own gradient shard.
    "zero3-dp2": (lambda: data_parallel("optimizer", "grads", "params"), {"dp": 2}, 2, None),
}


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("case", list(CASES))
def test_fp16_loss_scaling_skips_overflows_everywhere_and_follows_grad_scaler(case):
    strategy, mesh, pieces, clip = CASES[case]
    # 2**12 and 2**8 overflow the second region's gradients (steps 0 and 1); 2**4 fits, and the
    # scale doubles after every good step until it overflows again (at 2**9, step 7).
    config = piper.FP16(init_scale=2.0 ** 12, backoff_factor=2.0 ** -4, growth_interval=1)
    model = Overflowing()
    steps = batches(8)
    with piper.compile(copy.deepcopy(model), steps[0], strategy=strategy(), mesh=mesh, optimizer=ADAMW, timeout=120,
                       precision=config, clip_grad_norm=clip) as job:
        first = {k: v.clone() for k, v in job.state_dict().items()}
        losses, scales, skipped = [], [], []
        for i, batch in enumerate(steps):
            scales.append(piper.loss_scale(job)["scale"])
            losses.append(job.step(*batch))
            states = piper.loss_scale(job, every_rank=True)
            assert all(s == states[0] for s in states), states          # every device agrees
            skipped.append(states[0]["last_step_skipped"])
            if i == 0:
                # Skipped: no parameter moved, on either stage or shard (AdamW would move every one).
                after = job.state_dict()
                assert skipped[0], "the first step should overflow"
                for name, value in first.items():
                    assert torch.equal(after[name], value), name
        state = job.state_dict()
        piper_scale_after = piper.loss_scale(job)["scale"]
    ref_losses, ref_scales, ref_state = grad_scaler_reference(model, steps, pieces, config, clip)
    assert scales + [piper_scale_after] == ref_scales
    assert skipped == [after < before for before, after in zip(ref_scales, ref_scales[1:])]
    assert any(skipped[1:]) and not all(skipped), skipped          # it overflowed again later, and trained
    assert losses == ref_losses                      # the same float16 forwards, to the bit
    # Bitwise too, but for clipping: the global norm is summed per device, then over devices, where
    # clip_grad_norm_ sums per tensor; the clip factors differ in float32's last bits.
    rtol = 0.0 if clip is None else 1e-6
    for name, ref in ref_state.items():
        assert state[name].dtype == torch.float32
        torch.testing.assert_close(state[name], ref, rtol=rtol, atol=0.0, msg=lambda m: f"{name}: {m}")


def test_fp16_settings_are_checked():
    with pytest.raises(piper.PiperError) as info:
        piper.FP16(growth_interval=0)
    assert info.value.code == "bad-precision" and "growth_interval" in str(info.value)
    assert piper.FP16() == piper.FP16(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                                      growth_interval=2000)       # torch.amp.GradScaler's defaults


@pytest.mark.usefixtures("ray_cluster")
def test_a_checkpoint_keeps_the_loss_scale_and_the_good_steps(tmp_path):
    # growth_interval=3 with 2**4: after the two overflows (steps 0 and 1) and two good steps the
    # scale is 2**4 with 2 good steps in a row; the loaded job must go on from there, not from 2**12.
    config = piper.FP16(init_scale=2.0 ** 12, backoff_factor=2.0 ** -4, growth_interval=3)
    model, steps = Overflowing(), batches(5)
    strategy, mesh = data_parallel(), {"dp": 2}
    with piper.compile(copy.deepcopy(model), steps[0], strategy=strategy, mesh=mesh, optimizer=ADAMW,
                       precision=config) as job:
        for batch in steps[:4]:
            job.step(*batch)
        saved = piper.loss_scale(job)
        job.save(tmp_path / "ck")
        job.step(*steps[4])
        went_on = piper.loss_scale(job)
    assert (saved["scale"], saved["good_steps"]) == (2.0 ** 4, 2)
    with piper.compile(copy.deepcopy(model), steps[0], strategy=strategy, mesh=mesh, optimizer=ADAMW,
                       precision=config) as job:
        job.load(tmp_path / "ck")
        assert piper.loss_scale(job)["scale"] == saved["scale"]
        job.step(*steps[4])
        resumed = piper.loss_scale(job)
    assert (resumed["scale"], resumed["good_steps"]) == (went_on["scale"], went_on["good_steps"])
    assert resumed["scale"] == 2.0 ** 5        # the third good step in a row grew it
