"""Gemma's and Gemma 2's model-core options by their properties: the (1 + w) RMSNorm (``norm="rmsnorm_plus_one"``),
embeddings scaled by sqrt(dim) in their own dtype (``scale_embeddings``), sandwich norms (``norm_placement=
"sandwich"``: a norm before and after each branch), soft-capped attention scores (``attn_softcap``, on the eager path)
and LM logits (``logit_softcap``, which no loss may fuse away). The invariants (no look-ahead, padding, cache) run in
test_decoder_options.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from decoder_fixtures import V, ids, perturbed

from pretune import ConfigError, ModelConfig, build_model
from pretune.model.attention import Attention
from pretune.model.heads import LMHead, SoftCappedLMHead
from pretune.model.layers import NORMS, RMSNormPlusOne
from pretune.model.transformer import Block
from pretune.objectives.lm import lm_loss_sum

GEMMA = dict(norm="rmsnorm_plus_one", scale_embeddings=True, ffn="geglu_tanh", head_dim=12)


def tiny(**kw) -> ModelConfig:
    base = dict(arch="decoder", head="lm", vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                max_seq_len=64, dropout=0.0, attn_dropout=0.0, position="rope", norm="rmsnorm", norm_eps=1e-6,
                norm_placement="pre", ffn="swiglu", bias=False, embed_norm=False, token_types=0)
    return ModelConfig(**{**base, **kw})


# --- (1 + w) RMSNorm ---------------------------------------------------------------------------------
def test_rmsnorm_plus_one_starts_as_plain_rms_and_scales_by_one_plus_w():
    norm = NORMS["rmsnorm_plus_one"](8, 1e-6)
    assert isinstance(norm, RMSNormPlusOne) and torch.equal(norm.weight, torch.zeros(8))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), rms)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    torch.testing.assert_close(norm(x), rms * (1 + norm.weight))


def test_rmsnorm_plus_one_scales_in_fp32_before_the_cast():
    """Gemma: (x * (1 + w)).to(bf16), not x.to(bf16) * (1 + w) (one rounding, not two)."""
    norm = RMSNormPlusOne(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.7, 0.9, 64))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)).bfloat16()
    assert torch.equal(norm(x), want)


# --- embeddings times sqrt(dim) ----------------------------------------------------------------------
def test_scaled_embeddings_equal_a_scaled_embedding_matrix():
    """In fp32 the stack sees embed(ids) * sqrt(dim): the same as unscaled embeddings stored sqrt(dim) larger."""
    cfg = tiny(head="none", scale_embeddings=True)
    model = perturbed(cfg)
    plain = build_model(cfg.replace(scale_embeddings=False)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        plain.transformer.embed.weight.mul_(math.sqrt(32))
        torch.testing.assert_close(model(ids(2, 6)).last_hidden_state, plain(ids(2, 6)).last_hidden_state)


def test_the_scale_is_rounded_to_the_embeddings_dtype():
    """bf16: sqrt(48) = 6.93 becomes 6.9375 before it multiplies (as transformers' Gemma does)."""
    model = build_model(tiny(dim=48, n_heads=4, scale_embeddings=True)).to(torch.bfloat16).eval()
    seen = []
    model.transformer.decoder.layers[0].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    tokens = ids(1, 5)
    with torch.no_grad():
        model(tokens)
    scale = torch.tensor(math.sqrt(48), dtype=torch.bfloat16)
    assert float(scale) == 6.9375
    assert torch.equal(seen[0], model.transformer.embed(tokens) * scale)


# --- sandwich norms ----------------------------------------------------------------------------------
def test_sandwich_block_has_four_norms_and_computes_x_plus_norm_of_branch():
    cfg = tiny(**GEMMA, norm_placement="sandwich")
    block = Block(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    norms = [n for n, m in block.named_modules() if isinstance(m, RMSNormPlusOne)]
    assert sorted(norms) == ["attn_norm", "attn_post_norm", "ffn_norm", "ffn_post_norm"]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = x + block.attn_post_norm(block.attn(block.attn_norm(x), is_causal=True))
        want = h + block.ffn_post_norm(block.ffn(block.ffn_norm(h)))
        got = block(x, mask=None, is_causal=True, rotate=None, positions=None)
    torch.testing.assert_close(got, want)
    assert Block(tiny()).attn_post_norm is None  # pre-norm blocks: two norms, no extra work
    assert build_model(cfg).transformer.decoder.norm is not None  # and a final norm, as pre-norm stacks


# --- soft-capped attention ---------------------------------------------------------------------------
def test_attention_softcap_is_c_tanh_of_the_scaled_scores_before_the_mask():
    cfg = tiny(attn_softcap=2.0, attn_scale=0.3, n_kv_heads=2)
    attn = Attention(cfg).eval()
    q, k, v = (torch.randn(2, h, 6, 8, generator=torch.Generator().manual_seed(s)) * 3
               for s, h in ((0, 4), (1, 2), (2, 2)))
    pad = torch.zeros(2, 1, 6, 6)
    pad[1, ..., 4:] = torch.finfo(torch.float32).min
    got = attn._attend_eager(q, k, v, pad, True)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = 2.0 * torch.tanh((q @ kk.transpose(-1, -2)) * 0.3 / 2.0)
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf")) + pad
    torch.testing.assert_close(got, scores.softmax(-1) @ vv)


def test_attention_softcap_runs_eagerly_and_a_huge_cap_equals_sdpa():
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(3))
    capped = Attention(tiny(attn_softcap=1e6)).eval()
    plain = Attention(tiny()).eval()
    plain.load_state_dict(capped.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(capped(x, is_causal=True), plain(x, is_causal=True), atol=1e-5, rtol=1e-4)
        small = Attention(tiny(attn_softcap=0.5)).eval()
        small.load_state_dict(capped.state_dict())
        assert (small(x, is_causal=True) - plain(x, is_causal=True)).abs().max() > 1e-3


def test_attention_softcap_trains_with_dropout():
    model = perturbed(tiny(attn_softcap=1.0, attn_dropout=0.3)).train()
    F.cross_entropy(model(ids(2, 6)).logits.reshape(-1, V), ids(2, 6, seed=2).reshape(-1)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# --- soft-capped logits ------------------------------------------------------------------------------
def test_logit_softcap_bounds_the_lm_logits_and_no_loss_fuses_it_away():
    model = perturbed(tiny(logit_softcap=0.8))
    assert isinstance(model.head, SoftCappedLMHead) and not model.head.fusable
    assert isinstance(perturbed(tiny()).head, LMHead) and LMHead.fusable
    assert type(build_model(tiny(), fast=False).head) is LMHead
    plain = build_model(tiny()).eval()
    plain.load_state_dict(model.state_dict())
    tokens = ids(2, 6)
    with torch.no_grad():
        logits, raw = model(tokens).logits, plain(tokens).logits
        torch.testing.assert_close(logits, 0.8 * torch.tanh(raw / 0.8))
        assert logits.abs().max() < 0.8 and raw.abs().max() > 0.8
        h = model.transformer.decode(tokens)[:, :-1].reshape(-1, 32)
        targets = tokens[:, 1:].reshape(-1)
        s, _ = lm_loss_sum(model, h, targets, targets.numel())  # the objectives' LM loss sees the capped logits
    torch.testing.assert_close(s / targets.numel(), F.cross_entropy(logits[:, :-1].reshape(-1, V), targets))


def test_task_heads_ignore_the_logit_softcap():
    """As transformers' Gemma2For*Classification: the cap belongs to the LM head (a with_head() keeps the field)."""
    model = perturbed(tiny(logit_softcap=0.1, head="classification", num_labels=3))
    plain = build_model(model.config.replace(logit_softcap=None)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        logits = model(ids(2, 6)).logits
        torch.testing.assert_close(logits, plain(ids(2, 6)).logits)
    assert logits.abs().max() > 0.1


@pytest.mark.parametrize("bad,match", [
    (dict(attn_softcap=0.0), "attn_softcap must be > 0"),
    (dict(logit_softcap=-1.0), "logit_softcap must be > 0"),
    (dict(norm="gemma"), "is not one of"),
    (dict(norm_placement="both"), "is not one of"),
])
def test_bad_gemma_options_are_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        tiny(**bad)


def test_left_padded_batch_in_bf16_with_soft_capped_attention_stays_finite():
    """The fp32 minimum on hidden keys is -inf in bf16: a padding query (every key hidden) gave NaN, and its NaN
    values reached the real queries through the eager (soft-capped) attention. The mask is clamped to bf16's own
    minimum, so every real position is finite and matches its row run without padding."""
    cfg = tiny(**GEMMA, norm_placement="sandwich", attn_softcap=50.0, logit_softcap=30.0)
    model = build_model(cfg).to(torch.bfloat16).eval()
    x = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batch = model(x, mask, position_ids=pos).logits.float()
        alone = model(x[1:, 2:]).logits.float()
    assert torch.isfinite(batch[0]).all() and torch.isfinite(batch[1, 2:]).all()
    torch.testing.assert_close(batch[1, 2:], alone[0], atol=0.05, rtol=0.02)
