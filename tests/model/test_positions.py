"""Position modules against their papers' formulas: RoPE (relative by construction, norm-preserving),
ALiBi slopes and bias, T5 relative-position buckets, sinusoidal tables."""

import math

import pytest
import torch

from pretune import ModelConfig
from pretune.model.position import (
    ALiBi,
    LearnedPositions,
    RelativeBias,
    RotaryPositions,
    SinusoidalPositions,
    alibi_slopes,
)


def cfg(**kw) -> ModelConfig:
    base = dict(arch="decoder", head="lm", vocab_size=100, dim=64, n_layers=2, n_heads=4, ffn_dim=64,
                max_seq_len=64)
    return ModelConfig(**{**base, **kw})


# --- RoPE ------------------------------------------------------------------------------------
def _rotated(rope: RotaryPositions, x: torch.Tensor, pos: int) -> torch.Tensor:
    """x: (d,) rotated to position ``pos``."""
    x = x.view(1, 1, 1, -1)  # (B, H, T, d)
    out, _ = rope.rotate(x, x, torch.tensor([pos]))
    return out.view(-1)


@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_rope_scores_depend_only_on_offset(base):
    rope = RotaryPositions(cfg(position="rope", rope_base=base), causal=True)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)

    def score(m, n):
        return torch.dot(_rotated(rope, q, m), _rotated(rope, k, n)).item()

    for m, n in [(0, 0), (0, 3), (5, 2), (7, 30)]:
        for s in (1, 4, 17, 100):  # 100: beyond max_seq_len, the cos/sin table grows
            assert score(m + s, n + s) == pytest.approx(score(m, n), abs=1e-4)
    # and the score does change with the offset (the rotation is not the identity)
    assert abs(score(0, 1) - score(0, 5)) > 1e-3
    # position 0 is the identity
    torch.testing.assert_close(_rotated(rope, q, 0), q)


def test_rope_preserves_norms_and_matches_frequencies():
    rope = RotaryPositions(cfg(position="rope"), causal=True)
    d = 16
    torch.testing.assert_close(rope.inv_freq, torch.tensor([10000.0 ** (-2 * j / d) for j in range(d // 2)]))
    x = torch.randn(2, 4, 9, d)  # (B, H, T, d)
    q, k = rope.rotate(x, x[:, :2], torch.arange(3, 12))
    torch.testing.assert_close(q.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(k.norm(dim=-1), x[:, :2].norm(dim=-1))
    # pair (j, j + d/2) at position p is rotated by the angle p * theta_j (HF Llama layout)
    p, j = 5, 3
    v = torch.zeros(d)
    v[j] = 1.0
    out = _rotated(rope, v, p)
    angle = p * 10000.0 ** (-2 * j / d)
    assert out[j].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert out[j + d // 2].item() == pytest.approx(math.sin(angle), abs=1e-6)


def test_rope_matches_transformers_llama():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    rope = RotaryPositions(cfg(position="rope"), causal=True)
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16)
    pos = torch.arange(3, 10)
    angles = pos[:, None].float() * rope.inv_freq  # (T, d/2)
    emb = torch.cat([angles, angles], dim=-1)
    hq, hk = llama.apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None])
    oq, ok = rope.rotate(q, k, pos)
    torch.testing.assert_close(oq, hq)
    torch.testing.assert_close(ok, hk)


# --- ALiBi -----------------------------------------------------------------------------------
@pytest.mark.parametrize("h", [4, 8, 16])
def test_alibi_slopes_power_of_two(h):
    expected = torch.tensor([2.0 ** (-8.0 * i / h) for i in range(1, h + 1)])  # Press et al. 2022 §3
    torch.testing.assert_close(alibi_slopes(h), expected)


def test_alibi_slopes_non_power_of_two():
    """h = 12: the 8 slopes of h = 8, then the first 4 of every other slope of h = 16
    (2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5), the rule of the ALiBi reference code (ofirpress/attention_with_linear_biases)."""
    s = alibi_slopes(12)
    assert s.shape == (12,)
    assert ((s > 0) & (s < 1)).all()
    assert len(set(s.tolist())) == 12
    expected = [2.0 ** (-i) for i in range(1, 9)] + [2.0 ** (-(2 * i - 1) / 2) for i in range(1, 5)]
    torch.testing.assert_close(s, torch.tensor(expected))
    # each part decreases strictly; the interleaved tail starts above the first slope
    assert (s[:8].diff() < 0).all() and (s[8:].diff() < 0).all() and s[8] > s[0]


@pytest.mark.parametrize("h", [4, 6, 12, 16])
def test_alibi_slopes_match_transformers_bloom(h):
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    alibi = bloom.build_alibi_tensor(torch.ones(1, 2), h, torch.float32)  # (H, 1, T): slope * position
    torch.testing.assert_close(alibi_slopes(h), alibi[:, 0, 1])


@pytest.mark.parametrize("offset", [0, 3])
def test_alibi_bias_is_minus_slope_times_distance(offset):
    alibi = ALiBi(cfg(position="alibi"), causal=True)
    q_pos, k_pos = torch.arange(offset, offset + 4), torch.arange(offset + 4)
    bias = alibi.bias(q_pos, k_pos)
    assert bias.shape == (1, 4, 4, offset + 4)
    m = alibi_slopes(4)
    for h in range(4):
        for i, qi in enumerate(q_pos.tolist()):
            for j in k_pos.tolist():
                assert bias[0, h, i, j].item() == pytest.approx(-m[h].item() * abs(qi - j))


# --- T5 relative buckets ---------------------------------------------------------------------
def _t5_bucket(rel: int, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128) -> int:
    """Raffel et al. 2020 (Mesh TF ``_relative_position_bucket``), written out for one integer."""
    bucket = 0
    n = num_buckets
    if bidirectional:
        n //= 2
        if rel > 0:
            bucket += n
        dist = abs(rel)
    else:
        dist = max(-rel, 0)
    max_exact = n // 2
    if dist < max_exact:
        return bucket + dist
    large = max_exact + int(math.log(dist / max_exact) / math.log(max_distance / max_exact) * (n - max_exact))
    return bucket + min(large, n - 1)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
def test_relative_buckets_match_t5_formula(bidirectional):
    rb = RelativeBias(cfg(position="relative", relative_buckets=32, relative_max_distance=128),
                      causal=not bidirectional)
    rel = torch.arange(-300, 301)
    ours = rb.bucket(rel)
    ref = torch.tensor([_t5_bucket(r, bidirectional=bidirectional) for r in rel.tolist()])
    assert torch.equal(ours, ref)
    assert ours.min().item() == 0 and ours.max().item() == 31  # distances beyond 128 share the last bucket
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    hf = t5.T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=32,
                                                  max_distance=128)
    assert torch.equal(ours, hf)


def test_relative_bias_reads_the_bucket_table():
    rb = RelativeBias(cfg(position="relative", arch="encoder", head="mlm"), causal=False)
    q_pos, k_pos = torch.arange(2, 5), torch.arange(5)
    bias = rb.bias(q_pos, k_pos)  # (1, H, Tq, Tk)
    assert bias.shape == (1, 4, 3, 5)
    for i, qi in enumerate(q_pos.tolist()):
        for j in k_pos.tolist():
            b = _t5_bucket(j - qi, bidirectional=True)
            torch.testing.assert_close(bias[0, :, i, j], rb.bias_table.weight[b])


# --- absolute positions ----------------------------------------------------------------------
def test_sinusoidal_table_matches_vaswani():
    d = 64
    sin = SinusoidalPositions(cfg(position="sinusoidal", dim=d, max_seq_len=128), causal=False)
    for pos in (0, 1, 7, 50, 127):
        for i in (0, 1, 5, 31):
            angle = pos / 10000 ** (2 * i / d)
            assert sin.table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-4)  # PE(pos, 2i)
            assert sin.table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-4)  # PE(pos, 2i+1)
    x = torch.zeros(1, 3, d)
    torch.testing.assert_close(sin.add(x, torch.tensor([0, 5, 200])), sin._table(201)[[0, 5, 200]][None])


def test_learned_positions_use_offset():
    lp = LearnedPositions(cfg(position="learned", position_offset=2), causal=False)
    x = torch.zeros(1, 3, 64)
    torch.testing.assert_close(lp.add(x, torch.arange(3)), lp.weight[2:5][None])
    with pytest.raises(ValueError, match="position 64"):
        lp.add(x, torch.tensor([60, 61, 62]))


@pytest.mark.parametrize("rows, T", [(1, 1), (3, 1), (2, 7), (3, 2000), (2, 20000)],
                         ids=["one", "batch", "prompt", "long", "longer"])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared-positions", "per-row-positions"])
def test_rotating_fused_heads_in_place_equals_rotating_q_and_k(rows, T, per_row):
    """``rotation(...).heads`` (decoding's lean path: RoPE on the q and k heads of the fused projection, token-major,
    in place; a (d, d) matmul per position for few tokens, elementwise for many) equals rotating q and k apart, and
    leaves the value heads alone."""
    from pretune.model.fast.position import FastRotaryPositions

    rope = FastRotaryPositions(cfg(dim=32, n_heads=4, n_kv_heads=2), causal=True)
    H, Hkv, d = 4, 2, 8
    g = torch.Generator().manual_seed(T)
    y = torch.randn(rows, T, H + 2 * Hkv, d, generator=g)
    pos = (torch.randint(0, 50, (rows, 1), generator=g) + torch.arange(T)) if per_row else torch.arange(5, 5 + T)
    rotate = rope.rotation(pos)
    q, k = rotate(y[:, :, :H].transpose(1, 2), y[:, :, H:H + Hkv].transpose(1, 2), pos)
    v = y[:, :, H + Hkv:].clone()
    with torch.no_grad():
        out = rotate.heads(y, H + Hkv)
    # a matrix per position and head while they fit in 2^20 numbers (a new tensor); past that y is rotated in place
    assert (out is y) == ((rows if per_row else 1) * T * (H + 2 * Hkv) * d * d > 1 << 20)
    y = out
    torch.testing.assert_close(y[:, :, :H].transpose(1, 2), q, rtol=0, atol=1e-6)
    torch.testing.assert_close(y[:, :, H:H + Hkv].transpose(1, 2), k, rtol=0, atol=1e-6)
    assert torch.equal(y[:, :, H + Hkv:], v)


@pytest.mark.parametrize("rows, per_row", [(1, False), (3, False), (1, True), (3, True), (3000, True)],
                         ids=["one", "batch", "one-own-positions", "batch-own-positions", "too-many-matrices"])
def test_rotating_one_token_head_major_equals_heads_bitwise(rows, per_row):
    """``rotation(...).step`` (a decoding step: from the fused projection's output (B, 1, h * d) straight to
    head-major heads (B, h, 1, d)) gives exactly ``heads``' values, so a decoding step and the forward agree bitwise;
    past 2^20 matrix numbers it goes through ``heads``' elementwise path."""
    from pretune.model.fast.position import FastRotaryPositions

    rope = FastRotaryPositions(cfg(dim=32, n_heads=4, n_kv_heads=2), causal=True)
    H, Hkv, d = 4, 2, 8
    g = torch.Generator().manual_seed(rows)
    y = torch.randn(rows, 1, (H + 2 * Hkv) * d, generator=g)
    pos = torch.randint(0, 50, (rows, 1), generator=g) if per_row else torch.tensor([7])
    rotate = rope.rotation(pos)
    heads = y.unflatten(-1, (-1, d))
    q, k = rotate(heads[:, :, :H].transpose(1, 2), heads[:, :, H:H + Hkv].transpose(1, 2), pos)
    with torch.no_grad():
        want = rotate.heads(heads.clone(), H + Hkv).transpose(1, 2)
        got = rotate.step(y.clone(), H + Hkv, d)  # (may rotate its argument in place, as heads does)
    assert got.shape == (rows, H + 2 * Hkv, 1, d)
    assert torch.equal(got, want)
    torch.testing.assert_close(got[:, :H], q, rtol=0, atol=1e-6)
    torch.testing.assert_close(got[:, H:H + Hkv], k, rtol=0, atol=1e-6)
