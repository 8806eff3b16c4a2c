"""DeBERTa's disentangled attention (position="disentangled") against its formulas (He et al. 2021 §3.1, the v2/v3
form): the log buckets against a direct computation, the c2p + p2c term against an element-by-element sum, the scale
1/sqrt(3 Dh), translation invariance, padding that does not leak on rows longer than the buckets reach, and the
config checks. (The arch x position grid of test_properties.py covers shapes, backward, look-ahead and the cache.)"""

import math

import pytest
import torch

from pretune import ConfigError, ModelConfig, build_model
from pretune.model.attention import Attention
from pretune.model.position import DisentangledPositions, log_buckets


def cfg(**kw) -> ModelConfig:
    base = dict(arch="encoder", head="mlm", vocab_size=100, dim=32, n_layers=2, n_heads=4, ffn_dim=64,
                max_seq_len=128, position="disentangled", position_buckets=8, max_relative_positions=16,
                token_types=0, dropout=0.0, attn_dropout=0.0)
    return ModelConfig(**{**base, **kw})


def _direct_bucket(r: int, buckets: int, max_distance: int) -> int:
    """The DeBERTa bucket of distance r in float64 arithmetic: r itself up to buckets / 2, then
    sign(r) * (mid + ceil(log(|r| / mid) / log((max_distance - 1) / mid) * (mid - 1)))."""
    mid = buckets // 2
    if abs(r) <= mid:
        return r
    log_pos = math.ceil(math.log(abs(r) / mid) / math.log((max_distance - 1) / mid) * (mid - 1)) + mid
    return int(math.copysign(log_pos, r))


@pytest.mark.parametrize("buckets,max_distance", [(8, 16), (6, 20), (5, 9), (16, 100), (256, 512), (256, 1024)])
def test_log_buckets_against_a_direct_computation(buckets, max_distance):
    rel = torch.arange(-3 * max_distance, 3 * max_distance + 1)
    got = log_buckets(rel, buckets, max_distance)
    want = torch.tensor([_direct_bucket(int(r), buckets, max_distance) for r in rel])
    assert torch.equal(got, want)  # float32 (transformers' arithmetic) lands in the float64 bucket everywhere here
    mid = buckets // 2
    near = rel.abs() <= mid
    assert torch.equal(got[near], rel[near])  # exact below buckets / 2
    assert torch.equal(log_buckets(-rel, buckets, max_distance), -got)  # odd: the sign is the direction
    assert bool((got[1:] >= got[:-1]).all())  # monotone in the distance
    assert int(got[rel.abs() < max_distance].abs().max()) <= buckets - 1  # max_distance - 1 reaches the last one


def test_bucket_index_covers_the_table_and_clips():
    pos = DisentangledPositions(cfg(position_buckets=8, max_relative_positions=16), causal=False)
    idx = pos.bucket(torch.arange(-500, 501))
    assert int(idx.min()) >= 0 and int(idx.max()) <= 2 * 8 - 1
    assert pos.rel_embed.weight.shape == (16, 32)
    unbucketed = DisentangledPositions(cfg(position_buckets=0, max_relative_positions=12), causal=False)
    rel = torch.arange(-30, 31)
    assert unbucketed.rel_embed.weight.shape == (24, 32)
    assert torch.equal(unbucketed.bucket(rel), (rel + 12).clamp(0, 23))  # exact distances, clipped at +-12


def _pos_module(**kw) -> DisentangledPositions:
    torch.manual_seed(0)
    pos = DisentangledPositions(cfg(**kw), causal=False).eval()
    with torch.no_grad():
        pos.rel_embed.weight.normal_()
        pos.rel_norm.weight.add_(torch.randn(32) * 0.1)
        pos.rel_norm.bias.add_(torch.randn(32) * 0.1)
    return pos


@pytest.mark.parametrize("buckets", [8, 0])
def test_scores_equal_the_elementwise_c2p_plus_p2c(buckets):
    pos = _pos_module(position_buckets=buckets)
    q_proj, k_proj = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
    B, H, Tq, Tk, Dh = 2, 4, 13, 13, 8
    q, k = torch.randn(B, H, Tq, Dh), torch.randn(B, H, Tk, Dh)
    with torch.no_grad():
        got = pos.scores(torch.arange(Tq), torch.arange(Tk))(q, k, q_proj, k_proj)  # (B, H, Tq, Tk)
        rel = torch.nn.functional.layer_norm(pos.rel_embed.weight, (32,), pos.rel_norm.weight, pos.rel_norm.bias,
                                             1e-12)
        Pq = q_proj(rel).view(-1, H, Dh)  # (2 span, H, Dh)
        Pk = k_proj(rel).view(-1, H, Dh)
    want = torch.zeros(B, H, Tq, Tk)
    for i in range(Tq):
        for j in range(Tk):
            d = int(pos.bucket(torch.tensor(i - j)))
            want[:, :, i, j] = (q[:, :, i] * Pk[d]).sum(-1) + (k[:, :, j] * Pq[d]).sum(-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_scores_depend_only_on_the_distance():
    pos = _pos_module()
    q_proj, k_proj = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 4, 7, 8)
    with torch.no_grad():
        a = pos.scores(torch.arange(5), torch.arange(7))(q, k, q_proj, k_proj)
        b = pos.scores(torch.arange(40, 45), torch.arange(40, 47))(q, k, q_proj, k_proj)
        c = pos.scores(torch.arange(2, 7), torch.arange(7))(q, k, q_proj, k_proj)  # the queries moved
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_attention_scale_counts_the_position_terms():
    assert Attention(cfg()).scale == pytest.approx((8 * 3) ** -0.5)  # 1/sqrt(Dh * (1 + c2p + p2c))
    assert Attention(cfg(attn_scale=0.25)).scale == 0.25
    assert Attention(cfg(position="learned")).scale is None  # SDPA's 1/sqrt(Dh)


def _perturbed(config: ModelConfig):
    torch.manual_seed(0)
    model = build_model(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


@pytest.mark.parametrize("buckets,max_rel", [(8, 16), (0, 10)])
def test_padding_does_not_leak_on_long_rows(buckets, max_rel):
    """Row 1 is 25 real tokens then 15 pads (beyond every bucket): its real positions equal the 25 run alone,
    whatever the pads hold."""
    model = _perturbed(cfg(position_buckets=buckets, max_relative_positions=max_rel))
    ids = torch.randint(1, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    other = ids.clone()
    other[1, 25:] = (other[1, 25:] + 7) % 99 + 1
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        batch2 = model(other, attention_mask=mask).logits
        alone = model(ids[1:, :25]).logits
        full = model(ids[:1]).logits
    torch.testing.assert_close(batch[1, :25], alone[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(batch2[1, :25], alone[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(batch[0], full[0], atol=1e-5, rtol=1e-4)


def test_training_step_reaches_the_relative_table():
    """With dropout on (the eager path, a new dropout mask on the relative vectors in each layer) the loss reaches
    the relative table, its LayerNorm and every layer's q/k projections."""
    model = build_model(cfg(dropout=0.1, attn_dropout=0.1)).train()
    ids = torch.randint(1, 100, (2, 20))
    labels = torch.where(torch.rand(2, 20) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]
    model(ids, labels=labels).loss.backward()
    pos = model.transformer.encoder.position
    for p in (pos.rel_embed.weight, pos.rel_norm.weight, pos.rel_norm.bias):
        assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.parametrize("overrides,match", [
    ({"n_kv_heads": 2}, r"position='disentangled' needs plain multi-head attention"),
    ({"qk_norm": True}, r"position='disentangled' needs plain multi-head attention"),
    ({"position_buckets": 1}, r"position_buckets must be >= 2 \(or 0: no buckets\), got 1"),
    ({"position_buckets": -3}, r"position_buckets must be >= 2"),
    ({"position_buckets": 8, "max_relative_positions": 5}, r"max_relative_positions must be >= 6 .*got 5"),
    ({"position_buckets": 0, "max_relative_positions": 0}, r"max_relative_positions must be >= 1 .*got 0"),
])
def test_bad_settings_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg(**overrides)
