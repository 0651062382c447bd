"""Data read by the workers: `piper.compile(..., data=DATASET, batch_size=B)` and `job.step()`.

    train = piper.data.TokenFile("train.bin", block_size=256)     # nanoGPT's .bin: uint16 tokens
    job = piper.compile(model, None, strategy=..., data=train, batch_size=64, shuffle=True, seed=0)
    loss = job.step()          # the next global batch, read by the workers themselves

DATASET is a `torch.utils.data.Dataset` of samples, each a tuple of tensors
(the arguments of forward). Global batch k is the samples at stream
positions `[k*B, (k+1)*B)`: position p is sample `p % len(DATASET)` of epoch
`p // len(DATASET)` in the dataset's order, or, with `shuffle=True`, in that
epoch's permutation of the dataset under `seed` (`piper.data_order`: computed
per sample, the same on every device, nothing held between steps). Each device
reads only the rows of its place (`Reader`): its data-parallel shard of every microbatch, and only the inputs its regions take
(under a pipeline the first stage the tokens, the last the targets); the
driver sends it the batch number alone.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import numpy as np
import torch

from .data_order import shuffled
from .diagnostics import clip, error
from .user_files import Refused, check_path, open_regular


class TokenFile(torch.utils.data.Dataset):
    """A file of tokens (nanoGPT's `.bin`: raw `dtype` token ids, one after another) as a dataset
    of `(x, y)` blocks: sample i is tokens `[i*block_size, (i+1)*block_size)` and the same shifted
    by one as the targets, both int64. Opened on first use, so it pickles as its path: each
    worker opens the file itself and reads only the blocks it is asked for.

    Every block read is checked: an id outside `[0, vocab_size)` is `token-out-of-range` naming
    the file and the id's position (`piper.compile(data=...)` sets `vocab_size` from the model
    where it is not given: `vocabulary_of`), and a file that shrank since it was opened is
    `token-file-shrank`. Blocks are read with `pread`, not a memory map: a map of a file cut
    short reads its last page's remainder as zeros and dies of SIGBUS past it."""

    def __init__(self, path, block_size: int, dtype=np.uint16, vocab_size: int | None = None):
        self.path = os.path.abspath(os.fspath(path))
        self.block_size = int(block_size)
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            self.dtype = None
        if self.dtype is None or self.dtype.kind not in "iu":
            raise error("bad-dataset", f"dtype={dtype!r} is not a whole-number type of token ids",
                        hint="pass the dtype the file was written in: np.uint16 (nanoGPT), np.uint32 or np.int32")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size < 1):
            raise error("bad-dataset", f"vocab_size={vocab_size!r} is not a positive number of token ids",
                        hint="pass the model's vocabulary size (its embedding's num_embeddings), or leave it out")
        self.vocab_size = vocab_size
        try:
            size = check_path(self.path).st_size
        except Refused as refused:
            hint = NANOGPT_HINT if refused.code == "file-not-found" else refused.hint
            raise error(refused.code, f"token file `{clip(self.path, 120)}` {refused.reason}", hint=hint) from None
        if self.block_size < 1:
            raise error("bad-dataset", f"block_size={block_size} is not a positive number of tokens",
                        hint="pass the model's context length, e.g. block_size=256")
        self.tokens = size // self.dtype.itemsize
        if len(self) < 1:
            raise error("bad-dataset", f"{self.path} holds {self.tokens} tokens, fewer than one block of "
                        f"{self.block_size} plus its target", hint="use a smaller block_size or a larger file")
        self._fd = None

    def __len__(self) -> int:
        return (self.tokens - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(i) * self.block_size
        raw = self._read(start, self.block_size + 1)
        self._check_ids(raw, start)
        block = torch.from_numpy(raw.astype(np.int64))
        return block[:-1], block[1:]

    def _read(self, start: int, count: int) -> np.ndarray:
        """Tokens `[start, start + count)`, read from the file as it is now."""
        if self._fd is None:
            try:
                self._fd = open_regular(self.path)
            except Refused as refused:
                raise error(refused.code, f"token file `{clip(self.path, 120)}` {refused.reason}",
                            hint=refused.hint) from None
        size, offset = count * self.dtype.itemsize, start * self.dtype.itemsize
        parts, got = [], 0
        while got < size:
            piece = os.pread(self._fd, size - got, offset + got)
            if not piece:
                raise self._shrank(start, count)
            parts.append(piece)
            got += len(piece)
        return np.frombuffer(b"".join(parts), dtype=self.dtype)

    def _shrank(self, start: int, count: int):
        now = os.fstat(self._fd).st_size
        return error("token-file-shrank", f"token file `{clip(self.path, 120)}` shrank while it was read: it held "
                     f"{self.tokens:,} tokens ({self.tokens * self.dtype.itemsize:,} bytes) when opened and holds "
                     f"{now:,} bytes now, so tokens {start:,} to {start + count - 1:,} are gone",
                     notes=("a memory map of it would read the cut page as zeros, then die of SIGBUS",),
                     hint="do not truncate or rewrite a token file a job reads: write the new one under another "
                          "name and rename it into place (a running job keeps reading the file it opened), "
                          "then start again from the last checkpoint (piper run --resume)")

    def _check_ids(self, raw: np.ndarray, start: int) -> None:
        """`token-out-of-range` for the first id in `raw` (tokens from `start`) outside the vocabulary."""
        vocab = self.vocab_size
        signed = self.dtype.kind == "i"
        if not signed and (vocab is None or vocab > np.iinfo(self.dtype).max):
            return                        # every value of the dtype is an id of the vocabulary
        low, high = raw.min(), raw.max()
        if (not signed or low >= 0) and (vocab is None or high < vocab):
            return
        bad = (raw < 0) if vocab is None else ((raw < 0) | (raw >= vocab))
        j = int(np.argmax(bad))
        where = start + j
        within = (f"the model's vocabulary of {vocab:,} (ids 0 to {vocab - 1:,})" if vocab is not None
                  else "any vocabulary (ids are 0 or more)")
        raise error("token-out-of-range", f"token file `{clip(self.path, 120)}` holds token id {int(raw[j]):,} "
                    f"at position {where:,} (byte {where * self.dtype.itemsize:,}), outside {within}",
                    notes=("under `shard vocab` such an id would look up no row on any device and train as zeros; "
                           "on one device it raises IndexError",),
                    hint=f"check that the file was written with the model's tokenizer and read in its own dtype "
                         f"(TokenFile(path, block_size, dtype=...), here {self.dtype.name}), or train the model "
                         "whose vocabulary the file was made for")

    def with_vocabulary(self, vocab_size: int) -> "TokenFile":
        """This file checked against `vocab_size` ids (the smaller of it and its own, where it has one)."""
        out = copy.copy(self)
        out._fd = None
        out.vocab_size = vocab_size if self.vocab_size is None else min(self.vocab_size, vocab_size)
        return out

    def __getstate__(self):
        return {**self.__dict__, "_fd": None}

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            self._fd = None
            os.close(fd)

    def __repr__(self) -> str:
        vocab = f", vocab_size={self.vocab_size}" if self.vocab_size is not None else ""
        return f"TokenFile({self.path!r}, block_size={self.block_size}, dtype={self.dtype.name}{vocab})"


NANOGPT_HINT = "pass a .bin of token ids (nanoGPT's prepare.py writes train.bin and val.bin)"


def vocabulary_of(model: torch.nn.Module) -> int | None:
    """The number of token ids `model` can look up: its input embedding's rows (Hugging Face's
    `get_input_embeddings()`), else the largest `nn.Embedding`'s (a position table smaller than
    the vocabulary never makes a good id look bad); None without one."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            found = get()
        except (NotImplementedError, AttributeError):
            found = None
        if isinstance(found, torch.nn.Embedding):
            return found.num_embeddings
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return max(sizes) if sizes else None


def for_model(dataset, model: torch.nn.Module):
    """`dataset` as `piper.compile` reads it for `model`: a `TokenFile` checked against the model's
    vocabulary (`vocabulary_of`); any other dataset as it is."""
    if isinstance(dataset, TokenFile):
        vocab = vocabulary_of(model)
        if vocab is not None:
            return dataset.with_vocabulary(vocab)
    return dataset


def positions(k: int, batch_size: int, size: int, shuffle: bool, seed: int, lo: int = 0, hi: int | None = None):
    """The dataset indices of rows `[lo, hi)` of global batch `k` (see the module's docstring).

        positions(1, 4, 6, False, 0) == [4, 5, 0, 1]      # batch 1 of 4 over 6 samples wraps into epoch 1
    """
    hi = batch_size if hi is None else hi
    stream = range(k * batch_size + lo, k * batch_size + hi)
    out = [p % size for p in stream]
    if shuffle:         # each epoch's rows moved by that epoch's permutation (`data_order`)
        epochs = [p // size for p in stream]
        for epoch in sorted(set(epochs)):
            rows = [r for r, e in enumerate(epochs) if e == epoch]
            moved = shuffled([out[r] for r in rows], size, seed, epoch).tolist()
            for r, i in zip(rows, moved):
                out[r] = i
    return out


def collate(dataset, indices, inputs=None) -> tuple[torch.Tensor, ...]:
    """The samples `indices` stacked per input (only `inputs`, by position, when given; the others None)."""
    samples = [dataset[i] for i in indices]
    count = len(samples[0])
    return tuple(torch.stack([s[j] for s in samples]) if inputs is None or j in inputs else None
                 for j in range(count))


@dataclass
class Reader:
    """What one device reads of each global batch: rows `[start, start + microbatches * per)`
    (its data-parallel shard), cut into microbatches of `per`, of the inputs `wanted`."""

    dataset: object
    batch_size: int
    shuffle: bool
    seed: int
    start: int
    per: int
    microbatches: int
    wanted: tuple[int, ...]
    dtype: torch.dtype | None = None       # floating-point inputs cast to the compute dtype

    def batch(self, k: int) -> dict[int, list[torch.Tensor]]:
        """The payload `job.step(batch)` would have sent this device for global batch `k`."""
        if not self.wanted:
            return {}
        stop = self.start + self.microbatches * self.per
        rows = positions(k, self.batch_size, len(self.dataset), self.shuffle, self.seed, self.start, stop)
        stacked = collate(self.dataset, rows, set(self.wanted))
        out = {}
        for i in self.wanted:
            x = stacked[i]
            if self.dtype is not None and x.is_floating_point():
                x = x.to(self.dtype)
            out[i] = [x[m * self.per:(m + 1) * self.per].clone() for m in range(self.microbatches)]
        return out


def check_dataset(dataset, batch_size, forward, what: str = "data") -> None:
    """bad-dataset unless `dataset` has at least `batch_size` samples, each a tuple of tensors
    that `forward` takes as its arguments, all of the first sample's shapes and dtypes."""
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise error("bad-dataset", f"{what}= is a {type(dataset).__name__}, not a dataset with len() and [i]",
                    hint="pass a torch.utils.data.Dataset of samples, e.g. TensorDataset(x, y) or "
                         "piper.data.TokenFile(path, block_size)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise error("bad-dataset", f"batch_size={batch_size!r} is not a positive number of samples",
                    hint=f"pass batch_size=B with {what}=: the samples of one global batch")
    if len(dataset) < batch_size:
        raise error("bad-dataset", f"{what}= holds {len(dataset)} sample(s), fewer than one batch of {batch_size}",
                    hint="use a smaller batch_size or a larger dataset")
    first = dataset[0]
    if not isinstance(first, (tuple, list)) or not first or not all(isinstance(t, torch.Tensor) for t in first):
        kinds = type(first).__name__ if not isinstance(first, (tuple, list)) else \
            "(" + ", ".join(type(t).__name__ for t in first) + ")"
        raise error("bad-dataset", f"a sample of {what}= is {kinds}, not a tuple of tensors",
                    hint="each sample holds forward's arguments as tensors, e.g. (tokens, targets)")
    import inspect

    try:
        inspect.signature(forward).bind(*first)
    except TypeError as exc:
        raise error("bad-dataset", f"a sample of {what}= holds {len(first)} tensor(s), which forward does not "
                    f"take as its arguments ({exc})",
                    hint="make each sample the tuple of forward's arguments (inputs, then targets)") from None
    except ValueError:
        pass
    last = dataset[len(dataset) - 1]
    if len(last) != len(first) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(first, last)):
        raise error("bad-dataset", f"the samples of {what}= differ in shape or dtype (sample 0: "
                    + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in first) + f"; sample {len(dataset) - 1}: "
                    + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in last) + ")",
                    hint="every sample must have the same shapes: pad or cut sequences to one length")


@dataclass(frozen=True)
class DataOptions:
    """`data=`, `batch_size=`, `shuffle=`, `seed=` of `piper.compile`."""

    dataset: object
    batch_size: int
    shuffle: bool = False
    seed: int = 0

    def example(self) -> tuple[torch.Tensor, ...]:
        """Global batch 0: the example inputs capture traces."""
        return collate(self.dataset, positions(0, self.batch_size, len(self.dataset), self.shuffle, self.seed))
