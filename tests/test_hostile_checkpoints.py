"""Checkpoint folders that are not what they claim, checked without a job: special files in place of
`piper.json`, `.metadata` or a shard (for `verify_checkpoint`, `job.load` and `--resume`'s scan), a
shard of another checkpoint of the same model swapped in with its `piper.json` entry, a `.metadata`
left out of `piper.json`, and steps out of range."""
import json
import os
import shutil

import pytest

import piper
from benchmarks.fuzz_checkpoints import small_checkpoint
from piper.job import checkpoint
from piper.job.recovery import Checkpoints
from piper.runtime.state import checkpoint_files
from tests.helpers import raised

SHARD = "__0_0.distcp"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two checkpoints of the same model, other values, other ids."""
    root = tmp_path_factory.mktemp("saved")
    small_checkpoint(root / "a", seed=0)
    small_checkpoint(root / "b", seed=1)
    return root


@pytest.fixture
def ckpt(saved, tmp_path):
    shutil.copytree(saved / "a", tmp_path / "step-3")
    return tmp_path / "step-3"


def make_special(path, kind: str) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    else:                                   # a link to a good copy that lies outside the checkpoint
        outside = path.parent.parent / ("outside-" + path.name)
        shutil.copyfile(path.parent.parent / "keep" / path.name, outside)
        path.symlink_to(outside)


NEEDLE = {"fifo": "a pipe (FIFO), not a regular file", "dev_zero": "(a symbolic link to `/dev/zero`)",
          "folder": "a folder, not a regular file", "outside": "leads outside"}


@pytest.mark.parametrize("name", [checkpoint.MANIFEST, checkpoint.METADATA, SHARD])
@pytest.mark.parametrize("kind", sorted(NEEDLE))
def test_special_files_are_refused_by_verify_and_load_without_blocking(ckpt, name, kind):
    shutil.copytree(ckpt, ckpt.parent / "keep")
    make_special(ckpt / name, kind)
    err = raised(checkpoint.verify_checkpoint, ckpt)
    assert isinstance(err, piper.PiperError), err
    assert err.code == "unreadable-file" and NEEDLE[kind] in str(err) and name in str(err), str(err)

    class Job:                              # job.load checks on the driver before any worker reads
        steps = 0

        def _check_open(self):
            pass

    err = raised(checkpoint.load, Job(), ckpt)
    assert isinstance(err, piper.PiperError) and err.code == "unreadable-file", err
    assert Job.steps == 0


@pytest.mark.parametrize("name", [checkpoint.MANIFEST, checkpoint.METADATA])
def test_resume_passes_over_a_checkpoint_with_a_fifo_for_the_one_before(saved, tmp_path, name):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copytree(saved / "a", folder / "step-2")
    shutil.copytree(saved / "a", folder / "step-4")
    os.unlink(folder / "step-4" / name)
    os.mkfifo(folder / "step-4" / name)
    loaded, skipped = [], []

    class Job:
        def load(self, path):
            checkpoint.verify_checkpoint(path)
            loaded.append(os.path.basename(path))

    runs = Checkpoints(str(folder), 0, on_skip=lambda path, why: skipped.append((os.path.basename(path), why)))
    steps = []
    assert raised(lambda: steps.append(runs.restore(Job()))) is None
    assert steps == [2] and loaded == ["step-2"]
    assert skipped[0][0] == "step-4" and "a pipe (FIFO), not a regular file" in skipped[0][1]


# ---- one identity per checkpoint


def entry_copied(ckpt, other, name, *, keep_id: bool = False) -> None:
    """`name` taken from checkpoint `other` with its piper.json entry (its id rewritten to this one's
    with `keep_id`: what a hand edit would do)."""
    shutil.copyfile(other / name, ckpt / name)
    mine = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    theirs = json.loads((other / checkpoint.MANIFEST).read_text())
    mine["files"][name] = dict(theirs["files"][name])
    if keep_id:
        mine["files"][name]["checkpoint_id"] = mine["checkpoint_id"]
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(mine))


@pytest.mark.parametrize("keep_id", [False, True])
def test_a_shard_of_another_checkpoint_is_refused_even_with_its_entry(saved, ckpt, keep_id):
    checkpoint.verify_checkpoint(ckpt)
    entry_copied(ckpt, saved / "b", SHARD, keep_id=keep_id)
    with pytest.raises(piper.PiperError) as err:
        checkpoint.verify_checkpoint(ckpt)
    assert err.value.code == "checkpoint-corrupt" and "belongs to another checkpoint" in str(err.value)
    assert SHARD in str(err.value)


@pytest.mark.parametrize("keep_id", [False, True])
def test_a_metadata_of_another_checkpoint_is_refused_even_with_its_entry(saved, ckpt, keep_id):
    entry_copied(ckpt, saved / "b", checkpoint.METADATA, keep_id=keep_id)
    with pytest.raises(piper.PiperError) as err:
        checkpoint.verify_checkpoint(ckpt)
    assert err.value.code == "checkpoint-corrupt" and "belongs to another checkpoint" in str(err.value)
    assert checkpoint.METADATA in str(err.value)


def test_every_file_the_index_needs_must_be_listed(ckpt):
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    del manifest["files"][checkpoint.METADATA]
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(piper.PiperError) as err:
        checkpoint.verify_checkpoint(ckpt)
    assert err.value.code == "checkpoint-corrupt" and ".metadata has no checksum in piper.json" in str(err.value)


def test_an_id_stripped_from_the_manifest_is_refused(ckpt):
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    del manifest["checkpoint_id"]
    for entry in manifest["files"].values():
        del entry["checkpoint_id"]
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(piper.PiperError) as err:
        checkpoint.verify_checkpoint(ckpt)
    assert err.value.code == "checkpoint-corrupt" and "has no checkpoint id" in str(err.value)


def test_the_id_is_in_the_manifest_the_index_and_the_shard(ckpt):
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    identity = manifest["checkpoint_id"]
    assert {e["checkpoint_id"] for e in manifest["files"].values()} == {identity}
    assert checkpoint.read_metadata(ckpt).storage_meta.save_id == identity
    assert checkpoint.read_info(ckpt)["ids"] == {"0": identity}


def test_a_checkpoint_saved_before_ids_still_loads(ckpt):
    # The manifest and items of a checkpoint saved before the id (tests/test_checkpoint_safety.py's
    # `piper_like` writes one): no id anywhere, every file still checked by size and CRC-32.
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(ckpt)
    state = {"model": {"w": __import__("torch").ones(4)},
             "piper": {"format": 1, "step": 3, "strategy": "t", "mesh": {"dp": 1}, "checksums": "crc32"}}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=ckpt, no_dist=True)
    names = [n for n in os.listdir(ckpt) if n.endswith(".distcp") or n == ".metadata"]
    checkpoint._write_manifest(str(ckpt), checkpoint_files.checksums(ckpt, names))
    checkpoint.verify_checkpoint(ckpt)
    assert checkpoint.read_info(ckpt)["step"] == 3


# ---- the step


@pytest.mark.parametrize("key, value", [("step", -3), ("step", 10**30), ("step", 2**53), ("step", True),
                                        ("step", 1.5), ("data_position", -1), ("data_position", 10**30)])
def test_a_step_out_of_range_is_refused(tmp_path, key, value):
    small_checkpoint(tmp_path / "c", **{key: value})
    for call in (checkpoint.verify_checkpoint, checkpoint.read_info):
        with pytest.raises(piper.PiperError) as err:
            call(tmp_path / "c")
        assert err.value.code == "not-a-checkpoint", str(err.value)
        if type(value) is int:
            assert f"its `piper.{key}` is " in str(err.value) and "not a count of 0 to 2**53" in str(err.value)
    small_checkpoint(tmp_path / "ok", **{key: 2**53 - 1})
    checkpoint.verify_checkpoint(tmp_path / "ok")
