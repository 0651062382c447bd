"""Saves that fail or are cut short leave the previous checkpoint whole and the job running;
damaged or crafted checkpoints are refused before any worker reads them, and run nothing
on the workers either (tests/test_checkpoint_safety.py checks the files without a job)."""
import os
import pickle
import shutil

import pytest
import torch

import piper
from piper.dsl.script import load_strategy
from piper.job.checkpoint import MANIFEST, verify_checkpoint
from tests.test_checkpoint import ADAMW, Other
from tests.test_checkpoint_safety import Payload

BATCHES = [(torch.randn(4, 8, generator=torch.Generator().manual_seed(i), dtype=torch.float64),
            torch.randn(4, generator=torch.Generator().manual_seed(100 + i), dtype=torch.float64)) for i in range(4)]


def compile_job(**kw):
    torch.manual_seed(0)
    return piper.compile(Other().double(), BATCHES[0], strategy=load_strategy("use zero3() on dp\n"),
                         mesh={"dp": 2}, optimizer=ADAMW, timeout=120, **kw)


def siblings(path) -> list[str]:
    return sorted(os.listdir(os.path.dirname(path)))


def test_a_failed_save_keeps_the_old_checkpoint_and_the_job(ray_cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    # Rank 1 raises once its data file is written, in the save after its first step.
    with compile_job(worker_env={"PIPER_FAULT": "rank=1 do=raise action=save step=1"}) as job:
        job.save(ckpt)                                        # step 0: whole
        first = job.state_dict()
        (tmp_path / "afile").write_text("not a directory")
        for bad in (tmp_path / "afile", tmp_path / "afile" / "ckpt"):      # a file; a path under a file
            with pytest.raises(piper.PiperError) as err:
                job.save(bad)
            assert err.value.code == "checkpoint-save-failed"
        assert (tmp_path / "afile").read_text() == "not a directory"
        job.step(*BATCHES[0])
        with pytest.raises(piper.PiperError) as err:
            job.save(ckpt)
        assert err.value.code == "checkpoint-save-failed" and "injected fault" in str(err.value)
        assert siblings(ckpt) == ["afile", "ckpt"]            # no staging directory left
        verify_checkpoint(ckpt)
        assert piper.job.checkpoint.read_info(ckpt)["step"] == 0
        job.step(*BATCHES[1])                                 # the job still trains and saves
        job.save(ckpt)
        second = job.state_dict()
        assert piper.job.checkpoint.read_info(ckpt)["step"] == 2 and siblings(ckpt) == ["afile", "ckpt"]
        job.load(ckpt)
        torch.testing.assert_close(job.state_dict(), second, rtol=0, atol=0)
        # A flipped byte in a shard: refused before any worker reads, the job untouched.
        shard = ckpt / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
        job.step(*BATCHES[2])
        third = job.state_dict()
        with pytest.raises(piper.PiperError) as err:
            job.load(ckpt)
        assert err.value.code == "checkpoint-corrupt" and str(shard) in str(err.value)
        torch.testing.assert_close(job.state_dict(), third, rtol=0, atol=0)
        assert job.steps == 3
        job.step(*BATCHES[3])
    assert first.keys() == second.keys()


def test_crafted_checkpoints_run_nothing_on_the_workers_and_a_bad_shard_leaves_the_job_running(ray_cluster,
                                                                                                tmp_path):
    marker = tmp_path / "ran"
    with compile_job() as job:
        job.step(*BATCHES[0])
        job.save(tmp_path / "good")
        # A crafted index, read by the workers directly (job.load refuses it on the driver first).
        crafted = tmp_path / "crafted"
        shutil.copytree(tmp_path / "good", crafted)
        (crafted / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        with pytest.raises(piper.PiperError) as err:
            job.load(crafted)
        assert err.value.code == "not-a-checkpoint"
        results = job._get([a.load_checkpoint.remote(str(crafted), True, []) for a in job.actors], "load")
        assert all(r is not None and "UnsafeFile" in r["error"] and "posix.system" in r["error"] for r in results)
        # A crafted optimizer count (a non-tensor item the workers read), past the driver's checks.
        item = tmp_path / "item"
        shutil.copytree(tmp_path / "good", item)
        results = job._get([a.__ray_call__.remote(_save_crafted_count, str(item / "x"), str(marker))
                            for a in job.actors[:1]], "save")
        assert results == [None]
        results = job._get([a.__ray_call__.remote(_load_crafted_count, str(item / "x")) for a in job.actors[:1]],
                           "load")
        assert "UnsafeFile" in results[0]
        assert not marker.exists()
        # torch's own layout has no checksums: a damaged header fails on the workers, and the job still runs.
        torch_ckpt = tmp_path / "torch"
        _torch_checkpoint(torch_ckpt)
        with open(torch_ckpt / ".metadata", "rb") as f:
            where = next(info for index, info in pickle.load(f).storage_data.items() if index.fqn == "model.a.weight")
        shard = torch_ckpt / where.relative_path
        data = bytearray(shard.read_bytes())
        data[where.offset:where.offset + 4] = b"XXXX"      # a tensor's zip signature
        shard.write_bytes(bytes(data))
        verify_checkpoint(torch_ckpt)       # nothing to check it against
        with pytest.raises(piper.PiperError) as err:
            job.load(torch_ckpt)
        assert err.value.code == "checkpoint-corrupt" and "partly read" in str(err.value)
        job.load(tmp_path / "good")
        assert job.steps == 1
        job.step(*BATCHES[1])
    assert (tmp_path / "good" / MANIFEST).is_file()


def _save_crafted_count(worker, path: str, marker: str) -> None:
    """On a worker: a one-process DCP checkpoint whose optimizer count is a crafted object."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": {"state": {"a.weight": {"count": Payload(marker)}}}}, checkpoint_id=path, no_dist=True)


def _load_crafted_count(worker, path: str):
    """On a worker: read it with the workers' own reader and planner; the error's text."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from piper.runtime.state import checkpoint
    from piper.runtime.state import checkpoint_files

    state = {"optim": {"state": {"a.weight": {"count": None}}}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=checkpoint_files.Reader(path), planner=checkpoint.LoadPlanner(),
                     no_dist=True)
    except BaseException as exc:
        return repr(exc)
    return None


def _torch_checkpoint(path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(1)
    model = Other().double()
    opt = ADAMW(model.parameters())
    model(*BATCHES[0]).backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)


def test_a_worker_killed_mid_save_leaves_the_previous_checkpoint_loadable(ray_cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    with compile_job(worker_env={"PIPER_FAULT": "rank=1 do=kill action=save step=1"}) as job:
        job.step(*BATCHES[0])
        with pytest.raises(piper.PiperError):
            job.save(ckpt)               # a fresh path: nothing there afterwards
        assert not ckpt.exists()
    with compile_job(worker_env={"PIPER_FAULT": "rank=1 do=kill action=save step=2"}) as job:
        job.step(*BATCHES[0])
        job.save(ckpt)
        saved = job.state_dict()
        job.step(*BATCHES[1])
        with pytest.raises(piper.PiperError) as err:
            job.save(ckpt)               # rank 1 dies with its file written, before the index
        assert err.value.code in ("worker-died", "worker-failed")
    assert siblings(ckpt) == ["ckpt"]
    verify_checkpoint(ckpt)
    with compile_job() as job:
        assert job.load(ckpt)["step"] == 1
        torch.testing.assert_close(job.state_dict(), saved, rtol=0, atol=0)
        job.step(*BATCHES[1])
