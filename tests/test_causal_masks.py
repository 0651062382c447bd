"""Attention as eager Hugging Face calls it, from what export captured: a constant causal mask becomes
`is_causal=True` (`piper/frontend/causal_masks.py`), and then key/value heads repeated for grouped
queries become `enable_gqa=True` (`piper/frontend/repeated_heads.py`)."""
import pytest
import torch
import torch.nn.functional as F

import piper
from piper.frontend.capture import capture
from piper.testing import train_both
from tests.helpers import assert_same
from tests.test_train import data_parallel

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Attention(torch.nn.Module):
    """One attention layer whose mask `make_mask(x, idx)` builds in forward."""

    def __init__(self, make_mask, d=8, vocab=16):
        super().__init__()
        self.make_mask = make_mask
        self.emb = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx, targets):
        with piper.annotate("PP"):
            x = self.emb(idx)
            q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(x, idx))
            logits = self.head(y.squeeze(1))
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def positions_causal(x, idx):          # as Hugging Face builds it under export: from positions alone
    t = x.shape[1]
    pos = torch.arange(t, device=x.device)
    return (pos[None, :] <= pos[:, None]).expand(x.shape[0], 1, t, t)


def additive_causal(x, idx):
    t = x.shape[1]
    return torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)


def padding_and_causal(x, idx):        # reads the tokens: not a constant
    t = x.shape[1]
    pos = torch.arange(t, device=x.device)
    return (pos[None, :] <= pos[:, None]) & (idx != 0)[:, None, None, :]


def window(x, idx):                    # constant, but not the causal mask
    t = x.shape[1]
    pos = torch.arange(t, device=x.device)
    return (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 2)


def attention_calls(model, batch):
    graph = capture(model, batch).regions[0].graph.graph
    return [n for n in graph.nodes if n.target is SDPA]


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g)


@pytest.mark.parametrize("make_mask", [positions_causal, additive_causal])
def test_a_constant_causal_mask_becomes_is_causal_and_its_ops_go(make_mask):
    model = Attention(make_mask)
    (call,) = attention_calls(model, batch())
    assert call.args[3:] == () and call.kwargs.get("is_causal") is True and "attn_mask" not in call.kwargs
    graph = call.graph
    assert not any(n.target in (torch.ops.aten.arange.default, torch.ops.aten.le.Tensor, torch.ops.aten.triu.default)
                   for n in graph.nodes)


@pytest.mark.parametrize("make_mask", [padding_and_causal, window])
def test_a_mask_that_reads_the_batch_or_is_not_causal_stays(make_mask):
    model = Attention(make_mask)
    (call,) = attention_calls(model, batch())
    mask = call.args[3] if len(call.args) > 3 else call.kwargs.get("attn_mask")
    assert mask is not None and not call.kwargs.get("is_causal")


@pytest.mark.usefixtures("ray_cluster")
def test_the_rewritten_model_trains_as_on_one_device():
    """dp=2 with the rewritten attention against eager PyTorch on one device, float64."""
    torch.manual_seed(0)
    losses, ref_losses, state, ref_state = train_both(Attention(positions_causal).double(), data_parallel(),
                                                      mesh={"dp": 2}, batches=[batch(s) for s in range(3)],
                                                      timeout=120)
    assert_same((losses, ref_losses, state, ref_state))


class GroupedQuery(torch.nn.Module):
    """Attention with 4 query heads over 2 key/value heads, repeated as Hugging Face's `repeat_kv` does."""

    def __init__(self, make_mask, d=8, vocab=16):
        super().__init__()
        self.make_mask = make_mask
        self.emb = torch.nn.Embedding(vocab, d)
        self.q, self.kv = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx, targets):
        with piper.annotate("PP"):
            x = self.emb(idx)
            b, t, _ = x.shape
            q = self.q(x).view(b, t, 4, 2).transpose(1, 2)
            k, v = (y.view(b, t, 2, 2).transpose(1, 2) for y in self.kv(x).chunk(2, dim=-1))
            k, v = (y[:, :, None].expand(b, 2, 2, t, 2).reshape(b, 4, t, 2) for y in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(x, idx))
            return F.cross_entropy(self.head(y.transpose(1, 2).reshape(b, t, 8)).flatten(0, 1), targets.flatten())


def test_repeated_key_value_heads_become_enable_gqa_once_attention_has_no_mask():
    # The causal mask goes first (test above), then the repeat: as eager Hugging Face calls attention.
    (call,) = attention_calls(GroupedQuery(positions_causal), batch())
    assert call.kwargs.get("is_causal") is True and call.kwargs.get("enable_gqa") is True
    assert [tuple(a.meta["val"].shape) for a in call.args] == [(2, 4, 6, 2), (2, 2, 6, 2), (2, 2, 6, 2)]
    assert not any(n.target is torch.ops.aten.expand.default for n in call.graph.nodes)


def test_repeated_heads_stay_under_a_mask_that_reads_the_batch():
    (call,) = attention_calls(GroupedQuery(padding_and_causal), batch())
    assert not call.kwargs.get("enable_gqa") and tuple(call.args[1].meta["val"].shape) == (2, 4, 6, 2)


@pytest.mark.usefixtures("ray_cluster")
def test_grouped_query_attention_trains_as_on_one_device():
    torch.manual_seed(0)
    result = train_both(GroupedQuery(positions_causal).double(), data_parallel(), mesh={"dp": 2},
                        batches=[batch(s) for s in range(3)], timeout=120)
    assert_same(result)


def test_a_mask_too_large_to_evaluate_at_capture_stays(monkeypatch):
    from piper.frontend import causal_masks

    monkeypatch.setattr(causal_masks, "MAX_ELEMENTS", 35)       # the [2, 1, 6, 6] mask has 72
    (call,) = attention_calls(Attention(positions_causal), batch())
    assert len(call.args) > 3 and not call.kwargs.get("is_causal")
