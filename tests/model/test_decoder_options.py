"""The attention and RoPE options of today's decoder families, by their properties: Llama 3.x RoPE scaling
(``rope_scaling="llama3"``: low frequencies divided by rope_factor, high ones unchanged, a smooth blend between),
q/k/v-only biases (``qkv_bias``, Qwen2) and per-head q/k norms (``qk_norm``, Qwen3; with a ``head_dim`` independent of
dim / n_heads). Each keeps the invariants of every variant: backward reaches every parameter, no look-ahead, padding
does not leak, KV-cache decoding equals a full forward pass; so do the sliding window (Mistral; test_sliding_window.py)
and Gemma's and Gemma 2's options (test_gemma_options.py), alone and together."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from decoder_fixtures import V, ids, perturbed

from pretune import ConfigError, KVCache, ModelConfig, build_model
from pretune.model.position import RotaryPositions, llama3_inv_freq

ATOL, RTOL = 1e-5, 1e-4


def tiny(**kw) -> ModelConfig:
    base = dict(arch="decoder", head="lm", vocab_size=V, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=64,
                dropout=0.0, attn_dropout=0.0, position="rope", norm="rmsnorm", norm_placement="pre", ffn="swiglu",
                bias=False, embed_norm=False, token_types=0)
    return ModelConfig(**{**base, **kw})


# --- Llama 3.x RoPE scaling -----------------------------------------------------------------------
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)  # Llama 3.1's


def _plain(d: int = 128, base: float = 500000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def test_llama3_scaling_equals_the_formula():
    """Meta's apply_scaling (llama3 reference code, Llama 3.1), element by element in float64."""
    inv = _plain()
    got = llama3_inv_freq(inv, **LLAMA3)
    L, lo, hi, s = 8192, 1.0, 4.0, 8.0
    for theta, out in zip(inv.double().tolist(), got.double().tolist()):
        wavelen = 2 * math.pi / theta
        if wavelen < L / hi:
            want = theta
        elif wavelen > L / lo:
            want = theta / s
        else:
            smooth = (L / wavelen - lo) / (hi - lo)
            want = (1 - smooth) * theta / s + smooth * theta
        assert out == pytest.approx(want, rel=1e-6)


def test_llama3_scaling_slows_low_frequencies_keeps_high_ones_and_is_smooth_between():
    inv = _plain()
    ratio = inv / llama3_inv_freq(inv, **LLAMA3)  # how much each frequency slowed: 1 .. factor
    wavelen = 2 * math.pi / inv
    high, low = wavelen < 8192 / 4.0, wavelen > 8192 / 1.0
    assert high.any() and low.any() and (~high & ~low).sum() >= 3  # Llama 3.1's head: all three regimes
    assert torch.equal(ratio[high], torch.ones(int(high.sum())))  # high frequencies untouched
    torch.testing.assert_close(ratio[low], torch.full((int(low.sum()),), 8.0))  # low ones divided by the factor
    # in between, the slow-down grows monotonically from 1 to the factor with the wavelength
    assert (ratio.diff() >= -1e-6).all() and ((ratio > 1) & (ratio < 8)).sum() == (~high & ~low).sum()
    # and continuously: the blend evaluated at the two boundary wavelengths gives 1 and the factor
    edges = 2 * math.pi / torch.tensor([8192 / 4.0, 8192 / 1.0])
    inside = edges * torch.tensor([1 - 1e-6, 1 + 1e-6])  # wavelengths just inside the blended band
    torch.testing.assert_close(inside / llama3_inv_freq(inside, **LLAMA3), torch.tensor([1.0, 8.0]), rtol=1e-4,
                               atol=0)


def test_rotary_positions_rotate_by_the_scaled_frequencies():
    cfg = tiny(dim=64, n_heads=2, rope_base=500.0, rope_scaling="llama3", rope_factor=4.0, rope_low_freq_factor=1.0,
               rope_high_freq_factor=8.0, rope_original_max_seq_len=64)
    rope = RotaryPositions(cfg, causal=True)
    want = llama3_inv_freq(_plain(32, 500.0), factor=4.0, low_freq_factor=1.0, high_freq_factor=8.0,
                           original_max_seq_len=64)
    assert torch.equal(rope.inv_freq, want)
    assert not torch.equal(rope.inv_freq, RotaryPositions(cfg.replace(rope_scaling="none"), causal=True).inv_freq)
    # still relative: q_m . k_n depends only on n - m
    q, k = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))

    def score(m, n):
        rq, _ = rope.rotate(q.view(1, 1, 1, -1), q.view(1, 1, 1, -1), torch.tensor([m]))
        rk, _ = rope.rotate(k.view(1, 1, 1, -1), k.view(1, 1, 1, -1), torch.tensor([n]))
        return (rq * rk).sum().item()

    assert score(3, 10) == pytest.approx(score(40, 47), rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("bad,match", [
    (dict(position="learned"), "applies to position='rope' only"),
    (dict(rope_factor=0.5), "rope_factor must be >= 1"),
    (dict(rope_low_freq_factor=4.0, rope_high_freq_factor=4.0), "rope_low_freq_factor < rope_high_freq_factor"),
    (dict(rope_original_max_seq_len=0), "rope_original_max_seq_len must be > 0"),
    (dict(rope_scaling="yarn"), "is not one of"),
])
def test_bad_rope_scaling_is_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        tiny(**{"rope_scaling": "llama3", **bad})


# --- q/k/v biases and q/k norms --------------------------------------------------------------------
def test_qkv_bias_puts_biases_on_q_k_v_only():
    model = build_model(tiny(qkv_bias=True))
    names = {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    assert names == {f"transformer.decoder.layers.{i}.attn.{p}.bias" for i in range(2) for p in ("q_proj", "k_proj",
                                                                                                 "v_proj")}
    assert not any(n.endswith(".bias") for n, _ in build_model(tiny()).named_parameters())


def test_qkv_biases_change_the_output_and_the_fused_matmul_equals_three():
    """The biases take part (q, k and v each), and q, k, v in one matmul equal the three projections."""
    model = perturbed(tiny(qkv_bias=True))
    attn = model.transformer.decoder.layers[0].attn
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    q, k, v = attn.project(x)
    torch.testing.assert_close(q, attn._heads(attn.q_proj(x), 4))
    torch.testing.assert_close(v, attn._heads(attn.v_proj(x), 4))
    tokens = ids(2, 6)
    with torch.no_grad():
        ref = model(tokens).logits
        for proj in ("q_proj", "k_proj", "v_proj"):
            bias = getattr(attn, proj).bias
            saved = bias.clone()
            bias.add_(0.5)
            assert (model(tokens).logits - ref).abs().max() > 1e-4, proj
            bias.copy_(saved)


def test_qk_norm_normalises_each_head_over_head_dim():
    """With unit norm weights each head's queries and keys have RMS 1 whatever the projection's scale; the norm
    weights are (head_dim,), one each for q and k, shared by the heads (and the kv heads under GQA)."""
    cfg = tiny(qk_norm=True, n_kv_heads=2, head_dim=12)
    model = build_model(cfg).eval()
    attn = model.transformer.decoder.layers[0].attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (12,)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        attn.q_proj.weight.mul_(7.0)
        q, k, _ = attn.project(x)  # (B, H, T, Dh), (B, Hkv, T, Dh)
    assert q.shape == (2, 4, 5, 12) and k.shape == (2, 2, 5, 12)
    for t in (q, k):
        torch.testing.assert_close(t.pow(2).mean(-1).sqrt(), torch.ones(t.shape[:-1]), atol=1e-4, rtol=0)


def test_qk_norm_makes_attention_blind_to_the_scale_of_q_and_k():
    """RMSNorm before RoPE: scaling W_q and W_k leaves the output unchanged (it would change without qk_norm)."""
    tokens = ids(2, 7)
    for qk_norm in (True, False):
        model = perturbed(tiny(qk_norm=qk_norm, n_kv_heads=2, head_dim=12))
        with torch.no_grad():
            ref = model(tokens).logits
            for block in model.transformer.decoder.layers:
                block.attn.q_proj.weight.mul_(3.0)
                block.attn.k_proj.weight.mul_(0.25)
            out = model(tokens).logits
        if qk_norm:
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        else:
            assert (out - ref).abs().max() > 1e-3


# --- the invariants, for each option and all together ---------------------------------------------
OPTIONS = {
    "llama3-rope": dict(rope_scaling="llama3", rope_original_max_seq_len=16, rope_factor=4.0, rope_base=500.0),
    "qkv-bias": dict(qkv_bias=True, n_kv_heads=2),
    "qk-norm-head-dim": dict(qk_norm=True, n_kv_heads=1, head_dim=12),
    "all": dict(qkv_bias=True, qk_norm=True, n_kv_heads=2, head_dim=16, rope_scaling="llama3",
                rope_original_max_seq_len=16),
    "sliding-window": dict(sliding_window=3, n_kv_heads=2),  # Mistral
    "sliding-some-layers": dict(sliding_window=2, sliding_layers=[1], qkv_bias=True),  # Qwen2's window
    "gemma": dict(norm="rmsnorm_plus_one", scale_embeddings=True, ffn="geglu_tanh", head_dim=12, n_kv_heads=1),
    "gemma2": dict(norm="rmsnorm_plus_one", scale_embeddings=True, ffn="geglu_tanh", head_dim=12, n_kv_heads=2,
                   norm_placement="sandwich", attn_softcap=1.5, logit_softcap=2.0, attn_scale=0.2, sliding_window=4,
                   sliding_layers=[0]),
}


@pytest.fixture(params=list(OPTIONS))
def model(request):
    return perturbed(tiny(**OPTIONS[request.param]))


def test_backward_reaches_every_parameter(model):
    tokens = ids(2, 6)
    model.train()
    F.cross_entropy(model(tokens).logits.reshape(-1, V), ids(2, 6, seed=3).reshape(-1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_no_look_ahead(model):
    tokens = ids(2, 6)
    with torch.no_grad():
        ref = model(tokens).logits
        for t in range(5):
            changed = tokens.clone()
            changed[:, t + 1] = changed[:, t + 1] % (V - 1) + 1
            out = model(changed).logits
            torch.testing.assert_close(out[:, : t + 1], ref[:, : t + 1], atol=ATOL, rtol=RTOL)
            assert (out[:, t + 1] - ref[:, t + 1]).abs().max() > 1e-4


def test_padding_does_not_leak(model):
    tokens = ids(2, 7)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    with torch.no_grad():
        batch = model(tokens, mask).logits
        torch.testing.assert_close(batch[1, :4], model(tokens[1:, :4]).logits[0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(batch[0], model(tokens[:1]).logits[0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("chunks", [(1,) * 20, (7, 1, 12)], ids=["one-by-one", "7-1-12"])
def test_kv_cache_equals_full_forward(model, chunks):
    """20 positions: past llama3's original context of 16 here."""
    tokens = ids(2, 20)
    with torch.no_grad():
        full = model(tokens).logits
        cache, outs, s = None, [], 0
        for c in chunks:
            out = model(tokens[:, s:s + c], past_key_values=cache, use_cache=True)
            cache, s = out.past_key_values, s + c
            outs.append(out.logits)
    assert isinstance(cache, KVCache) and cache.length == 20
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=ATOL, rtol=RTOL)
