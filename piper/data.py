"""Data read by the workers: `piper.compile(..., data=DATASET, batch_size=B)` and `job.step()`.

    train = piper.data.TokenFile("train.bin", block_size=256)     # nanoGPT's .bin: uint16 tokens
    job = piper.compile(model, None, strategy=..., data=train, batch_size=64, shuffle=True, seed=0)
    loss = job.step()          # the next global batch, read by the workers themselves

DATASET is a `torch.utils.data.Dataset` of samples, each a tuple of tensors
(the arguments of forward). Global batch k is the samples at stream
positions `[k*B, (k+1)*B)`: position p is sample `p % len(DATASET)` of epoch
`p // len(DATASET)` in the dataset's order, or, with `shuffle=True`, in that
epoch's permutation (`torch.randperm` seeded with `seed + epoch`, the same on
every device). Each device reads only the rows of its place (`Reader`): its
data-parallel shard of every microbatch, and only the inputs its regions take
(under a pipeline the first stage the tokens, the last the targets); the
driver sends it the batch number alone.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .diagnostics import error


class TokenFile(torch.utils.data.Dataset):
    """A memory-mapped file of tokens (nanoGPT's `.bin`: raw `dtype` token ids, one after another)
    as a dataset of `(x, y)` blocks: sample i is tokens `[i*block_size, (i+1)*block_size)` and
    the same shifted by one as the targets, both int64. Opened on first use, so it pickles as its
    path: each worker maps the file itself and reads only the blocks it is asked for."""

    def __init__(self, path, block_size: int, dtype=np.uint16):
        self.path = os.path.abspath(os.fspath(path))
        self.block_size = int(block_size)
        self.dtype = np.dtype(dtype)
        if not os.path.isfile(self.path):
            raise error("file-not-found", f"token file {self.path} does not exist",
                        hint="pass a .bin of token ids (nanoGPT's prepare.py writes train.bin and val.bin)")
        if self.block_size < 1:
            raise error("bad-dataset", f"block_size={block_size} is not a positive number of tokens",
                        hint="pass the model's context length, e.g. block_size=256")
        self.tokens = os.path.getsize(self.path) // self.dtype.itemsize
        if len(self) < 1:
            raise error("bad-dataset", f"{self.path} holds {self.tokens} tokens, fewer than one block of "
                        f"{self.block_size} plus its target", hint="use a smaller block_size or a larger file")
        self._map = None

    def __len__(self) -> int:
        return (self.tokens - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = int(i) * self.block_size
        block = torch.from_numpy(self._map[start:start + self.block_size + 1].astype(np.int64))
        return block[:-1], block[1:]

    def __getstate__(self):
        return {**self.__dict__, "_map": None}

    def __repr__(self) -> str:
        return f"TokenFile({self.path!r}, block_size={self.block_size}, dtype={self.dtype.name})"


def positions(k: int, batch_size: int, size: int, shuffle: bool, seed: int, lo: int = 0, hi: int | None = None):
    """The dataset indices of rows `[lo, hi)` of global batch `k` (see the module's docstring).

        positions(1, 4, 6, False, 0) == [4, 5, 0, 1]      # batch 1 of 4 over 6 samples wraps into epoch 1
    """
    hi = batch_size if hi is None else hi
    out, perms = [], {}
    for p in range(k * batch_size + lo, k * batch_size + hi):
        epoch, i = divmod(p, size)
        if shuffle:
            if epoch not in perms:
                perms[epoch] = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
            i = int(perms[epoch][i])
        out.append(i)
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
