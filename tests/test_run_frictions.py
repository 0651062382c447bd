"""`piper run`'s smaller frictions: --metrics goes on after a resume (and its folder is made), steps are
numbered from 1 everywhere, progress lines name no source file and are not cut at 80 columns when
written to a pipe, Ctrl-C ends with 130 and says what was kept, and other libraries' noise (torch's
gradient-layout warning in the workers, Ray's start-up concurrency warning, torch.export's
`always_classified is unsupported`) is left out, each at its source and alone."""
import json
import logging
import os
import re
import signal
import warnings

import pytest
import torch

import piper
from piper.cli import main
from piper.job import quiet
from tests.test_checkpoint_lock import MODEL_FILE


def _run(tmp_path, steps, *flags):
    (tmp_path / "m.py").write_text(MODEL_FILE)
    (tmp_path / "s.pps").write_text("split MB into 2\n")
    return main(["run", str(tmp_path / "s.pps"), "--model", f"{tmp_path}/m.py:make", "--steps", str(steps),
                 "--batch-size", "4", "--device", "cpu", *flags])


@pytest.mark.usefixtures("ray_cluster")
def test_metrics_go_on_after_a_resume_and_steps_count_from_one_in_every_line(tmp_path, capsys):
    # A checkpoint folder with a long name: its lines must come out whole through a pipe.
    ckpt = tmp_path / ("checkpoints-of-a-run-with-a-long-descriptive-name-" + "x" * 60)
    metrics = tmp_path / "logs" / "run" / "m.jsonl"                      # a folder that does not exist yet
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--metrics", str(metrics),
             "--peak-flops", "1e9"]
    assert _run(tmp_path, 4, *flags) == 0
    first = capsys.readouterr().err
    assert _run(tmp_path, 6, *flags, "--resume") == 0
    second = capsys.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]           # appended, the job's own numbers
    assert rows[-1]["samples"] == 6 * 4
    # MFU beside the throughput: 240 training FLOPs per sample (3 x (2*4*8 + 2*8*1)) against 1e9 FLOP/s.
    assert "MFU against 1e+09 FLOP/s per device (--peak-flops), 240 FLOPs per sample" in first
    assert all(r["mfu"] == pytest.approx(240 * r["samples_per_s"] / 1e9) for r in rows)
    assert re.search(r"samples/s  MFU [0-9.e+-]+%", first)
    # 1-based in the progress lines too: the first step is step 1, the resumed run's first is step 5.
    steps_shown = [int(n) for n in re.findall(r"\] step +(\d+)  loss", first + second)]
    assert steps_shown[0] == 1 and 0 not in steps_shown and 5 in steps_shown
    assert f"loaded checkpoint {ckpt}/step-4 (step 4)" in second and "over steps 5-6" in second
    # No source locations (rich's log_path: `train.py:66`), and no line cut at the pipe's 80 columns.
    assert not re.search(r"\b\w+\.py:\d+", first + second)
    assert f"saved checkpoint {ckpt}/step-2 (" in first and f"saved checkpoint {ckpt}/step-6 (" in second


@pytest.mark.usefixtures("ray_cluster")
def test_ctrl_c_ends_with_130_and_says_what_was_saved_and_how_to_go_on(tmp_path, capsys, monkeypatch):
    from piper.job.train import StepReport

    ckpt = tmp_path / "ckpt"
    step = StepReport.step

    def interrupted_at_the_fifth(self, number, loss, seconds):
        step(self, number, loss, seconds)
        if number == 4:
            os.kill(os.getpid(), signal.SIGINT)      # as a terminal's Ctrl-C delivers it
    monkeypatch.setattr(StepReport, "step", interrupted_at_the_fifth)
    assert _run(tmp_path, 8, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2") == 130
    err = " ".join(capsys.readouterr().err.split())
    assert "interrupted (Ctrl-C) after step 5 of 8" in err
    assert f"the last checkpoint is {ckpt}/step-4 (step 4); steps 5-5 are in no checkpoint" in err
    assert "--resume" in err
    # Without checkpoints: nothing kept, and how to keep it next time.
    monkeypatch.setattr(StepReport, "step", lambda self, n, loss, s: (step(self, n, loss, s),
                                                                        os.kill(os.getpid(), signal.SIGINT)))
    assert _run(tmp_path, 3) == 130
    err = " ".join(capsys.readouterr().err.split())
    assert "after step 1 of 3" in err and "nothing was saved: steps 1-1 are lost" in err


def test_torch_exports_classification_line_is_dropped_and_nothing_else(caplog):
    quiet.quiet_driver_noise()
    log = logging.getLogger("torch.export._trace")
    with caplog.at_level(logging.ERROR, logger="torch.export._trace"):
        log.error("always_classified is unsupported.")
        log.error("something else went wrong")
    assert [r.getMessage() for r in caplog.records] == ["something else went wrong"]


def test_rays_startup_concurrency_warning_is_dropped_and_other_raylet_lines_kept(capsys):
    import ray._private.worker as ray_worker

    quiet.quiet_driver_noise()
    warning = ("WARNING: 8 PYTHON worker processes have been started on node: 5f3e with address: 192.0.2.2, "
               "which is 4x the maximum expected startup concurrency (2). This could be a result of using a large "
               "number of actors, tasks blocked in ray.get() calls, or tasks with fractional CPU requests.")
    ray_worker.print_to_stdstream({"lines": [warning], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    ray_worker.print_to_stdstream({"lines": ["the raylet ran out of memory"], "pid": "raylet", "is_err": False},
                                  ignore_prefix=False)
    out = capsys.readouterr().out
    assert "startup concurrency" not in out and "the raylet ran out of memory" in out


LAYOUT = ("grad and param do not obey the gradient layout contract. This is not an error, but may impair "
          "performance.\ngrad.sizes() = [4, 3], strides() = [1, 4]")


def _layout_warnings(worker=None):
    """In a worker: which of torch's gradient-layout warning (as torch raises it from C++: a UserWarning with
    this text; the C++ side warns once per process, so it is raised here by hand) and one of the user's own
    get through the process's filters."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(LAYOUT, UserWarning)
        warnings.warn("a warning of the user's own", UserWarning)
    return [str(w.message) for w in caught]


def test_workers_drop_torchs_gradient_layout_warning_and_keep_others(ray_cluster):
    import functools

    import ray

    from tests.test_hardening_jobs import XY, Net

    with piper.compile(Net(), XY, optimizer=functools.partial(torch.optim.SGD, lr=0.1)) as job:
        seen = ray.get(job.actors[0].__ray_call__.remote(_layout_warnings), timeout=120)
    assert seen == ["a warning of the user's own"]


def test_model_flops_are_counted_from_the_captured_graphs_matmuls():
    """A GPT's training FLOPs per token: 6 x the matrix parameters, plus attention's two products per layer
    (3 x 2 x 64 positions x (16 + 16) x 4 heads), as PaLM's MFU counts them."""
    from examples.gpt import example_batch, two_stage_gpt
    from piper.frontend.capture import capture
    from piper.job.mfu import flops_per_item

    program = capture(two_stage_gpt(), example_batch(4))
    matrices = 4 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64) + 61 * 64
    assert flops_per_item(program) == 6 * matrices + 4 * 3 * 2 * 64 * (16 + 16) * 4


def test_the_peak_comes_from_the_flag_else_a_gemm_measured_on_the_cpu():
    from piper.job.mfu import peak_flops

    assert peak_flops("cpu", 5e12) == (5e12, "--peak-flops")
    peak, source = peak_flops("cpu")
    assert peak > 1e6 and "GEMM" in source
