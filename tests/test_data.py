"""Data read by the workers: `piper.compile(..., data=DATASET, batch_size=B)` and `job.step()`.
Each device reads its own rows; it trains exactly as `job.step(batch)` with the same global batches
and as one device (float64); the driver's bytes per step do not grow with the batch; a resumed run
reads what an uninterrupted one would; bad datasets are diagnostics."""
import copy
import functools

import numpy as np
import pytest
import torch

import piper
from examples.gpt import _corpus_tokens
from piper.data import Reader, TokenFile, collate, positions
from piper.dsl.script import load_strategy
from tests.helpers import assert_same
from tests.test_train import data_parallel, gpt

BLOCK = 16
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2)


def token_file(tmp_path, count=2000) -> TokenFile:
    tokens = _corpus_tokens()[1][:count].numpy().astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    return TokenFile(path, BLOCK)


def blocks(count=40) -> torch.utils.data.TensorDataset:
    """`count` (x, y) blocks of the corpus, in order."""
    tokens = _corpus_tokens()[1][:count * BLOCK + 1]
    return torch.utils.data.TensorDataset(tokens[:-1].view(count, BLOCK), tokens[1:].view(count, BLOCK))


def one_device(model, batches):
    opt = OPTIMIZER(model.parameters())
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def global_batches(dataset, batch_size, steps, shuffle=False, seed=0, start=0):
    return [collate(dataset, positions(k, batch_size, len(dataset), shuffle, seed))
            for k in range(start, start + steps)]


# -- without workers ---------------------------------------------------------------------------

def test_global_batch_k_is_a_window_of_the_stream():
    assert positions(0, 4, 6, False, 0) == [0, 1, 2, 3]
    assert positions(1, 4, 6, False, 0) == [4, 5, 0, 1]      # wraps into epoch 1
    shuffled = [positions(k, 3, 6, True, 7) for k in range(4)]
    assert sorted(shuffled[0] + shuffled[1]) == list(range(6)) == sorted(shuffled[2] + shuffled[3])
    assert shuffled[:2] != shuffled[2:]                     # a new permutation each epoch
    assert positions(1, 4, 6, True, 7, 1, 3) == positions(1, 4, 6, True, 7)[1:3]


def test_token_file_is_nanogpts_bin_as_blocks(tmp_path):
    data = token_file(tmp_path)
    tokens = _corpus_tokens()[1][:2000]
    assert len(data) == (2000 - 1) // BLOCK
    x, y = data[3]
    assert x.dtype == torch.int64 and torch.equal(x, tokens[48:64]) and torch.equal(y, tokens[49:65])
    import pickle

    again = pickle.loads(pickle.dumps(data))                # a worker opens the file itself
    assert again._fd is None and torch.equal(again[3][0], x)


def test_a_reader_reads_only_its_rows_and_inputs():
    data = blocks()
    # Rows 4..8 of an 8-row batch in two microbatches of 2, the targets only (a last stage).
    reader = Reader(data, 8, False, 0, start=4, per=2, microbatches=2, wanted=(1,))
    got = reader.batch(1)
    assert list(got) == [1]
    whole = collate(data, positions(1, 8, len(data), False, 0))
    assert torch.equal(got[1][0], whole[1][4:6]) and torch.equal(got[1][1], whole[1][6:8])


@pytest.mark.parametrize("dataset,kw,code", [
    (torch.utils.data.TensorDataset(torch.zeros(8, BLOCK, dtype=torch.long)), {"batch_size": 4}, "bad-dataset"),
    ([1, 2, 3, 4], {"batch_size": 2}, "bad-dataset"),
    (blocks(4), {"batch_size": 8}, "bad-dataset"),
    (blocks(8), {"batch_size": 0}, "bad-dataset"),
    (blocks(8), {"batch_size": 3, "mesh": {"dp": 2}, "strategy": data_parallel()}, "indivisible-batch"),
])
def test_bad_data_is_a_diagnostic(dataset, kw, code):
    with pytest.raises(piper.PiperError) as info:
        piper.compile(gpt(2), None, data=dataset, **kw)
    assert info.value.code == code


# -- with workers ------------------------------------------------------------------------------

@pytest.mark.usefixtures("ray_cluster")
def test_worker_read_data_trains_as_shipped_batches_and_one_device():
    model = gpt(2, torch.float64)
    data = blocks()
    strategy = load_strategy("use one_f_one_b(microbatches=2) on pp\nuse dp() on dp\n")
    mesh = {"dp": 2, "pp": 2}
    batches = global_batches(data, 8, 6, shuffle=True, seed=3)
    with piper.compile(copy.deepcopy(model), None, strategy=strategy, mesh=mesh, optimizer=OPTIMIZER,
                       data=data, batch_size=8, shuffle=True, seed=3) as job:
        read = [job.step() for _ in range(6)]
        read_bytes = job.sent_bytes
        read_state = job.state_dict()
        assert job.data_position == 6
    with piper.compile(copy.deepcopy(model), batches[0], strategy=strategy, mesh=mesh, optimizer=OPTIMIZER) as job:
        shipped = [job.step(*b) for b in batches]
        shipped_bytes = job.sent_bytes
        shipped_state = job.state_dict()
    assert read == shipped
    for k, v in shipped_state.items():
        assert torch.equal(read_state[k], v), k
    ref_losses, ref_state = one_device(copy.deepcopy(model), batches)
    assert_same((read, ref_losses, read_state, ref_state), tol=1e-9)
    assert shipped_bytes >= 8 * BLOCK * 8 * 2 and read_bytes < 1000


@pytest.mark.usefixtures("ray_cluster")
def test_driver_bytes_per_step_do_not_grow_with_the_batch(tmp_path):
    data = token_file(tmp_path)
    sent = {}
    for batch_size in (4, 16):
        with piper.compile(gpt(2), None, strategy=data_parallel(), mesh={"dp": 2}, data=data,
                           batch_size=batch_size) as job:
            job.step()
            sent[batch_size] = job.sent_bytes
    assert sent[4] == sent[16] < 1000


@pytest.mark.usefixtures("ray_cluster")
def test_a_resumed_run_reads_on_where_it_stopped(tmp_path):
    """Save after step 3 under dp=2, load into a 1F1B pipeline: steps 4-6 read global batches
    3-5 of the same shuffled stream and train as the uninterrupted run, schedule included."""
    model = gpt(2, torch.float64)
    data = blocks()
    schedule = piper.warmup_cosine(2, 6)
    common = dict(optimizer=OPTIMIZER, data=data, batch_size=8, shuffle=True, seed=5, lr_schedule=schedule)
    with piper.compile(copy.deepcopy(model), None, strategy=data_parallel(), mesh={"dp": 2}, **common) as job:
        first = [job.step() for _ in range(3)]
        job.save(tmp_path / "step-3")
    with piper.compile(copy.deepcopy(model), None, strategy=load_strategy("use one_f_one_b(microbatches=4) on pp\n"),
                       mesh={"pp": 2}, **common) as job:
        info = job.load(tmp_path / "step-3")
        assert info["data_position"] == 3 and job.data_position == 3
        rest = [job.step() for _ in range(3)]
        state = job.state_dict()
    reference = copy.deepcopy(model)
    opt = OPTIMIZER(reference.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = []
    for batch in global_batches(data, 8, 6, shuffle=True, seed=5):
        opt.zero_grad()
        loss = reference(*batch)
        loss.backward()
        opt.step()
        sched.step()
        ref.append(loss.item())
    assert_same((first + rest, ref, state, {k: v.detach() for k, v in reference.state_dict().items()}), tol=1e-9)


@pytest.mark.usefixtures("ray_cluster")
def test_evaluate_reads_the_validation_set(tmp_path):
    model = gpt(2, torch.float64)
    val = blocks(16)
    with piper.compile(copy.deepcopy(model), None, strategy=data_parallel(), mesh={"dp": 2}, data=blocks(),
                       batch_size=8, val_data=val) as job:
        loss = job.evaluate(batches=2)
    with torch.no_grad():
        ref = [model(*b).item() for b in global_batches(val, 8, 2)]
    assert abs(loss - sum(ref) / 2) < 1e-9
