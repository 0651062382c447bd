"""Bad input gets a clear error naming the cause and the fix, never a hang."""
import pytest
import torch

import piper
from piper.frontend.capture import capture
from tests.helpers import wait_gone
from tests.test_train import SkipModel, data_parallel, gpt, gpt_batches, pipeline


class Unannotated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        with piper.annotate("PP"):
            h = self.a(x)
        h = torch.relu(h)                      # outside every region
        with piper.annotate("PP"):
            return ((self.b(h).squeeze(-1) - y) ** 2).mean()


class GraphBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        with piper.annotate("PP"):
            out = self.a(x).squeeze(-1)
            if out.sum().item() > 0:           # data-dependent Python branch
                out = out * 2
            return ((out - y) ** 2).mean()


class Tied(torch.nn.Module):
    """`w` is used by three regions: three device groups once each is placed on its own."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, y):
        with piper.annotate("PP"):
            h = x @ self.w
        with piper.annotate("PP"):
            h = torch.tanh(h @ self.w)
        with piper.annotate("PP"):
            return ((h @ self.w.t()).sum(-1) - y).pow(2).mean()


XY = (torch.randn(4, 4), torch.randn(4))


def test_compute_outside_regions_joins_its_first_user():
    program = capture(Unannotated(), XY)
    assert [r.label for r in program.regions] == ["PP=0", "PP=1"]
    (op, why, where), = program.regions[1].joined
    assert op == "aten.relu.default" and why == "first user" and "test_errors.py:" in where


class FedByALaterRegion(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.a(x)
        s = torch.tanh(self.b(h))          # outside: fed by PP=1, first used by PP=0
        return ((self.a(s).sum(-1) - y) ** 2).mean()


def test_compute_fed_by_a_later_region_than_its_first_user_names_the_line():
    model = piper.annotate_modules(FedByALaterRegion(), "PP", [["a"], ["b"]])
    with pytest.raises(piper.PiperError) as err:
        capture(model, XY)
    assert err.value.code == "unannotated-compute"
    assert "tanh" in str(err.value) and "test_errors.py:" in str(err.value)
    assert "first used by region PP=0 but fed by the later region PP=1" in str(err.value)


def test_graph_break_names_the_line():
    with pytest.raises(piper.PiperError) as err:
        capture(GraphBreak(), XY)
    assert err.value.code == "graph-break"
    assert "test_errors.py:" in str(err.value)


def test_tied_weights_across_more_than_two_device_groups():
    # Two groups hold a copy each and add their gradients (tests/test_hf.py trains GPT-2 so).
    with pytest.raises(piper.PiperError) as err:
        piper.compile(Tied(), XY, strategy=pipeline(1), mesh={"pp": 3})
    assert err.value.code == "tied-across-devices"
    assert "`w` is used by regions on 3 device groups" in str(err.value)


def test_region_never_placed():
    @piper.strategy
    def half(s):
        s.place("PP=0", s.mesh["pp"][0])

    with pytest.raises(piper.PiperError) as err:
        piper.compile(SkipModel(), (torch.randn(4, 8), torch.randn(4)), strategy=half, mesh={"pp": 2})
    assert err.value.code == "unplaced-region"
    assert "PP=1, PP=2" in str(err.value)


def test_undivided_work_suggests_sharding_the_batch():
    @piper.strategy
    def replicated(s):
        s.place("PP=0 ", s.mesh["pp"][0])
        s.place("PP=1", s.mesh["pp"][0])
        s.place("PP=2", s.mesh["pp"][1])

    with pytest.raises(piper.PiperError) as err:
        piper.compile(SkipModel(), (torch.randn(4, 8), torch.randn(4)), strategy=replicated,
                      mesh={"dp": 2, "pp": 2})
    assert err.value.code == "undivided-work"
    assert "shard batch over dp" in err.value.diagnostics[0].hint


def test_indivisible_batch():
    with pytest.raises(piper.PiperError) as err:
        piper.compile(SkipModel(), (torch.randn(6, 8), torch.randn(6)), strategy=pipeline(4), mesh={"pp": 3})
    assert err.value.code == "indivisible-batch"


def test_unknown_axis_and_region_have_suggestions():
    @piper.strategy
    def typo(s):
        s.shard("batch", over="dpp")

    with pytest.raises(piper.PiperError) as err:
        piper.compile(SkipModel(), (torch.randn(4, 8), torch.randn(4)), strategy=typo, mesh={"dp": 2})
    assert err.value.code == "unknown-axis" and "`dp`" in err.value.diagnostics[0].hint

    @piper.strategy
    def bad_tag(s):
        s.place("P=0", s.mesh["pp"][0])

    with pytest.raises(piper.PiperError) as err:
        piper.compile(SkipModel(), (torch.randn(4, 8), torch.randn(4)), strategy=bad_tag, mesh={"pp": 3})
    assert err.value.code == "unknown-region" and "PP" in err.value.diagnostics[0].hint
    # The span points at the user's own call.
    assert err.value.diagnostics[0].span.file.endswith("test_errors.py")


def test_a_second_split_or_shard_points_at_the_first():
    from piper.frontend.capture import Program
    from piper.dsl.script import load_strategy
    from piper.job import plan

    for script, first in [("mesh pp=1\nsplit B into BI, BW\nsplit B into BI, BW\n", 2),
                          ("mesh dp=2\nshard batch over dp\nshard optimizer, grads over dp\nshard grads over dp\n", 3)]:
        with pytest.raises(piper.PiperError) as err:
            plan(load_strategy(script), program=Program.chain("PP=1"))
        (label,) = err.value.diagnostics[0].labels
        assert label.span.line == first and "first" in label.message
        assert err.value.diagnostics[0].span.line == first + 1


@pytest.mark.usefixtures("ray_cluster")
def test_dead_worker_is_reported_and_the_job_cleaned_up():
    import ray

    batch = gpt_batches(1)[0]
    job = piper.compile(gpt(2), batch, strategy=pipeline(2), mesh={"pp": 2})
    job.step(*batch)
    ray.kill(job.actors[1])
    with pytest.raises(piper.PiperError) as err:
        job.step(*batch)
    assert err.value.code in ("worker-died", "worker-failed")
    assert "compile a new job" in err.value.diagnostics[0].hint
    assert not wait_gone(job.pids), "a worker process outlived its job"


@pytest.mark.usefixtures("ray_cluster")
def test_closed_job_leaves_no_workers(monkeypatch):
    monkeypatch.delenv("PIPER_KEEP_WORKERS", raising=False)     # the default: workers end with their job
    batch = gpt_batches(1)[0]
    with piper.compile(gpt(2), batch, strategy=data_parallel(), mesh={"dp": 2}) as job:
        job.step(*batch)
        pids = job.pids
    assert not wait_gone(pids)


class BatchNormModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x, y):
        return ((self.bn(self.lin(x)).sum(-1) - y) ** 2).mean()


class TensorAttribute(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.ones(4)            # not registered as a buffer

    def forward(self, x, y):
        return (((self.lin(x) * self.scale).sum(-1) - y) ** 2).mean()


def test_buffer_updated_in_forward_is_refused():
    with pytest.raises(piper.PiperError) as err:
        capture(BatchNormModel(), (torch.randn(8, 4), torch.randn(8)))
    assert err.value.code == "unsupported-model"
    assert "bn." in str(err.value) and "LayerNorm" in err.value.diagnostics[0].hint


def test_plain_tensor_attribute_asks_for_register_buffer():
    with pytest.raises(piper.PiperError) as err:
        capture(TensorAttribute(), (torch.randn(8, 4), torch.randn(8)))
    assert err.value.code == "unsupported-model"
    assert "register_buffer" in err.value.diagnostics[0].hint


def test_an_unknown_device_is_refused_before_the_model_is_captured():
    with pytest.raises(piper.PiperError) as err:
        piper.compile(Unannotated(), XY, device="gpu")    # capturing would fail: compute outside regions
    assert err.value.code == "bad-device"
    assert "device='gpu' is not one of 'auto', 'cpu', 'cuda'" in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.usefixtures("ray_cluster")
def test_cuda_without_enough_gpus_fails_at_once_with_the_count():
    # Not after `timeout` waiting for a placement that can never fit.
    batch = gpt_batches(1)[0]
    with pytest.raises(piper.PiperError) as err:
        piper.compile(gpt(2), batch, strategy=pipeline(2), mesh={"pp": 2}, device="cuda", timeout=60)
    assert err.value.code == "no-resources"
    assert "needs a GPU for each of the 2 devices, and the Ray cluster has 0" in str(err.value)
    assert "device='cpu'" in err.value.diagnostics[0].hint
