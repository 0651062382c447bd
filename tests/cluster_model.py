"""A float64 two-stage GPT and its data, for `piper run --model tests/cluster_model.py:model` in
test_multinode.py (the same model and batches as test_train's `gpt(2, torch.float64)`)."""
import torch

from examples.gpt import _corpus_tokens, batches, make_model


def model():
    net, _ = make_model(n_layer=2, n_regions=2, n_embd=32, n_head=2, block_size=16)
    return net.to(torch.float64)


def training_batches(batch_size):
    return batches(_corpus_tokens()[1], batch_size, 16, seed=1)


def example_batch(batch_size):
    return next(training_batches(batch_size))
