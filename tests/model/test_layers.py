"""Dropout (the cheaper keep mask) and the dropout attention path."""

import pytest
import torch
import torch.nn.functional as F

from pretune import ModelConfig
from pretune.model.attention import Attention
from pretune.model.layers import Dropout, dropout


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_rate_and_scale(p):
    x = torch.ones(400_000)
    y = dropout(x, p, training=True)
    kept = y != 0
    # 400k Bernoulli draws: the kept fraction is within 5 standard deviations of 1 - p
    sd = (p * (1 - p) / x.numel()) ** 0.5
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * sd
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    assert abs(y.mean().item() - 1.0) < 0.02  # inverted dropout keeps the expectation


def test_dropout_is_identity_in_eval_and_at_zero():
    x = torch.randn(100)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0, training=True) is x
    m = Dropout(0.3).eval()
    assert m(x) is x


def test_dropout_mask_is_seeded_and_not_constant_across_calls():
    x = torch.ones(1000)
    torch.manual_seed(3)
    a, b = dropout(x, 0.5, True), dropout(x, 0.5, True)
    torch.manual_seed(3)
    a2 = dropout(x, 0.5, True)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)


def test_dropout_words_are_independent_of_position():
    """The keep mask uses the four 15-bit words of each 64-bit draw (the high one has a clear sign bit):
    no word position is biased, at p = 0.5 and at a small p."""
    for p in (0.5, 0.1):
        y = dropout(torch.ones(4 * 200_000), p, True).view(-1, 4)
        rates = (y == 0).float().mean(0)
        assert torch.all((rates - p).abs() < 0.005), (p, rates)


def test_dropout_gradient_uses_the_same_mask():
    x = torch.randn(1000, requires_grad=True)
    y = dropout(x, 0.4, True)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y != 0).float() / 0.6)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_dropout_path_equals_sdpa_without_drops(kv_heads, causal):
    """With a dropout rate so small nothing is dropped, the training path is SDPA's maths."""
    cfg = ModelConfig(arch="decoder", dim=32, n_heads=4, n_kv_heads=kv_heads, ffn_dim=64, vocab_size=50,
                      head="lm", token_types=0, attn_dropout=1e-9)
    attn = Attention(cfg)
    x = torch.randn(2, 7, 32)
    mask = torch.zeros(2, 1, 7, 7)
    mask[1, ..., 5:] = torch.finfo(torch.float32).min
    for m in ([None, mask] if causal else [mask]):  # causal alone, causal + padding, padding alone
        train = attn.train()(x, is_causal=causal, mask=m)
        ref = attn.eval()(x, is_causal=causal, mask=m)
        torch.testing.assert_close(train, ref, atol=1e-6, rtol=1e-5)


def test_attention_dropout_drops_probabilities_at_the_rate_and_rescales():
    """With p = 0.5 the training path's output is (keep * softmax) @ v / (1 - p) for the keep mask drawn
    from torch's generator: re-drawing the same mask reproduces the output exactly."""
    from pretune.model.layers import _keep_mask

    cfg = ModelConfig(arch="decoder", dim=32, n_heads=4, ffn_dim=64, vocab_size=50, head="lm", attn_dropout=0.5)
    attn = Attention(cfg).train()
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    torch.manual_seed(3)
    out = attn._attend_eager(q, k, v, None, True)
    torch.manual_seed(3)
    keep = _keep_mask(torch.Size((2, 4, 6, 6)), 0.5, q.device)
    causal = torch.ones(6, 6, dtype=torch.bool).triu_(1)
    probs = ((q @ k.transpose(-1, -2)) * 8 ** -0.5).masked_fill(causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, (probs * keep) @ v / 0.5)
    assert 0.4 < keep.float().mean() < 0.6


def test_attention_dropout_actually_drops():
    cfg = ModelConfig(arch="encoder", dim=32, n_heads=4, ffn_dim=64, vocab_size=50, attn_dropout=0.5)
    attn = Attention(cfg).train()
    x = torch.randn(2, 7, 32)
    torch.manual_seed(0)
    a = attn(x)
    torch.manual_seed(1)
    b = attn(x)
    assert (a - b).abs().max() > 1e-3
    ref = F.scaled_dot_product_attention  # noqa: F841 - the eval path stays SDPA
    assert torch.equal(attn.eval()(x), attn.eval()(x))


@pytest.mark.parametrize("position", ["relative", "alibi", "rope"])
def test_attention_dropout_path_gradients_equal_sdpa_without_drops(position):
    """The training path adds masks and learned position biases in place; with nothing dropped its gradients
    (T5's relative bias table included) equal the SDPA path's."""
    import pretune

    torch.manual_seed(0)
    model = pretune.build_model("tiny-t5-small" if position == "relative" else "tiny-llama", dropout=0.0,
                                attn_dropout=1e-9, position=position)
    ids = torch.randint(5, 100, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    kw = {"decoder_input_ids": ids[:, :7]} if position == "relative" else {}
    grads = []
    for train in (True, False):
        model.train(train)
        model.zero_grad()
        out = model(ids, mask, **kw).logits
        out.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    if position == "relative":
        assert any("relative" in n or "bias" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)
