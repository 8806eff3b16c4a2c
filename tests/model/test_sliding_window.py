"""Sliding-window attention (``sliding_window``, ``sliding_layers``) by its properties: in a causal stack position t
sees exactly keys t - w + 1 .. t, in a bidirectional one the keys with |i - j| < w; no look-ahead; padding (left or
right) does not leak; KV-cache decoding (dynamic or static) equals a full forward pass and keeps seeing only the last
w keys; prefix-LM masks and packed documents (``document_ids``) compose with it; only the layers named attend within
the window; with no window, or a window no shorter than the sequence, the mask is SDPA's causal fast path."""

from __future__ import annotations

import pytest
import torch
from decoder_fixtures import V, ids, perturbed

from pretune import ConfigError, ModelConfig
from pretune.model.attention import build_mask
from pretune.model.cache import StaticKVCache

ATOL, RTOL = 1e-5, 1e-4


def tiny(**kw) -> ModelConfig:
    base = dict(arch="decoder", head="lm", vocab_size=V, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48,
                max_seq_len=64, dropout=0.0, attn_dropout=0.0, position="rope", norm="rmsnorm", norm_placement="pre",
                ffn="swiglu", bias=False, embed_norm=False, token_types=0, sliding_window=3)
    return ModelConfig(**{**base, **kw})


def visible(mask: torch.Tensor) -> torch.Tensor:
    """The keys each query sees, (..., q_len, k_len) bool, from an additive mask."""
    return mask > torch.finfo(mask.dtype).min / 2


# --- the mask ------------------------------------------------------------------------------------
@pytest.mark.parametrize("w", [1, 2, 3, 5])
def test_causal_window_sees_exactly_the_last_w_keys(w):
    mask, is_causal = build_mask(q_len=8, k_len=8, causal=True, window=w)
    assert not is_causal
    want = torch.tensor([[t - w + 1 <= j <= t for j in range(8)] for t in range(8)])
    assert torch.equal(visible(mask)[0, 0], want)


@pytest.mark.parametrize("w", [1, 2, 4])
def test_bidirectional_window_sees_keys_closer_than_w(w):
    """|i - j| < w, both sides (ModernBERT's local_attention=L is w = L / 2 + 1)."""
    mask, _ = build_mask(q_len=9, k_len=9, causal=False, window=w)
    want = torch.tensor([[abs(i - j) < w for j in range(9)] for i in range(9)])
    assert torch.equal(visible(mask)[0, 0], want)


def test_a_window_no_shorter_than_the_keys_keeps_the_fast_path():
    assert build_mask(q_len=6, k_len=6, causal=True, window=6) == (None, True)
    assert build_mask(q_len=6, k_len=6, causal=False, window=9) == (None, False)
    assert build_mask(q_len=1, k_len=6, q_offset=5, causal=True, window=6) == (None, False)
    mask, _ = build_mask(q_len=1, k_len=7, q_offset=6, causal=True, window=6)  # one decoding step past it
    assert visible(mask)[0, 0, 0].tolist() == [False] + [True] * 6


def test_cached_queries_and_a_static_cache_use_their_columns():
    """Queries at columns 5..6 of 7 (a dynamic cache) and at index 5 of a static cache of 10 (the unwritten columns
    7..9 hidden too) see the same keys as in the full mask."""
    full = visible(build_mask(q_len=7, k_len=7, causal=True, window=3)[0])[0, 0]
    dyn = visible(build_mask(q_len=2, k_len=7, q_offset=5, causal=True, window=3)[0])[0, 0]
    assert torch.equal(dyn, full[5:])
    static = visible(build_mask(q_len=2, k_len=10, q_offset=torch.tensor([5]), causal=True, window=3)[0])[0, 0]
    assert torch.equal(static[:, :7], full[5:]) and not static[:, 7:].any()


def test_window_composes_with_padding_prefix_and_documents():
    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    got = visible(build_mask(q_len=7, k_len=7, causal=True, key_padding=pad, window=3)[0])[0, 0]
    assert got[6].tolist() == [False] * 4 + [True] * 3 and got[3].tolist() == [False, False, True, True] + [False] * 3
    # prefix LM (prefix of 4): the prefix is bidirectional but still local, the rest causal and local
    got = visible(build_mask(q_len=7, k_len=7, causal=True, prefix_lengths=torch.tensor([4]), window=2)[0])[0, 0]
    want = torch.tensor([[abs(t - j) < 2 and (j <= t or j < 4) for j in range(7)] for t in range(7)])
    assert torch.equal(got, want)
    # packed documents [0 0 0 0 1 1 1]: a window never crosses into the previous document
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    got = visible(build_mask(q_len=7, k_len=7, causal=True, document_ids=docs, window=3)[0])[0, 0]
    want = torch.tensor([[t - 3 < j <= t and docs[0, j] == docs[0, t] for j in range(7)] for t in range(7)])
    assert torch.equal(got, want)


# --- the model -----------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "encoder"])
def test_a_position_depends_on_exactly_the_tokens_in_its_window(causal):
    """One layer: changing token j changes the output at t iff j is in t's window."""
    w = 3
    cfg = tiny(sliding_window=w) if causal else tiny(arch="encoder", head="none", sliding_window=w)
    model = perturbed(cfg)
    tokens = ids(1, 10)
    with torch.no_grad():
        ref = model(tokens).last_hidden_state
        for j in range(10):
            changed = tokens.clone()
            changed[0, j] = changed[0, j] % (V - 1) + 1
            moved = (model(changed).last_hidden_state - ref).abs().amax(-1)[0] > 1e-6  # (T,)
            want = [t - w < j <= t if causal else abs(t - j) < w for t in range(10)]
            assert moved.tolist() == want, j


def test_only_the_sliding_layers_attend_locally():
    """Two layers: windowed everywhere, the receptive field is 2 (w - 1) + 1; with layer 1 global, everything."""
    tokens = ids(1, 10)
    for layers, first_seen in ([None, 5], [[0], 0], [[1], 0]):
        model = perturbed(tiny(n_layers=2, sliding_layers=layers))
        with torch.no_grad():
            ref = model(tokens).last_hidden_state[0, 9]
            seen = []
            for j in range(10):
                changed = tokens.clone()
                changed[0, j] = changed[0, j] % (V - 1) + 1
                seen.append(bool((model(changed).last_hidden_state[0, 9] - ref).abs().max() > 1e-6))
        assert seen == [j >= first_seen for j in range(10)], layers


@pytest.fixture(params=["all-layers", "layer-0", "encoder-decoder"])
def model(request):
    if request.param == "encoder-decoder":
        return perturbed(tiny(arch="encoder-decoder", n_layers=2, position="relative", sliding_window=3,
                              sliding_layers=[1]))
    return perturbed(tiny(n_layers=2, sliding_layers=None if request.param == "all-layers" else [0]))


def _run(model, tokens, **kw):
    if model.config.arch == "encoder-decoder":
        return model(tokens, decoder_input_ids=tokens, **{k.replace("attention_mask", "decoder_attention_mask"): v
                                                          for k, v in kw.items()})
    return model(tokens, **kw)


def test_no_look_ahead(model):
    tokens = ids(2, 9)
    with torch.no_grad():
        ref = _run(model, tokens).logits
        for t in range(8):
            changed = tokens.clone()
            changed[:, t + 1] = changed[:, t + 1] % (V - 1) + 1
            if model.config.arch == "encoder-decoder":  # the decoder input only (the encoder sees everything)
                out = model(tokens, decoder_input_ids=changed).logits
            else:
                out = model(changed).logits
            torch.testing.assert_close(out[:, : t + 1], ref[:, : t + 1], atol=ATOL, rtol=RTOL)
            assert (out[:, t + 1] - ref[:, t + 1]).abs().max() > 1e-4


def test_padding_does_not_leak():
    """Right padding, and left padding with explicit positions (generation's layout)."""
    model = perturbed(tiny(n_layers=2))
    tokens = ids(2, 9)
    with torch.no_grad():
        right = torch.ones(2, 9, dtype=torch.long)
        right[1, 6:] = 0
        out = model(tokens, attention_mask=right).logits
        torch.testing.assert_close(out[1, :6], model(tokens[1:, :6]).logits[0], atol=ATOL, rtol=RTOL)
        left = torch.ones(2, 9, dtype=torch.long)
        left[1, :4] = 0
        positions = (left.cumsum(1) - 1).clamp_min(0)
        out = model(tokens, attention_mask=left, position_ids=positions).logits
        torch.testing.assert_close(out[1, 4:], model(tokens[1:, 4:]).logits[0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(out[0], model(tokens[:1]).logits[0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("chunks", [(1,) * 16, (5, 1, 10), (2, 14)], ids=["one-by-one", "5-1-10", "2-14"])
def test_kv_cache_equals_full_forward(chunks):
    """16 positions through a window of 3: the cached steps see the last 3 keys only, as the full pass does."""
    model = perturbed(tiny(n_layers=2, sliding_layers=[1]))
    tokens = ids(2, 16)
    with torch.no_grad():
        full = model(tokens).logits
        cache, outs, s = None, [], 0
        for c in chunks:
            out = model(tokens[:, s:s + c], past_key_values=cache, use_cache=True)
            cache, s = out.past_key_values, s + c
            outs.append(out.logits)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=ATOL, rtol=RTOL)


def test_static_cache_equals_full_forward():
    model = perturbed(tiny(n_layers=2))
    tokens = ids(2, 12)
    with torch.no_grad():
        full = model(tokens).logits
        cache = StaticKVCache(16)
        outs = [model(tokens[:, :4], past_key_values=cache, use_cache=True).logits]
        outs += [model(tokens[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(4, 12)]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=ATOL, rtol=RTOL)


def test_packed_documents_equal_each_document_alone():
    model = perturbed(tiny(n_layers=2))
    a, b = ids(1, 7, seed=2), ids(1, 5, seed=3)
    packed = torch.cat([a, b], 1)
    docs = torch.tensor([[0] * 7 + [1] * 5])
    positions = torch.tensor([list(range(7)) + list(range(5))])
    with torch.no_grad():
        h = model.transformer.decode(packed, position_ids=positions, document_ids=docs)
        torch.testing.assert_close(h[:, :7], model.transformer.decode(a), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(h[:, 7:], model.transformer.decode(b), atol=ATOL, rtol=RTOL)


def test_no_window_and_short_rows_keep_sdpa_causal():
    """The default path is untouched (SDPA's causal flag, no mask); a window no shorter than the row changes nothing."""
    for cfg, T in ((tiny(sliding_window=None), 8), (tiny(sliding_window=8), 8)):
        model = perturbed(cfg)
        seen = []
        model.transformer.decoder.layers[0].register_forward_pre_hook(
            lambda m, a, kw, seen=seen: seen.append((kw["mask"], kw["is_causal"])), with_kwargs=True)
        with torch.no_grad():
            model(ids(2, T))
        assert seen == [(None, True)]
    assert perturbed(tiny(sliding_window=None)).transformer.decoder.local == frozenset()


@pytest.mark.parametrize("bad,match", [
    (dict(sliding_window=0), "sliding_window must be >= 1"),
    (dict(sliding_window=None, sliding_layers=[0]), "needs sliding_window"),
    (dict(n_layers=2, sliding_layers=[2]), r"distinct layer indices in 0\.\.1"),
    (dict(n_layers=2, sliding_layers=[1, 1]), "distinct layer indices"),
])
def test_bad_windows_are_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        tiny(**bad)
