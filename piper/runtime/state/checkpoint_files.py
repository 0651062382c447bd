"""Checkpoint files read without running code, and written with a checksum per file: the
storage reader, writer and load planners every DCP call in Piper goes through, on the
driver and on every worker.

Reading. torch.distributed.checkpoint (DCP) keeps its index, `.metadata`, as a
pickle, and its non-tensor items (Piper's `piper.*` entries, an optimizer's plain
counts) as `torch.save` bytes read with `torch.load(weights_only=False)`: both run
whatever code a crafted file names. Here `.metadata` is read by `MetadataUnpickler`,
which admits only the classes DCP's own metadata is made of (the list below is what
real checkpoints hold: Piper's and torch's `get_state_dict` layout), and every
non-tensor item by `torch.load(weights_only=True)` (tensors already are). A file
naming anything else raises `UnsafeFile` before any of it is built.

Every file is opened through `piper.user_files`: a regular file inside the checkpoint's
folder (a FIFO would block the open, a link to `/dev/zero` fill the memory, a link out
of the folder read another's file), `.metadata` at most `MAX_METADATA_BYTES`.

Writing. `Writer` is DCP's `FileSystemWriter` that remembers the data files this
rank wrote, so `checksums` can record the size and CRC-32 of each (zlib's, about
2 GB/s: it catches every flipped byte and every burst of up to 32 bits; it is a
check against damage, not against someone who rewrites the file and its checksum).
Given the checkpoint's `identity`, it writes it into `.metadata` as DCP's `save_id`,
so the index names the checkpoint it belongs to (`piper.job.checkpoint` checks it).
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import zlib

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from ... import user_files
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

METADATA = ".metadata"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# Every global a `.metadata` pickle names, found by logging `find_class` over Piper's
# checkpoints and torch's get_state_dict ones (torch 2.13), and the path classes of other
# systems and Pythons. Each is a plain data class or constant: calling it builds data.
ALLOWED = {
    (_METADATA_MODULE, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),        # a layout by its name ("torch.strided")
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),  # Python 3.13's module
}
_CHUNK = 16 << 20            # bytes read at a time for a checksum
# DCP's index takes about 250 bytes a chunk (measured: 1,000 one-chunk tensors, a 245 KB
# `.metadata`); 4 GiB is 16 million chunks, a model of 2,000 tensors x 3 states x 1,024
# devices x 2-3 boxes each. A larger file is not an index Piper or torch wrote.
MAX_METADATA_BYTES = 4 << 30


class UnsafeFile(pickle.UnpicklingError):
    """A checkpoint file that names code or types a checkpoint does not hold."""


class MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` admitting only `ALLOWED` globals and torch's dtypes (and no persistent ids)."""

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format,
                                                                          torch.layout)):
            return getattr(torch, name)
        raise UnsafeFile(f"it names `{module}.{name}`, which is no part of a checkpoint's metadata")

    def persistent_load(self, pid):
        raise UnsafeFile("it holds a persistent reference, which no checkpoint's metadata has")


def load_metadata(stream) -> Metadata:
    """DCP's `Metadata` from an open `.metadata` file, running no code; `UnsafeFile` otherwise."""
    metadata = MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeFile(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def load_item(value: io.BytesIO):
    """A non-tensor checkpoint item (torch.save bytes) as plain data: tensors, numbers,
    strings, lists, tuples, dicts; `UnsafeFile` for anything else."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeFile(f"an item names something other than data: {str(exc).splitlines()[0]}") from None


class RegularFiles(FileSystem):
    """DCP's file system, opening every file it reads with `user_files.open_regular`: a regular
    file inside `folder`, opened without blocking."""

    def __init__(self, folder):
        super().__init__()
        self.folder = os.fspath(folder)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "r" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            fd = user_files.open_regular(path, inside=self.folder)
        except user_files.Refused as refused:
            raise refused.diagnostic(path, "the checkpoint file") from None
        with os.fdopen(fd, "rb") as stream:
            yield stream


class Reader(FileSystemReader):
    """DCP's `FileSystemReader` reading `.metadata` with `MetadataUnpickler` and every file through
    `user_files` (`RegularFiles`). DCP turns a failed read into an AssertionError of text:
    `refused` keeps the `UnsafeFile` or the PiperError (`load`)."""

    refused: Exception | None = None

    def __init__(self, path, *args, **kwargs):
        super().__init__(path, *args, **kwargs)
        self.fs = RegularFiles(self.path)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        from ...diagnostics import PiperError

        try:
            data = user_files.read_bytes(self._get_metadata_path(kwargs.get("rank")), limit=MAX_METADATA_BYTES,
                                         what="the checkpoint index", inside=self.path)
            metadata = load_metadata(io.BytesIO(data))
        except (UnsafeFile, PiperError) as exc:
            # DCP then asks for the rank's own index (`__0.metadata`), which is seldom there: keep the first.
            if self.refused is None and getattr(exc, "code", None) != "file-not-found":
                self.refused = exc
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load(state: dict, path, planner, **kwargs) -> None:
    """`dcp.load(state, ...)` from directory `path` with `Reader` and `planner` (one of those
    below, or a subclass), raising the `UnsafeFile` itself when `.metadata` was refused."""
    import torch.distributed.checkpoint as dcp

    reader = Reader(path)
    try:
        dcp.load(state, storage_reader=reader, planner=planner, **kwargs)
    except BaseException:
        if reader.refused is not None:
            raise reader.refused from None
        raise


class SafeItems:
    """Mixed into a DCP load planner: non-tensor items read by `load_item`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        item = load_item(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], item)
        else:
            self.state_dict[read_item.dest_index.fqn] = item


class LoadPlanner(SafeItems, DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items as data only."""


class WholeLoadPlanner(SafeItems, _EmptyStateDictLoadPlanner):
    """DCP's planner for reading a whole checkpoint into an empty dict (what
    `dcp_to_torch_save` uses), reading non-tensor items as data only."""


class Writer(FileSystemWriter):
    """DCP's `FileSystemWriter` that keeps the names of the data files it wrote (`written`),
    calls `after_write()` once they are written (a test's injected fault) and, given an
    `identity`, writes it as the save's id into `.metadata` (`storage_meta.save_id`)."""

    def __init__(self, path, after_write=None, identity: str | None = None, **kwargs):
        super().__init__(path, **kwargs)
        self.written: list[str] = []
        self.after_write = after_write
        self.identity = identity
        self.reset()

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)          # DCP calls it at each save, drawing a new save_id
        if getattr(self, "identity", None):
            self.save_id = self.identity

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written = sorted({r.storage_data.relative_path for r in future.value()})
        if self.after_write is not None:
            self.after_write()
        return future


def checksum(path, inside=None) -> dict:
    """{"bytes": size, "crc32": CRC-32} of the regular file at `path` (inside the folder `inside`,
    where given), read in 16 MiB pieces (`user_files.chunks`)."""
    crc, size = 0, 0
    for block in user_files.chunks(path, what="the checkpoint file", inside=inside, size=_CHUNK):
        crc = zlib.crc32(block, crc)
        size += len(block)
    return {"bytes": size, "crc32": crc}


def checksums(directory, names) -> dict[str, dict]:
    """`checksum` of each of `names` in `directory`."""
    return {name: checksum(os.path.join(directory, name), inside=directory) for name in names}
