"""Checkpoints of jobs with `shard experts`: every device writes its own expert rows (and their
AdamW state) as chunks of the whole weight, and a job with the experts divided or replicated
loads them and trains on exactly as one uninterrupted single-device run (float64)."""
import functools

import pytest
import torch

import piper
from tests.helpers import train_one_device
from tests.test_experts import EP, Tiny, moe_layer, script, tiny_batches

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
SAVE_AT, MORE = 2, 2
DP, DP_EP = "use dp() on dp\n", "use dp() on dp\n" + EP
EXPERT_WEIGHTS = [f"layers.0.{w}" for w in ("w1", "w2", "w3")]


def model(perturbed: bool = False):
    """The same initial weights every call (Tiny seeds itself); `perturbed`, other ones, so that
    everything a loading job trains from must come from the checkpoint."""
    m = Tiny(1, moe_layer()).double()
    if perturbed:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.5)
    return m


@pytest.fixture(scope="module")
def reference():
    """One device: losses, the state_dict after each step, and the AdamW state at SAVE_AT."""
    m = model()
    return train_one_device(m, ADAMW(list(m.parameters())), tiny_batches(SAVE_AT + MORE), SAVE_AT)


@pytest.fixture(scope="module")
def ep_saved(_ray_session, tmp_path_factory, reference):
    """A checkpoint written at step SAVE_AT by dp=2 with the experts divided (two rows each)."""
    import os

    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    path = tmp_path_factory.mktemp("ckpt") / "ep"
    steps = tiny_batches(SAVE_AT)
    with piper.compile(model(), steps[0], strategy=script(DP_EP), mesh={"dp": 2}, optimizer=ADAMW,
                       timeout=120) as job:
        assert sorted(job._expert_weights) == EXPERT_WEIGHTS
        losses = [job.step(*b) for b in steps]
        job.save(path)
        written = dict(job.saved_bytes)
    torch.testing.assert_close(losses, reference[0][:SAVE_AT], rtol=1e-10, atol=0)
    return path, written


def continue_from(path, strategy, reference, save_to=None):
    """Load `path` into a dp=2 job of `strategy` (other initial weights), check the weights are
    the reference's at SAVE_AT, optionally save it again, train MORE steps and compare."""
    ref_losses, ref_params, _ = reference
    steps = tiny_batches(SAVE_AT + MORE)
    with piper.compile(model(perturbed=True), steps[0], strategy=script(strategy), mesh={"dp": 2},
                       optimizer=ADAMW, timeout=120) as job:
        info = job.load(path)
        assert job.steps == SAVE_AT and info["step"] == SAVE_AT
        torch.testing.assert_close(job.state_dict(), ref_params[SAVE_AT - 1], rtol=1e-12, atol=1e-14)
        if save_to is not None:
            job.save(save_to)
        losses = [job.step(*b) for b in steps[SAVE_AT:]]
        state = job.state_dict()
    # The next steps depend on the AdamW moments and step counts: they were loaded too.
    torch.testing.assert_close(losses, ref_losses[SAVE_AT:], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(state, ref_params[-1], rtol=1e-9, atol=1e-9)


def test_each_device_writes_its_own_expert_rows_once(ray_cluster, ep_saved):
    path, written = ep_saved
    n_bytes = sum(p.numel() for p in model().parameters()) * 8
    # Parameters and two AdamW moments, each element written by exactly one device.
    assert sum(written.values()) == 3 * n_bytes
    experts = sum(p.numel() for n, p in model().named_parameters() if n in EXPERT_WEIGHTS) * 8
    assert all(w >= 3 * experts // 2 for w in written.values())
    from piper.job.checkpoint import read_metadata

    md = read_metadata(path).state_dict_metadata
    for name in EXPERT_WEIGHTS:
        for key in (f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md[key].chunks)
            full = tuple(md[key].size)
            half = (full[0] // 2, *full[1:])
            assert chunks == [((0, 0, 0), half), ((half[0], 0, 0), half)], key


def test_ep_checkpoint_loads_with_the_experts_replicated_and_back(ray_cluster, ep_saved, reference, tmp_path):
    # dp=2 with the experts replicated reads both devices' rows into its flat unit; saved
    # again from there (replicated, in halves of the flat unit), a job with the experts
    # divided reads its rows back.
    path, _ = ep_saved
    continue_from(path, DP, reference, save_to=tmp_path / "replicated")
    continue_from(tmp_path / "replicated", DP_EP, reference)


def test_dcp_to_torch_save_of_an_ep_checkpoint_loads_into_the_plain_model(ray_cluster, ep_saved, reference,
                                                                         tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, _ = ep_saved
    _, ref_params, ref_state = reference
    dcp_to_torch_save(path, tmp_path / "plain.pt")
    whole = torch.load(tmp_path / "plain.pt", weights_only=False)
    plain = model(perturbed=True)
    plain.load_state_dict(whole["model"])       # strict: every key, every shape
    torch.testing.assert_close(plain.state_dict(), ref_params[SAVE_AT - 1], rtol=1e-12, atol=1e-14)
    assert whole["optim"]["state"].keys() == ref_state.keys()
    for name, moments in ref_state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(whole["optim"]["state"][name][key], moments[key], rtol=1e-12, atol=1e-15,
                                       msg=lambda m: f"{name}.{key}: {m}")
    assert whole["piper"]["step"] == SAVE_AT and whole["piper"]["mesh"] == {"dp": 2}


def test_a_checkpoint_without_optimizer_state_loads_under_ep(ray_cluster, ep_saved, tmp_path):
    # A step-0 checkpoint has no optimizer state: the expert optimizers' state is dropped too,
    # and the job trains on as a fresh one from those weights.
    batches = tiny_batches(SAVE_AT)
    with piper.compile(model(), batches[0], strategy=script(DP_EP), mesh={"dp": 2}, optimizer=ADAMW,
                       timeout=120) as job:
        job.save(tmp_path / "step-0")
        job.step(*batches[0])
        job.load(tmp_path / "step-0")
        assert job.steps == 0
        torch.testing.assert_close(job.state_dict(), model().state_dict(), rtol=0, atol=0)
        losses = [job.step(*b) for b in batches]
    ref = model()
    opt = ADAMW(list(ref.parameters()))
    ref_losses = []
    for b in batches:
        opt.zero_grad()
        loss = ref(*b)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=1e-9)
