"""Checkpoints: job.save under one strategy, job.load under others, and training goes on
exactly as one uninterrupted single-device run (float64, AdamW moments included)."""
import copy
import functools
import math
import random

import pytest
import torch

import piper
from examples.gpt import _corpus_tokens, batches, make_model
from piper.dsl.script import load_strategy
from piper.runtime.state.checkpoint import boxes
from tests.helpers import train_one_device

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
SAVE_AT, MORE = 2, 2          # save after 2 steps, then 2 more under each other strategy


def test_boxes_cover_a_flat_range_exactly_in_order():
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 4)))
        n = math.prod(shape)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        t = torch.arange(n).view(shape)
        got = []
        for offsets, sizes in boxes(shape, lo, hi):
            assert len(offsets) == len(sizes) == len(shape)
            got += t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1).tolist()
        assert got == list(range(lo, hi))
    assert boxes((3, 4), 2, 11) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]


def gpt(regions: int, seed: int = 0):
    """The same parameters whatever the cut into regions: 4 blocks in `regions` PP regions."""
    model, _ = make_model(n_layer=4, n_regions=regions, n_embd=16, n_head=2, block_size=8, seed=seed)
    return model.to(torch.float64)


def data(steps: int):
    stream = batches(_corpus_tokens()[1], 8, 8, seed=3)
    return [next(stream) for _ in range(steps)]


@pytest.fixture(scope="module")
def reference():
    """One device, SAVE_AT + MORE steps: losses, parameters after each step, optimizer state at SAVE_AT."""
    model = gpt(2)
    return train_one_device(model, ADAMW(list(model.parameters())), data(SAVE_AT + MORE), SAVE_AT)


@pytest.fixture(scope="module")
def saved(_ray_session, tmp_path_factory, reference):
    """A checkpoint written at step SAVE_AT by ZeRO-3 x 1F1B on dp=2 x pp=2 (the tests that use it
    also name `ray_cluster`, which is function-scoped: this starts the shared cluster the same way)."""
    import os

    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    path = tmp_path_factory.mktemp("ckpt") / "step-2"
    strategy = load_strategy("use one_f_one_b(microbatches=4) on pp\nuse zero3() on dp\n")
    steps = data(SAVE_AT)
    with piper.compile(gpt(2), steps[0], strategy=strategy, mesh={"dp": 2, "pp": 2}, optimizer=ADAMW,
                       timeout=120) as job:
        losses = [job.step(*b) for b in steps]
        job.save(path)
        written = dict(job.saved_bytes)
    torch.testing.assert_close(losses, reference[0][:SAVE_AT], rtol=1e-10, atol=0)
    return path, written


@pytest.mark.parametrize("script,mesh", [
    ("use one_f_one_b(microbatches=4) on pp", {"pp": 4}),
    ("use dp() on dp", {"dp": 4}),
    ("use dualpipev(microbatches=4) on pp", {"pp": 2}),
], ids=["1f1b-pp4", "dp4", "dualpipev-pp2"])
def test_load_under_another_strategy_continues_exactly(ray_cluster, saved, reference, script, mesh):
    path, _ = saved
    ref_losses, ref_params, _ = reference
    steps = data(SAVE_AT + MORE)
    # Other initial weights: everything must come from the checkpoint.
    with piper.compile(gpt(4, seed=7), steps[0], strategy=load_strategy(script + "\n"), mesh=mesh,
                       optimizer=ADAMW, timeout=120) as job:
        info = job.load(path)
        assert job.steps == SAVE_AT and info["step"] == SAVE_AT
        assert info["mesh"] == {"dp": 2, "pp": 2} and info["zero"] == 3
        torch.testing.assert_close(job.state_dict(), ref_params[SAVE_AT - 1], rtol=1e-10, atol=1e-12)
        losses = [job.step(*b) for b in steps[SAVE_AT:]]
        state = job.state_dict()
        assert job.steps == SAVE_AT + MORE
    torch.testing.assert_close(losses, ref_losses[SAVE_AT:], rtol=1e-9, atol=0)
    torch.testing.assert_close(state, ref_params[-1], rtol=1e-9, atol=1e-12)


def test_every_worker_writes_only_its_own_shards(ray_cluster, saved):
    path, written = saved
    n_bytes = sum(p.numel() for p in gpt(2).parameters()) * 8
    # Parameters and two AdamW moments, split four ways (ZeRO-3 over dp within each of 2 stages).
    assert sum(written.values()) == 3 * n_bytes
    assert all(0 < w < 0.4 * 3 * n_bytes for w in written.values())
    files = sorted(p.name for p in path.iterdir() if p.suffix == ".distcp")
    assert len(files) == 4


def test_dcp_to_torch_save_loads_into_the_plain_model(ray_cluster, saved, reference, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, _ = saved
    _, ref_params, ref_state = reference
    dcp_to_torch_save(path, tmp_path / "plain.pt")
    whole = torch.load(tmp_path / "plain.pt", weights_only=False)
    model = gpt(2, seed=5)
    model.load_state_dict(whole["model"])       # strict: every key, every shape
    torch.testing.assert_close(model.state_dict(), ref_params[SAVE_AT - 1], rtol=1e-10, atol=1e-12)
    assert whole["piper"]["step"] == SAVE_AT and whole["piper"]["mesh"] == {"dp": 2, "pp": 2}
    # The AdamW moments per parameter are the single-device optimizer's.
    assert whole["optim"]["state"].keys() == ref_state.keys()
    for name, moments in ref_state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(whole["optim"]["state"][name][key], moments[key], rtol=1e-12, atol=1e-15)


@pytest.mark.full      # the reshards above and the step-0 load in test_checkpoint_experts.py cover its paths
def test_replicated_save_and_a_step_zero_checkpoint_load_under_zero2_and_1f1b(ray_cluster, reference, tmp_path):
    # dp writes each replicated parameter in halves, one per replica; ZeRO-2 reads whole
    # parameters but only its slice of the optimizer state. A checkpoint of step 0 has no
    # optimizer state: loading it into a job that has one drops it, as a fresh job has none.
    ref_losses, ref_params, _ = reference
    steps = data(SAVE_AT + MORE)
    with piper.compile(gpt(2), steps[0], strategy=load_strategy("use dp() on dp\n"), mesh={"dp": 2},
                       optimizer=ADAMW, timeout=120) as job:
        job.save(tmp_path / "step-0")
        for b in steps[:SAVE_AT]:
            job.step(*b)
        job.save(tmp_path / "step-2")
    strategy = load_strategy("use one_f_one_b(microbatches=4) on pp\nuse zero2() on dp\n")
    with piper.compile(gpt(2, seed=7), steps[0], strategy=strategy, mesh={"dp": 2, "pp": 2}, optimizer=ADAMW,
                       timeout=120) as job:
        job.load(tmp_path / "step-2")
        losses = [job.step(*b) for b in steps[SAVE_AT:]]
        torch.testing.assert_close(losses, ref_losses[SAVE_AT:], rtol=1e-9, atol=0)
        torch.testing.assert_close(job.state_dict(), ref_params[-1], rtol=1e-9, atol=1e-12)
        assert job.load(tmp_path / "step-0")["step"] == 0 and job.steps == 0
        torch.testing.assert_close([job.step(*steps[0])], ref_losses[:1], rtol=1e-9, atol=0)
        torch.testing.assert_close(job.state_dict(), ref_params[0], rtol=1e-9, atol=1e-12)


class Tied(torch.nn.Module):
    """An embedding and a head sharing one weight, as GPT-2 ties them."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.mix(self.embed(x))))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), y.reshape(-1))


def test_tied_parameters_are_saved_under_both_names(ray_cluster, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    torch.manual_seed(0)
    model = Tied().double()
    batch = (torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5)))
    with piper.compile(copy.deepcopy(model), batch, strategy=load_strategy("use zero3() on dp\n"), mesh={"dp": 2},
                       optimizer=ADAMW, timeout=120) as job:
        job.step(*batch)
        job.save(tmp_path / "ckpt")
        trained = job.state_dict()
        job.load(tmp_path / "ckpt")          # the alias is no unexpected key
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "plain.pt")
    whole = torch.load(tmp_path / "plain.pt", weights_only=False)["model"]
    assert set(whole) == {"embed.weight", "head.weight", "mix.weight", "mix.bias"}
    model.load_state_dict(whole)
    assert model.head.weight is model.embed.weight
    torch.testing.assert_close(model.embed.weight, trained["embed.weight"], rtol=0, atol=0)


class Other(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.a = torch.nn.Linear(8, width)
        self.b = torch.nn.Linear(width, 1)

    def forward(self, x, y):
        with piper.annotate("PP"):
            h = torch.tanh(self.a(x))
        with piper.annotate("PP"):
            loss = ((self.b(h).squeeze(-1) - y) ** 2).mean()
        return loss


def test_bad_checkpoints_are_named_with_cause_and_fix(ray_cluster, saved, tmp_path):
    path, _ = saved
    batch = (torch.randn(4, 8), torch.randn(4))
    with piper.compile(Other(), batch, strategy=load_strategy("use dp() on dp\n"), mesh={"dp": 2},
                       timeout=120) as job:
        with pytest.raises(piper.PiperError) as err:
            job.load(path)              # another model: GPT names everywhere
        assert err.value.code == "checkpoint-mismatch"
        text = str(err.value)
        assert "missing from the checkpoint" in text and "a.weight" in text
        assert "4 missing" in text and "in the checkpoint but not in this model" in text
        assert "blocks.0.attn.c_attn.weight" in text and "saved at step 2" in text
        for bad in (tmp_path / "nowhere", tmp_path):
            with pytest.raises(piper.PiperError) as err:
                job.load(bad)
            assert err.value.code == "not-a-checkpoint" and "job.save(path)" in str(err.value)
        # Same names, other shapes.
        job.save(tmp_path / "narrow")
        job.step(*batch)                # the job still runs after refusing a checkpoint
    with piper.compile(Other(width=12), batch, strategy=load_strategy("use dp() on dp\n"), mesh={"dp": 2},
                       timeout=120) as job:
        with pytest.raises(piper.PiperError) as err:
            job.load(tmp_path / "narrow")
        assert err.value.code == "checkpoint-mismatch"
        assert "a.weight saved (16, 8), here (12, 8)" in str(err.value)


def test_a_checkpoint_torch_wrote_from_get_state_dict_loads_and_continues(ray_cluster, tmp_path):
    # What FSDP2 or plain PyTorch training saves with torch's own helpers (here from one process).
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = Other().double()
    batches = [(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, dtype=torch.float64)) for _ in range(3)]
    opt = ADAMW(model.parameters())
    losses = []
    for i, b in enumerate(batches):
        if i == 2:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "torch", no_dist=True)
        opt.zero_grad()
        loss = model(*b)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with piper.compile(Other().double(), batches[0], strategy=load_strategy("use zero3() on dp\n"),
                       mesh={"dp": 2}, optimizer=ADAMW, timeout=120) as job:
        info = job.load(tmp_path / "torch")
        assert info["step"] == 2 and job.steps == 2
        torch.testing.assert_close(job.step(*batches[2]), losses[2], rtol=1e-10, atol=0)
        torch.testing.assert_close(job.state_dict(), model.state_dict(), rtol=1e-10, atol=1e-12)


TINY = '''
import torch
from examples.gpt import _corpus_tokens, batches, make_model

def tiny():
    return make_model(n_layer=2, n_regions=2, n_embd=16, n_head=2, block_size=8)[0]

def training_batches(batch_size):
    return batches(_corpus_tokens()[1], batch_size, 8, seed=0)
'''


def test_piper_run_saves_every_n_steps_and_resumes_where_it_stopped(ray_cluster, tmp_path):
    import shutil

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from piper.cli import main

    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "job.pps").write_text("mesh dp=2\nuse zero3() on dp\n")
    ckpt = tmp_path / "ckpt"
    common = ["run", str(tmp_path / "job.pps"), "--model", f"{tmp_path / 'tiny.py'}:tiny", "--steps", "6",
              "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    assert main(common) == 0
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["step-4", "step-6"]     # the last two
    # As if the run had died after step 4: resume from there, train steps 5 and 6 again.
    shutil.move(ckpt / "step-6", tmp_path / "uninterrupted")
    assert main([*common, "--resume"]) == 0
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["step-4", "step-6"]
    states = []
    for path in (tmp_path / "uninterrupted", ckpt / "step-6"):
        dcp_to_torch_save(path, path.with_suffix(".pt"))
        states.append(torch.load(path.with_suffix(".pt"), weights_only=False))
    assert states[0]["piper"]["step"] == states[1]["piper"]["step"] == 6
    torch.testing.assert_close(states[1]["model"], states[0]["model"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(states[1]["optim"], states[0]["optim"], rtol=1e-6, atol=1e-7)
    # Flags that do not go together are a usage error before anything starts.
    assert main(["run", str(tmp_path / "job.pps"), "--model", f"{tmp_path / 'tiny.py'}:tiny", "--resume"]) == 2
