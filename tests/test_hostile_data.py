"""Hostile training data (issue 42, items 2, 10 and 11): token ids outside the model's vocabulary
are an error naming the file, the position and the vocabulary, and under `shard vocab` (any tp)
the embedding and the loss raise for them as one device's torch does; a token file cut short
while a job reads it is an error naming the file, never zeros or SIGBUS; `shuffle=True` builds no
permutation of the whole dataset, and its order is the same in every process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import piper
from examples.llama_tp import batches, make_model, tensor_parallel
from piper import data_order, tensor_ops
from piper.cli import main
from piper.data import Reader, TokenFile, for_model, positions, vocabulary_of
from piper.diagnostics import PiperError
from piper.frontend.tensor_parallel import TensorPlan, _vocab_embedding_forward

REPO = Path(__file__).resolve().parent.parent
VOCAB = 64
BLOCK = 8


def write_tokens(path, tokens, dtype=np.uint16) -> Path:
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def good_tokens(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, count)


def raises(code: str, fn, *args, **kwargs) -> str:
    with pytest.raises(PiperError) as info:
        fn(*args, **kwargs)
    assert info.value.code == code, str(info.value)
    return str(info.value)


# -- item 2: ids outside the vocabulary, where the data is read ---------------------------------

def test_a_token_file_names_the_position_of_an_id_outside_the_vocabulary(tmp_path):
    tokens = good_tokens(200)
    tokens[120] = 60_000                            # block 15's first input and block 14's last target
    path = write_tokens(tmp_path / "train.bin", tokens)
    data = TokenFile(path, BLOCK, vocab_size=VOCAB)
    assert data[13][0].max() < VOCAB                # blocks before it read as they are
    message = raises("token-out-of-range", data.__getitem__, 15)
    assert str(path) in message and "60,000" in message and "position 120 " in message
    assert "byte 240" in message and "vocabulary of 64" in message
    assert "position 120 " in raises("token-out-of-range", data.__getitem__, 14)


def test_a_signed_token_file_refuses_negative_ids_and_a_float_dtype_is_refused(tmp_path):
    tokens = good_tokens(50).astype(np.int32)
    tokens[7] = -3
    path = write_tokens(tmp_path / "train.bin", tokens, np.int32)
    message = raises("token-out-of-range", TokenFile(path, BLOCK, dtype=np.int32).__getitem__, 0)
    assert "-3" in message and "position 7 " in message
    raises("bad-dataset", TokenFile, path, BLOCK, dtype=np.float32)
    raises("bad-dataset", TokenFile, path, BLOCK, vocab_size=0)


def test_compile_checks_a_token_file_against_the_models_vocabulary(tmp_path):
    path = write_tokens(tmp_path / "train.bin", good_tokens(100))
    model = make_model(stages=1, vocab=VOCAB, dtype=torch.float32)
    bound = for_model(TokenFile(path, BLOCK), model)
    assert bound.vocab_size == VOCAB == vocabulary_of(model)
    assert for_model(TokenFile(path, BLOCK, vocab_size=50), model).vocab_size == 50    # the smaller one

    class Positions(nn.Module):              # a position table larger than the vocabulary
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(10, 4), nn.Embedding(300, 4)

    class Hub(Positions):                    # Hugging Face's way of naming the token embedding
        def get_input_embeddings(self):
            return self.tok
    assert vocabulary_of(Positions()) == 300 and vocabulary_of(Hub()) == 10
    assert vocabulary_of(nn.Linear(2, 2)) is None
    # A bad id in the first block is found on the driver, before any worker starts.
    tokens = good_tokens(100)
    tokens[3] = 1000
    bad = write_tokens(tmp_path / "bad.bin", tokens)
    message = raises("token-out-of-range", piper.compile, model, None, data=TokenFile(bad, BLOCK), batch_size=2,
                     progress=False)
    assert str(bad) in message and "position 3 " in message


# -- item 2: the vocab-parallel embedding and loss, called directly -----------------------------

def test_the_vocab_parallel_loss_raises_for_a_target_outside_the_vocabulary():
    logits = torch.randn(6, VOCAB, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, VOCAB, (6,))
    target[2] = -100                                     # ignore_index: skipped, not an error
    loss = tensor_ops.vocab_cross_entropy(logits, target)
    torch.testing.assert_close(loss, nn.functional.cross_entropy(logits, target), rtol=0, atol=1e-12)
    for bad in (VOCAB, 60_000, -1):
        target[4] = bad
        message = raises("token-out-of-range", tensor_ops.vocab_cross_entropy, logits, target)
        assert "target" in message and "vocabulary of 64" in message
    # Inside a worker's step the count is looked at once the step's losses are read.
    with tensor_ops.deferred_vocab_checks() as checks:
        tensor_ops.vocab_cross_entropy(logits, target)
    raises("token-out-of-range", checks.check)


def test_the_vocab_parallel_embedding_raises_for_an_id_outside_the_vocabulary():
    embedding = nn.Embedding(VOCAB, 4)
    embedding._piper_tp = TensorPlan("tp", 1, ())
    ids = torch.randint(0, VOCAB, (2, 5))
    torch.testing.assert_close(_vocab_embedding_forward(embedding, ids), embedding(ids))
    ids[1, 3] = 60_000
    message = raises("token-out-of-range", _vocab_embedding_forward, embedding, ids)
    assert "token id" in message and "vocabulary of 64" in message
    # A shard of two: its rows are half of the vocabulary, whose ids go on to 2 * 64.
    from piper.tensor_context import alone

    embedding._piper_tp = TensorPlan("tp", 2, ())
    ids[1, 3] = 2 * VOCAB - 1
    with alone(2):
        _vocab_embedding_forward(embedding, ids)
        ids[1, 3] = 2 * VOCAB
        raises("token-out-of-range", _vocab_embedding_forward, embedding, ids)


# -- item 2: through the workers, under `shard vocab` at tp=1 and tp=2 ---------------------------

def _vocab_plan():
    @piper.strategy
    def plan(s):
        tensor_parallel(s, vocab=True)
    return plan


@pytest.mark.usefixtures("ray_cluster")
def test_a_token_file_with_an_id_outside_the_vocabulary_stops_training_under_shard_vocab_at_tp1(tmp_path):
    tokens = good_tokens(400)
    tokens[5 * BLOCK + 2] = 60_000                  # in block 5: neither the first nor the last block
    path = write_tokens(tmp_path / "train.bin", tokens)
    model = make_model(stages=1, vocab=VOCAB, dtype=torch.float32)
    job = piper.compile(model, None, _vocab_plan(), {"tp": 1}, data=TokenFile(path, BLOCK), batch_size=2,
                        progress=False)
    try:
        job.step(), job.step()                           # blocks 0-3
        message = raises("token-out-of-range", job.step)  # blocks 4-5: read by the worker
    finally:
        job.close()
    assert str(path) in message and f"position {5 * BLOCK + 2} " in message and "vocabulary of 64" in message


@pytest.mark.usefixtures("ray_cluster")
def test_piper_run_data_with_an_id_outside_the_vocabulary_under_shard_vocab_at_tp2(tmp_path, capsys):
    tokens = good_tokens(400)
    tokens[9 * BLOCK] = 60_000
    path = write_tokens(tmp_path / "train.bin", tokens)
    (tmp_path / "model.py").write_text(
        "import torch\nfrom examples.llama_tp import make_model\n\n\n"
        f"def model():\n    return make_model(stages=1, vocab={VOCAB}, dtype=torch.float32)\n")
    (tmp_path / "job.pps").write_text(
        'mesh tp=2\nshard columns of "blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.mlp.gate", '
        '"blocks.*.mlp.up" over tp\nshard rows of "blocks.*.attn.o", "blocks.*.mlp.down" over tp\n'
        'shard vocab of "embed", "head" over tp\n')
    status = main(["run", str(tmp_path / "job.pps"), "--model", f"{tmp_path / 'model.py'}:model", "--data",
                   str(path), "--block-size", str(BLOCK), "--batch-size", "2", "--steps", "8"])
    err = " ".join(capsys.readouterr().err.split())
    assert status == 1 and "token-out-of-range" in err
    assert "train.bin" in err and f"position {9 * BLOCK:,}" in err and "vocabulary of 64" in err


@pytest.mark.usefixtures("ray_cluster")
def test_a_batch_with_an_id_outside_the_vocabulary_raises_from_the_workers_at_tp2():
    """`job.step(x, y)`: no token file to name; the embedding's and the loss's counts raise on
    the workers once the step's losses are read, and the driver reports it by name."""
    model = make_model(stages=1, vocab=VOCAB, dtype=torch.float32)
    (x, y), = batches(count=1, batch=4, vocab=VOCAB)
    job = piper.compile(model, (x, y), _vocab_plan(), {"tp": 2}, progress=False)
    try:
        job.step(x, y)
        y = y.clone()
        y[1, 2] = VOCAB
        message = raises("token-out-of-range", job.step, x, y)
    finally:
        job.close()
    assert "target" in message and "vocabulary of 64" in message


# -- item 10: a token file cut short while it is read -------------------------------------------

_READ_AFTER_TRUNCATE = """
import os, sys
from piper.data import TokenFile
from piper.diagnostics import PiperError
data = TokenFile(sys.argv[1], {block})
data[0]                                   # opened (a map, before)
os.truncate(sys.argv[1], int(sys.argv[2]))
try:
    x, y = data[int(sys.argv[3])]
    print("read", int(x.abs().sum()), int(y.abs().sum()))
except PiperError as exc:
    print(exc.code, exc)
"""


@pytest.mark.parametrize("cut", [4096, 4096 + 100], ids=["past-the-end", "partial-page"])
def test_a_token_file_cut_short_is_an_error_naming_it_not_zeros_or_sigbus(tmp_path, cut):
    """In a process of its own: a memory map dies of SIGBUS past the end (the first case) and
    reads zeros in the cut page's remainder (the second)."""
    path = write_tokens(tmp_path / "train.bin", np.random.default_rng(0).integers(1, VOCAB, 8192))
    block = (cut // 2) // BLOCK + 1          # a block past the new end (its first token is there, in the second)
    run = subprocess.run([sys.executable, "-c", _READ_AFTER_TRUNCATE.format(block=BLOCK), str(path), str(cut),
                          str(block)], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    out = " ".join(run.stdout.split())
    assert out.startswith("token-file-shrank"), out
    assert str(path) in out and "16,384 bytes" in out and f"{cut:,} bytes now" in out


@pytest.mark.usefixtures("ray_cluster")
def test_a_token_file_truncated_between_steps_stops_the_job_naming_it(tmp_path):
    path = write_tokens(tmp_path / "train.bin", good_tokens(8192))
    model = make_model(stages=1, vocab=VOCAB, dtype=torch.float32)
    job = piper.compile(model, None, None, None, data=TokenFile(path, BLOCK), batch_size=4, progress=False)
    try:
        job.step()
        os.truncate(path, 4096)                      # blocks 256 on are gone
        job.data_position = 70                       # blocks 280-283
        message = raises("token-file-shrank", job.step)
    finally:
        job.close()
    assert str(path) in message and "4,096 bytes now" in message


# -- item 11: the shuffled order -------------------------------------------------------------

def test_shuffled_positions_build_no_permutation_of_the_dataset(monkeypatch):
    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a) or real(*a, **k))
    size = 10 ** 6
    rows = [positions(k, 64, size, True, 3) for k in range(40)]
    assert calls == []
    assert all(0 <= i < size for r in rows for i in r) and len({i for r in rows for i in r}) == 40 * 64
    # A dataset of 10^15 samples costs what a small one does.
    huge = positions(7, 64, 10 ** 15, True, 0)
    assert len(set(huge)) == 64 and all(0 <= i < 10 ** 15 for i in huge)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, 100, 1001])
def test_each_epoch_is_a_permutation_of_the_dataset_of_its_own(size):
    orders = {}
    for seed in (0, 1, -5):
        for epoch in range(3):
            order = positions(epoch, size, size, True, seed)      # batch `epoch` is that whole epoch
            assert sorted(order) == list(range(size))
            orders[seed, epoch] = order
    if size >= 7:
        assert len({tuple(o) for o in orders.values()}) == len(orders)   # each seed and epoch its own order


def test_every_device_and_process_reads_the_same_order():
    """Readers of disjoint rows make up the whole batch, in any process, whatever was read before."""
    class Index(torch.utils.data.Dataset):
        def __len__(self):
            return 1000

        def __getitem__(self, i):
            return (torch.tensor([i]),)
    whole = [positions(k, 48, 1000, True, 11) for k in range(30)]
    for k in (0, 20, 29):
        parts = [Reader(Index(), 48, True, 11, start, 4, 3, (0,)).batch(k)[0] for start in range(0, 48, 12)]
        assert [int(t) for part in parts for mb in part for t in mb.flatten()] == whole[k]
    fresh = subprocess.run([sys.executable, "-c", "from piper.data import positions; "
                            "print([positions(k, 48, 1000, True, 11) for k in (0, 20, 29)])"],
                           capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONHASHSEED": "123"})
    assert fresh.stdout.strip() == str([whole[0], whole[20], whole[29]])


def test_the_order_of_a_seed_is_pinned():
    """The order a seed gives is part of what a checkpoint's `data_position` means: a resumed run
    reads on in it. Changing it changes which samples a resumed run of an older version reads."""
    assert positions(0, 10, 10, True, 0) == data_order.shuffled(np.arange(10), 10, 0, 0).tolist() \
        == [5, 4, 9, 6, 8, 2, 7, 3, 1, 0]
