"""Checkpoint files read as data only, verified by checksum, replaced atomically: the reading,
checking and renaming without a job (tests/test_checkpoint_atomic.py runs them in one)."""
import os
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import piper
from piper.job import checkpoint
from piper.runtime.state import checkpoint_files


class Payload:
    """Unpickled, it runs a shell command that creates `marker`: what a crafted file does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def dcp_save(state, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def piper_like(path, **piper_items):
    """A checkpoint with Piper's layout and manifest, written from this process."""
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(64, 32, dtype=torch.float64), "b": torch.randn(32)},
             "optim": {"state": {"w": {"exp_avg": torch.randn(64, 32, dtype=torch.float64),
                                       "step": torch.tensor(3.0)}}},
             "piper": {"format": 1, "step": 3, "strategy": "test", "mesh": {"dp": 1}, "checksums": "crc32",
                       **piper_items}}
    dcp_save(state, path)
    names = [n for n in os.listdir(path) if n.endswith(".distcp") or n == ".metadata"]
    checkpoint._write_manifest(str(path), checkpoint_files.checksums(path, names))
    return state


def test_a_crafted_metadata_runs_nothing_on_driver_or_worker_path(tmp_path):
    marker = tmp_path / "ran"
    crafted = pickle.dumps(Payload(marker))
    pickle.loads(crafted)                    # live: plain unpickling runs it (as torch's reader does)
    assert marker.exists()
    marker.unlink()
    path = tmp_path / "ckpt"
    piper_like(path)
    (path / ".metadata").write_bytes(crafted)
    (path / "__0.metadata").write_bytes(crafted)     # DCP falls back to a rank's own index
    for attempt in (checkpoint.verify_checkpoint, checkpoint.read_metadata, checkpoint.read_info,
                    lambda p: checkpoint.to_torch_save(p, tmp_path / "out.pt")):
        with pytest.raises(piper.PiperError) as err:
            attempt(path)
        assert err.value.code == "not-a-checkpoint"
        assert "os.system" in str(err.value) or "posix.system" in str(err.value)
        assert "nothing in it was run" in str(err.value)
    # What every worker reads with: the same reader, whatever rank's index it asks for.
    for rank in (None, 0):
        with pytest.raises(checkpoint_files.UnsafeFile):
            checkpoint_files.Reader(path).read_metadata(rank=rank)
    assert not marker.exists()


def test_a_crafted_piper_item_runs_nothing(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    marker = tmp_path / "ran"
    path = tmp_path / "ckpt"
    piper_like(path, strategy=Payload(marker))
    dcp_to_torch_save(path, tmp_path / "torch.pt")      # live: torch's converter runs it
    assert marker.exists()
    marker.unlink()
    for attempt in (checkpoint.verify_checkpoint, checkpoint.read_info,
                    lambda p: checkpoint.to_torch_save(p, tmp_path / "out.pt")):
        with pytest.raises(piper.PiperError) as err:
            attempt(path)
        assert err.value.code == "not-a-checkpoint" and "nothing in it was run" in str(err.value)
    # The workers' planner reads items the same way.
    import io

    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    buffer.seek(0)
    with pytest.raises(checkpoint_files.UnsafeFile):
        checkpoint_files.load_item(buffer)
    assert not marker.exists()


def test_real_metadata_reads_the_same_as_plain_pickle(tmp_path):
    # torch's get_state_dict layout (what FSDP2 saves), with an optimizer's param groups.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)).double()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
    dcp_save({"model": msd, "optim": osd}, tmp_path / "torch")
    piper_like(tmp_path / "piper")
    for name in ("torch", "piper"):
        with open(tmp_path / name / ".metadata", "rb") as f:
            plain = pickle.load(f)
        ours = checkpoint.read_metadata(tmp_path / name)
        assert ours.state_dict_metadata == plain.state_dict_metadata
        assert ours.storage_data == plain.storage_data and ours.planner_data == plain.planner_data
        checkpoint.verify_checkpoint(tmp_path / name)
    assert checkpoint.read_info(tmp_path / "torch")["step"] == 1
    checkpoint.to_torch_save(tmp_path / "torch", tmp_path / "torch.pt")
    whole = torch.load(tmp_path / "torch.pt", weights_only=True)
    torch.testing.assert_close(whole["model"], model.state_dict(), rtol=0, atol=0)
    # The same file torch's own converter writes, for a checkpoint one trusts.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint.to_torch_save(tmp_path / "piper", tmp_path / "ours.pt")
    dcp_to_torch_save(tmp_path / "piper", tmp_path / "theirs.pt")
    ours, theirs = (torch.load(tmp_path / n, weights_only=True) for n in ("ours.pt", "theirs.pt"))
    assert ours["piper"] == theirs["piper"] and ours["piper"]["step"] == 3
    torch.testing.assert_close({k: v for k, v in ours.items() if k != "piper"},
                               {k: v for k, v in theirs.items() if k != "piper"}, rtol=0, atol=0)


def test_an_index_naming_files_outside_the_checkpoint_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    piper_like(path)
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(piper.PiperError) as err:
        checkpoint.verify_checkpoint(path)
    assert err.value.code == "not-a-checkpoint" and "outside the checkpoint directory" in str(err.value)


def test_every_flipped_byte_of_a_shard_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "ckpt"
    piper_like(path)
    checkpoint.verify_checkpoint(path)
    (shard,) = [p for p in path.iterdir() if p.suffix == ".distcp"]
    data = bytearray(shard.read_bytes())
    for at in range(0, len(data), max(1, len(data) // 64)):       # 64 places across the file
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        shard.write_bytes(bytes(flipped))
        with pytest.raises(piper.PiperError) as err:
            checkpoint.verify_checkpoint(path)
        assert err.value.code == "checkpoint-corrupt"
        assert str(shard) in str(err.value) and "does not match its checksum" in str(err.value)
    shard.write_bytes(bytes(data[:-10]))                         # cut short
    with pytest.raises(piper.PiperError) as err:
        checkpoint.verify_checkpoint(path)
    assert err.value.code == "checkpoint-corrupt" and str(shard) in str(err.value)
    shard.unlink()
    with pytest.raises(piper.PiperError) as err:
        checkpoint.verify_checkpoint(path)
    assert err.value.code == "checkpoint-corrupt" and "is missing" in str(err.value)
    shard.write_bytes(bytes(data))
    checkpoint.verify_checkpoint(path)
    # A checkpoint that says it has checksums, without its manifest.
    (path / checkpoint.MANIFEST).unlink()
    with pytest.raises(piper.PiperError) as err:
        checkpoint.verify_checkpoint(path)
    assert err.value.code == "checkpoint-corrupt" and "piper.json is missing" in str(err.value)
    (path / checkpoint.MANIFEST).write_text('{"checksums": "crc32", "files": {"x": 1}}')
    with pytest.raises(piper.PiperError) as err:
        checkpoint.verify_checkpoint(path)
    assert err.value.code == "not-a-checkpoint"


@pytest.mark.parametrize("exchange", [True, False])
def test_a_directory_takes_the_place_of_another_whole(tmp_path, monkeypatch, exchange):
    if not exchange:             # a file system without RENAME_EXCHANGE: the old one is moved aside first
        monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
    target = tmp_path / "ckpt"
    piper_like(target)
    old = {p.name: p.read_bytes() for p in target.iterdir()}
    new = checkpoint._staging_dir(str(target))
    piper_like(new, step=4)
    checkpoint._swap_into_place(new, str(target))
    assert checkpoint.read_info(target)["step"] == 4
    assert {p.name: p.read_bytes() for p in (tmp_path / os.path.basename(new)).iterdir()} == old
    shutil.rmtree(new)
    # A stale staging directory (a save whose process was killed) goes with the next save.
    stale = checkpoint._staging_dir(str(target))
    fresh = checkpoint._staging_dir(str(target))
    assert not os.path.exists(stale) and os.path.isdir(fresh)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", os.path.basename(fresh)])


def test_a_directory_with_other_files_is_not_replaced(tmp_path):
    checkpoint._check_replaceable(str(tmp_path / "new"))
    (tmp_path / "empty").mkdir()
    checkpoint._check_replaceable(str(tmp_path / "empty"))
    piper_like(tmp_path / "ckpt")
    checkpoint._check_replaceable(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    for bad in (tmp_path / "ckpt", tmp_path / "ckpt" / "notes.txt"):
        with pytest.raises(piper.PiperError) as err:
            checkpoint._check_replaceable(str(bad))
        assert err.value.code == "checkpoint-save-failed"
    assert "notes.txt" in str(err.value) or "is a file" in str(err.value)
