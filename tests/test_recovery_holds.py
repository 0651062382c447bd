"""Recovery where it is needed (`piper.job.recovery`, `piper run`): a worker lost while a checkpoint is
written, `--resume` with `--max-restarts`, a broken newest checkpoint, the final step saved, outputs
checked before the workers start, the job's own step numbers in progress, metrics and traces, and the
flags that reach `piper.compile` (timeouts, precision, clipping, non-finite steps, a local cluster)."""
import io
import json
import os

import pytest
import torch
from rich.console import Console

import piper
from piper.cli import main
from piper.diagnostics import error
from piper.dsl.script import load_strategy
from piper.job.recovery import Checkpoints, StepData, checkpoint_problem, train
from tests.test_recovery import _FakeJob

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Job(_FakeJob):
    """A fake job that 'trains' by summing its batches, and loses a worker where `faults` says:
    ("step", k) at step k, ("save", k) while saving after k steps, once each."""

    def __init__(self, faults):
        super().__init__([])
        self.faults = faults

    def _maybe_fail(self, where):
        if where in self.faults:
            self.faults.remove(where)
            raise error("worker-died", f"rank 1 died during `{where[0]}`")

    def step(self, x):
        self._maybe_fail(("step", self.steps))
        self.weight += x
        self.steps += 1
        return self.weight

    def save(self, path):
        self._maybe_fail(("save", self.steps))
        super().save(path)


DATA = StepData(lambda: ((float(k),) for k in range(100)))
UNINTERRUPTED = [sum(range(k + 1)) for k in range(10)]


def _starter(faults):
    jobs = []

    def start():
        jobs.append(_Job(faults))
        return jobs[-1]
    return start, jobs


def test_a_worker_lost_while_saving_restarts_and_the_save_is_done_again(tmp_path):
    start, jobs = _starter([("save", 4)])
    saved = []
    ckpt = Checkpoints(str(tmp_path / "ckpt"), every=2, on_save=lambda path, s: saved.append(os.path.basename(path)))
    losses, (r,) = train(start, DATA, 6, max_restarts=1, checkpoints=ckpt)
    assert losses == UNINTERRUPTED[:6]
    assert (r.during, r.failed_at, r.resumed_from) == ("save", 4, 2)     # back to the last whole checkpoint
    assert saved == ["step-2", "step-4", "step-6"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-4", "step-6"] and len(jobs) == 2
    assert all(j.closed for j in jobs)


def test_a_lost_worker_during_finish_restarts_and_finishes():
    start, jobs = _starter([])
    calls = []

    def finish(job):
        calls.append(job.steps)
        if len(calls) == 1:
            raise error("worker-died", "rank 0 died during `save`")

    losses, (r,) = train(start, DATA, 3, max_restarts=1, finish=finish)
    assert losses == UNINTERRUPTED[:3] and r.during == "finish" and calls == [3, 3]


def test_resume_with_max_restarts_returns_the_steps_it_trained(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    start, _ = _starter([])
    train(start, DATA, 4, checkpoints=Checkpoints(ckpt, every=2))
    # Goes on from step 4 and loses a worker at step 6: no KeyError, the losses of steps 4-7.
    start, _ = _starter([("step", 6)])
    again = Checkpoints(ckpt, every=2)
    losses, (r,) = train(start, DATA, 8, max_restarts=2, checkpoints=again, resume=True)
    assert losses == UNINTERRUPTED[4:8] and again.loaded[0] in (4, 6) and r.resumed_from == 6


def test_checkpoint_every_saves_the_final_step_and_says_so(tmp_path):
    start, _ = _starter([])
    saved = []
    ckpt = Checkpoints(str(tmp_path / "ckpt"), every=4, on_save=lambda path, s: saved.append(os.path.basename(path)))
    train(start, DATA, 6, checkpoints=ckpt)
    assert saved == ["step-4", "step-6"]


def test_resume_passes_over_a_broken_newest_checkpoint_and_says_why(tmp_path):
    ckpt = tmp_path / "ckpt"
    start, _ = _starter([])
    train(start, DATA, 6, checkpoints=Checkpoints(str(ckpt), every=2, keep=3))
    assert checkpoint_problem(str(ckpt / "step-6")) is None
    (shard,) = [p for p in (ckpt / "step-6").iterdir() if p.suffix == ".distcp"]
    shard.unlink()
    assert checkpoint_problem(str(ckpt / "step-6")).endswith(f"{shard.name} is missing: the checkpoint's index names it")
    (shard4,) = [p for p in (ckpt / "step-4").iterdir() if p.suffix == ".distcp"]
    shard4.write_bytes(shard4.read_bytes()[:3])
    assert "holds 3 bytes" in checkpoint_problem(str(ckpt / "step-4"))
    (ckpt / "step-9").mkdir()                      # no .metadata: not even listed
    skipped = []
    again = Checkpoints(str(ckpt), every=2, on_skip=lambda path, why: skipped.append((os.path.basename(path), why)))
    start, _ = _starter([])
    losses, _ = train(start, DATA, 8, checkpoints=again, resume=True)
    assert [name for name, _ in skipped] == ["step-6", "step-4"] and again.loaded == (2, str(ckpt / "step-2"))
    assert losses == UNINTERRUPTED[2:8]


def test_step_report_numbers_steps_from_the_job_and_counts_restarts(tmp_path):
    from piper.job.train import StepReport, fit

    metrics = tmp_path / "m.jsonl"
    console = Console(file=io.StringIO(), width=200)
    with StepReport(12, tokens_per_batch=8, console=console, metrics=str(metrics)) as report:
        report.step(9, 1.5, 0.5)
        report.restarts += 1
        report.step(9, 1.5, 0.25)
        report.step(10, 1.25, 0.25)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(m["step"], m["restarts"], m["tokens"]) for m in lines] == [(10, 0, 80), (10, 1, 80), (11, 1, 88)]
    assert "step  10  loss 1.5000" in console.file.getvalue() and "step   1 " not in console.file.getvalue()
    job = _Job([])
    job.steps = 3                                  # as a loaded checkpoint leaves it
    fit(job, iter([(1.0,), (2.0,)]), 2, tokens_per_batch=4, console=console, metrics=str(metrics))
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [4, 5]


def test_a_trace_labels_steps_with_the_job_s_numbers():
    from piper.compiler.trace import run_trace

    class Compiled:
        plans = {0: []}

        class ir:
            mesh = piper.Mesh((("pp", 1),))

    recorded = [{"clock": (0.0, 0.0), "steps": [(1.0, [], {}, 0), (2.0, [], {}, 0)]}]
    doc = run_trace(Compiled, recorded, steps_done=15)
    assert [e["name"] for e in doc["traceEvents"] if e.get("cat") == "step"] == ["step 14", "step 15"]


MODEL_FILE = """
import torch
import piper

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8, dtype=torch.float64)
        self.b = torch.nn.Linear(8, 1, dtype=torch.float64)

    def forward(self, x, y):
        with piper.annotate("PP"):
            h = torch.tanh(self.a(x))
        with piper.annotate("PP"):
            return ((self.b(h).squeeze(-1) - y) ** 2).mean()

def make():
    return Net()

def training_batches(batch_size):
    g = torch.Generator().manual_seed(1)
    while True:
        yield (torch.randn(batch_size, 4, generator=g, dtype=torch.float64),
               torch.randn(batch_size, generator=g, dtype=torch.float64))
"""


@pytest.mark.parametrize("flag, path, says", [
    ("--save", "{tmp}/missing/w.pt", "which does not exist"),
    ("--save", "{tmp}/a_file/ckpt", "which is a file"),
    ("--trace", "{tmp}", "is a directory"),
    ("--metrics", "{tmp}/a_file/m.jsonl", "which is a file"),
    ("--checkpoint-dir", "{tmp}/a_file", "is a file"),
])
def test_output_paths_are_checked_before_anything_starts(tmp_path, capsys, monkeypatch, flag, path, says):
    import piper.cli_run as cli_run

    (tmp_path / "a_file").write_text("x")
    (tmp_path / "m.py").write_text(MODEL_FILE)
    monkeypatch.setattr(cli_run, "load_model", lambda spec: pytest.fail("the model was loaded"))
    extra = ["--checkpoint-every", "2"] if flag == "--checkpoint-dir" else []
    args = ["run", "s.pps", "--model", f"{tmp_path}/m.py:make", flag, path.format(tmp=tmp_path), *extra]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "error[bad-output]" in err and flag in err and says in err


def test_piper_run_starts_its_own_cluster_and_passes_its_flags_to_compile(tmp_path, monkeypatch, capsys):
    import ray

    import piper.cli_run as cli_run

    (tmp_path / "m.py").write_text(MODEL_FILE)
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.setdefault("init", kw))
    monkeypatch.setattr(ray, "shutdown", lambda: seen.setdefault("shutdown", True))

    def compile(model, batch, **options):
        seen["compile"] = options
        raise error("no-resources", "stop here")
    monkeypatch.setattr(cli_run, "compile", compile)
    assert main(["run", "s.pps", "--model", f"{tmp_path}/m.py:make", "--timeout", "7", "--startup-timeout", "9",
                 "--precision", "bf16", "--clip-grad-norm", "0.5", "--skip-nonfinite"]) == 1
    assert seen["init"]["address"] == "local" and seen["shutdown"]
    options = seen["compile"]
    assert (options["timeout"], options["startup_timeout"], options["precision"], options["clip_grad_norm"],
            options["nonfinite"], options["address"]) == (7.0, 9.0, "bf16", 0.5, "skip", None)
    # Bad limits are usage errors.
    assert main(["run", "s.pps", "--model", f"{tmp_path}/m.py:make", "--timeout", "0"]) == 2


def test_a_non_finite_loss_stops_naming_its_step_or_is_skipped():
    from types import SimpleNamespace

    from piper.job.steps import SKIPPED_IN_A_ROW, check_finite

    job = SimpleNamespace(steps=1, training=SimpleNamespace(nonfinite="stop"))
    check_finite(job, 2.0)
    job.steps = 2
    with pytest.raises(piper.PiperError) as err:
        check_finite(job, float("nan"))
    assert err.value.code == "non-finite" and "the loss of step 2 is nan" in str(err.value)
    assert "step 1's loss was finite" in str(err.value)
    skip = SimpleNamespace(steps=0, training=SimpleNamespace(nonfinite="skip"))
    for k in range(SKIPPED_IN_A_ROW - 1):
        skip.steps += 1
        check_finite(skip, float("inf"))
    assert skip.skipped_steps == SKIPPED_IN_A_ROW - 1
    skip.steps += 1
    with pytest.raises(piper.PiperError, match=f"steps 1-{SKIPPED_IN_A_ROW} all had a non-finite loss"):
        check_finite(skip, float("inf"))
    with pytest.raises(piper.PiperError) as err:
        piper.compile(torch.nn.Linear(2, 1), (torch.zeros(2, 2),), nonfinite="ignore")
    assert err.value.code == "bad-nonfinite"


def test_the_skip_of_non_finite_gradients_is_the_loss_scaler_s_at_scale_one():
    from piper.runtime.state.precision import DynamicLossScale, with_loss_scaling

    guard = with_loss_scaling(None, None, skip_nonfinite=True)
    assert isinstance(guard, DynamicLossScale) and guard.loss_scale == 1.0
    assert with_loss_scaling(None, None) is None


class _Detached(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a = torch.nn.Linear(4, 1)
        self.how = how

    def forward(self, x, y):
        loss = ((self.a(x).squeeze(-1) - y) ** 2).mean()
        return loss.detach() if self.how == "detach" else (loss * 100).long()


@pytest.mark.parametrize("how", ["detach", "integer"])
def test_a_loss_without_gradient_is_refused_before_any_worker_starts(how, monkeypatch):
    from piper.job import Job

    monkeypatch.setattr(Job, "_start", lambda *a: pytest.fail("workers were started"))
    with pytest.raises(piper.PiperError) as err:
        piper.compile(_Detached(how), (torch.randn(4, 4), torch.randn(4)))
    assert err.value.code == "loss-without-gradient"
    assert ("int64" in str(err.value)) == (how == "integer")


def test_meta_parameters_are_refused_before_capture():
    with torch.device("meta"):
        model = _Detached("detach")
    with pytest.raises(piper.PiperError) as err:
        piper.compile(model, (torch.randn(4, 4), torch.randn(4)))
    assert err.value.code == "meta-parameters" and "`a.weight`" in str(err.value)


def test_memory_is_checked_against_the_nodes():
    from types import SimpleNamespace

    from piper.job import memory_check

    job = SimpleNamespace(device="cpu")
    nodes = [{"Alive": True, "Resources": {"memory": 600.0, "object_store_memory": 400.0}},
             {"Alive": False, "Resources": {"memory": 1e12}}]
    assert memory_check.node_memory(nodes) == [1000]
    real = memory_check.predicted_bytes
    try:
        memory_check.predicted_bytes = lambda job, opt: {0: 700, 1: 200}
        assert memory_check.check_memory(job, None, nodes) == {0: 700, 1: 200}
        memory_check.predicted_bytes = lambda job, opt: {0: 700, 1: 400}
        with pytest.raises(piper.PiperError) as err:
            memory_check.check_memory(job, None, nodes)
        assert err.value.code == "not-enough-memory" and "the 2 workers need at least 1.07 KiB" in str(err.value)
        two = nodes[:1] * 2
        memory_check.predicted_bytes = lambda job, opt: {0: 1500, 1: 10}
        with pytest.raises(piper.PiperError, match="rank 0 needs at least 1.46 KiB"):
            memory_check.check_memory(job, None, two)
    finally:
        memory_check.predicted_bytes = real
    assert memory_check.machine_memory() is None or memory_check.machine_memory() > 0


# ---- on the cluster ---------------------------------------------------------------------------------

PP2 = "mesh pp=2\nuse one_f_one_b(microbatches=2) on pp\n"


def _run(tmp_path, *flags, steps=4):
    (tmp_path / "m.py").write_text(MODEL_FILE)
    (tmp_path / "pp2.pps").write_text(PP2)
    return main(["run", str(tmp_path / "pp2.pps"), "--model", f"{tmp_path}/m.py:make", "--steps", str(steps),
                 "--batch-size", "4", "--device", "cpu", *flags])


def _text(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())      # rich wraps long lines


def _losses(path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, path.read_text().splitlines())}


@pytest.mark.usefixtures("ray_cluster")
def test_piper_run_resumes_with_restarts_from_the_last_whole_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    first = tmp_path / "first.jsonl"
    assert _run(tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4", "--metrics", str(first),
                steps=6) == 0
    text = _text(capsys)
    assert f"saved checkpoint {ckpt}/step-4" in text and f"saved checkpoint {ckpt}/step-6" in text  # the final one
    for shard in (ckpt / "step-6").glob("*.distcp"):
        shard.unlink()
        break
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "t.json"
    assert _run(tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4", "--resume",
                "--max-restarts", "1", "--metrics", str(metrics), "--trace", str(trace), steps=8) == 0
    text = _text(capsys)
    assert f"skipping checkpoint {ckpt}/step-6: " in text and ".distcp is missing" in text
    assert f"loaded checkpoint {ckpt}/step-4 (step 4)" in text and "over steps 5-8" in text
    assert "step 5 loss" in text and "step 1 loss" not in text
    again = _losses(metrics)
    assert sorted(again) == [5, 6, 7, 8]
    for step in (5, 6):                     # the same steps as the first run, from the same state
        assert again[step] == pytest.approx(_losses(first)[step], rel=1e-9)
    doc = json.loads(trace.read_text())
    assert sorted({e["name"] for e in doc["traceEvents"] if e.get("cat") == "step"}) == ["step 7", "step 8"]
    assert (ckpt / "step-8").is_dir()


@pytest.mark.usefixtures("ray_cluster")
def test_piper_run_names_a_stopped_worker_within_its_timeout_and_goes_on(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "stopped"
    monkeypatch.setenv("PIPER_FAULT", f"rank=1 action=1F0 do=stop step=1 once={marker}")
    metrics = tmp_path / "m.jsonl"
    # The failed step waits out the whole timeout (a stopped worker never answers): keep it short.
    assert _run(tmp_path, "--timeout", "4", "--max-restarts", "1", "--metrics", str(metrics), steps=3) == 0
    text = _text(capsys)
    assert "restart worker-timeout" in text and "rank 1 (pp=1)" in text and marker.exists()
    assert "from the start (failed at step 2)" in text      # no checkpoint: over from the start
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(m["step"], m["restarts"]) for m in lines] == [(1, 0), (1, 1), (2, 1), (3, 1)]
    assert lines[1]["loss"] == pytest.approx(lines[0]["loss"], rel=1e-12)


@pytest.mark.usefixtures("ray_cluster")
def test_a_worker_killed_while_saving_restarts_and_ends_as_an_uninterrupted_run(tmp_path, capsys, monkeypatch):
    reference = tmp_path / "ref.jsonl"
    assert _run(tmp_path, "--metrics", str(reference)) == 0
    capsys.readouterr()
    marker = tmp_path / "killed"
    monkeypatch.setenv("PIPER_FAULT", f"rank=0 action=save do=kill step=2 once={marker}")
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    assert _run(tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--max-restarts", "1",
                "--metrics", str(metrics)) == 0
    text = _text(capsys)
    assert "restart worker-died" in text and "failed while saving the checkpoint of step 2" in text
    assert marker.exists() and sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["step-2", "step-4"]
    want = _losses(reference)
    assert _losses(metrics) == pytest.approx(want, rel=1e-9)


@pytest.mark.usefixtures("ray_cluster")
def test_an_infinite_learning_rate_stops_at_the_step_it_spoils(tmp_path, capsys):
    assert _run(tmp_path, "--lr", "inf", "--optimizer", "sgd") == 1
    text = _text(capsys)
    assert "error[non-finite]" in text and "the loss of step 2 is nan" in text and "step 1's loss was finite" in text


@pytest.mark.usefixtures("ray_cluster")
def test_nonfinite_skip_leaves_the_weights_as_they_were_and_trains_on():
    import functools

    from piper.testing import single_device

    torch.manual_seed(0)
    ns = {}
    exec(MODEL_FILE, ns)
    model = ns["make"]()
    batches = [next(ns["training_batches"](4)) for _ in range(1)]
    bad = (torch.full_like(batches[0][0], float("nan")), batches[0][1])
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    with piper.compile(model, batches[0], strategy=load_strategy(PP2), optimizer=sgd, nonfinite="skip",
                       timeout=60) as job:
        before = job.state_dict()
        assert job.step(*bad) != job.step(*bad)                  # nan, twice: both skipped
        torch.testing.assert_close(job.state_dict(), before, rtol=0, atol=0)
        loss = job.step(*batches[0])
        after = job.state_dict()
        assert piper.loss_scale(job)["skipped_steps"] == 2 and job.skipped_steps == 2
    torch.manual_seed(0)
    ref_losses, ref_state = single_device(ns["make"](), batches, sgd)
    assert loss == pytest.approx(ref_losses[0], rel=1e-9)
    torch.testing.assert_close(after, ref_state, rtol=1e-9, atol=1e-12)


@pytest.mark.usefixtures("ray_cluster")
def test_workers_that_cannot_fit_are_refused_before_they_start(monkeypatch):
    from piper.job import memory_check

    monkeypatch.setattr(memory_check, "node_memory", lambda nodes, ip=None: [1024])
    from piper.job import Job

    monkeypatch.setattr(Job, "_new_workers", lambda *a: pytest.fail("workers were started"))
    ns = {}
    exec(MODEL_FILE, ns)
    with pytest.raises(piper.PiperError) as err:
        piper.compile(ns["make"](), next(ns["training_batches"](4)), strategy=load_strategy(PP2))
    assert err.value.code == "not-enough-memory" and "the cluster's 1 node(s) have 1.00 KiB" in str(err.value)
