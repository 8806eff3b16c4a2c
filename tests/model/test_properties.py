"""Invariants every variant must keep: shapes, backward, no look-ahead, padding does not leak,
KV-cache decoding equals a full forward pass; then the optional features one by one (prefix LM,
ALBERT factorisation and layer sharing, shared encoder-decoder, GQA, tying, token types).

The variant grid is arch x position x ffn x norm x norm_placement, thinned by a covering design:
every (position, ffn) pair appears with every arch, and norm / norm_placement alternate so that
every pair of values of any two axes appears with every arch (checked by test_covering_design).
"""

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

import pretune
from pretune import KVCache, ModelConfig, build_model, count_parameters

V = 100  # vocabulary
ARCHS = ("encoder", "decoder", "encoder-decoder")
POSITIONS = ("none", "sinusoidal", "learned", "relative", "alibi", "rope", "disentangled")
FFNS = ("relu", "gelu", "swish", "glu", "bilinear", "reglu", "geglu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
PLACEMENTS = ("pre", "post")
ATOL, RTOL = 1e-5, 1e-4


def _covering_design() -> list[tuple[str, str, str, str, str]]:
    rows = []
    for arch in ARCHS:
        for p, position in enumerate(POSITIONS):
            for f, ffn in enumerate(FFNS):
                rows.append((arch, position, ffn, NORMS[(p + f) % 2], PLACEMENTS[(p + f // 2) % 2]))
    return rows


COMBOS = _covering_design()
CAUSAL_COMBOS = [c for c in COMBOS if c[0] != "encoder"]


def _id(combo) -> str:
    return "-".join(combo)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices gain nothing from a second thread; on a loaded 2-core machine the thread
    hand-off makes a forward pass ~20x slower (40 ms instead of 2 ms)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(arch: str, **overrides) -> ModelConfig:
    """dim 32, 2 layers, 4 heads, vocab 100, no dropout; MLM head for encoders, LM head otherwise."""
    base = dict(arch=arch, vocab_size=V, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64,
                dropout=0.0, attn_dropout=0.0, head="mlm" if arch == "encoder" else "lm")
    return ModelConfig(**{**base, **overrides})


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Norm weights start at 1 and biases at 0: perturb every tensor so each one takes part in the test."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


@functools.cache
def _model(combo) -> pretune.TransformerLM:
    arch, position, ffn, norm, placement = combo
    torch.manual_seed(0)
    return perturbed(build_model(tiny(arch, position=position, ffn=ffn, norm=norm, norm_placement=placement)))


def ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


SRC = ids(2, 7, seed=2)  # encoder input of the encoder-decoder tests


def logits(model, tokens, mask=None, *, src=SRC, src_mask=None, **kw) -> torch.Tensor:
    """Logits over ``tokens``: the input of an encoder or decoder, the decoder input of an encoder-decoder."""
    if model.config.arch == "encoder-decoder":
        return model(src[: tokens.shape[0]], src_mask, decoder_input_ids=tokens,
                     decoder_attention_mask=mask, **kw).logits
    return model(tokens, mask, **kw).logits


def changed(tokens: torch.Tensor, t: int) -> torch.Tensor:
    out = tokens.clone()
    out[:, t] = out[:, t] % (V - 1) + 1  # a different non-pad token
    return out


def decode_in_chunks(model, tokens, chunks, *, src=SRC, **kw):
    """Feed ``tokens`` through the cache in pieces of the given lengths; concatenated logits and the cache."""
    cache, outs, s = None, [], 0
    for c in chunks:
        piece = tokens[:, s:s + c]
        if model.config.arch == "encoder-decoder":
            out = model(src[: tokens.shape[0]], decoder_input_ids=piece, past_key_values=cache, use_cache=True, **kw)
        else:
            out = model(piece, past_key_values=cache, use_cache=True, **kw)
        assert isinstance(out.past_key_values, KVCache)
        cache = out.past_key_values
        s += c
        assert cache.length == s
        outs.append(out.logits)
    return torch.cat(outs, dim=1), cache


# --------------------------------------------------------------------------------------------
def test_covering_design():
    axes = (POSITIONS, FFNS, NORMS, PLACEMENTS)
    for arch in ARCHS:
        rows = [c[1:] for c in COMBOS if c[0] == arch]
        for (i, a), (j, b) in itertools.combinations(enumerate(axes), 2):
            seen = {(r[i], r[j]) for r in rows}
            assert seen == set(itertools.product(a, b)), (arch, i, j)


@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_shapes(combo):
    model = _model(combo)
    tokens = ids(2, 6)
    with torch.no_grad():
        out = model(SRC, decoder_input_ids=tokens) if combo[0] == "encoder-decoder" else model(tokens)
    assert out.logits.shape == (2, 6, V)
    assert out.last_hidden_state.shape == (2, 6, 32)
    assert torch.isfinite(out.logits).all()
    assert out.past_key_values is None
    if combo[0] == "encoder-decoder":
        assert out.encoder_last_hidden_state.shape == (2, 7, 32)
    else:
        assert out.encoder_last_hidden_state is None
    for keep in (1, 4):  # logits for the last positions only: the same numbers as the full forward's
        with torch.no_grad():
            last = model(SRC, decoder_input_ids=tokens, logits_to_keep=keep) if combo[0] == "encoder-decoder" \
                else model(tokens, logits_to_keep=keep)
        torch.testing.assert_close(last.logits, out.logits[:, -keep:], atol=ATOL, rtol=RTOL)
        assert last.last_hidden_state.shape == (2, 6, 32)


@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_backward_reaches_every_parameter(combo):
    model = _model(combo)
    tokens = ids(2, 6)
    try:
        loss = F.cross_entropy(logits(model, tokens).reshape(-1, V), ids(2, 6, seed=3).reshape(-1))
        loss.backward()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            assert p.grad is not None, f"{name} got no gradient"
            assert torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"
    finally:
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("combo", CAUSAL_COMBOS, ids=_id)
def test_no_look_ahead(combo):
    """Changing token t+1 leaves logits at positions <= t unchanged (and does change position t+1)."""
    model = _model(combo)
    tokens = ids(2, 6)
    with torch.no_grad():
        ref = logits(model, tokens)
        for t in range(tokens.shape[1] - 1):
            out = logits(model, changed(tokens, t + 1))
            torch.testing.assert_close(out[:, : t + 1], ref[:, : t + 1], atol=ATOL, rtol=RTOL)
            assert (out[:, t + 1] - ref[:, t + 1]).abs().max() > 1e-4


@pytest.mark.parametrize("combo", [c for c in COMBOS if c[0] != "decoder"], ids=_id)
def test_bidirectional_input_is_seen_whole(combo):
    """The encoder is not causal: the last input token changes the output at position 0."""
    model = _model(combo)
    with torch.no_grad():
        if combo[0] == "encoder":
            tokens = ids(2, 6)
            a, b = logits(model, tokens), logits(model, changed(tokens, 5))
        else:
            tokens = ids(2, 4)
            a, b = logits(model, tokens), logits(model, tokens, src=changed(SRC, 6))
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-4


@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_right_padding_does_not_leak(combo):
    """Row 1 is 4 real tokens then 3 pads (random ids, so a leak would show); its real positions
    equal the same 4 tokens run alone. Row 0 (no padding) equals itself run alone."""
    model = _model(combo)
    arch = combo[0]
    T, L = (6, 3) if arch == "encoder-decoder" else (7, 4)
    tokens = ids(2, T)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, L:] = 0
    src_mask = torch.ones(2, 7, dtype=torch.long)
    src_mask[1, 4:] = 0
    with torch.no_grad():
        if arch == "encoder-decoder":
            batch = logits(model, tokens, mask, src_mask=src_mask)
            alone1 = logits(model, tokens[1:, :L], src=SRC[1:, :4])
            alone0 = logits(model, tokens[:1], src=SRC[:1])
        else:
            batch = logits(model, tokens, mask)
            alone1 = logits(model, tokens[1:, :L])
            alone0 = logits(model, tokens[:1])
    torch.testing.assert_close(batch[1, :L], alone1[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(batch[0], alone0[0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("chunks", [(1, 1, 1, 1, 1, 1), (3, 1, 2)], ids=["one-by-one", "3-1-2"])
@pytest.mark.parametrize("combo", CAUSAL_COMBOS, ids=_id)
def test_kv_cache_equals_full_forward(combo, chunks):
    model = _model(combo)
    tokens = ids(2, 6)
    cross_k_calls = []
    hooks = []
    if combo[0] == "encoder-decoder":
        for block in model.transformer.decoder.layers:
            hooks.append(block.cross_attn.k_proj.register_forward_hook(lambda *a: cross_k_calls.append(1)))
    try:
        with torch.no_grad():
            full = logits(model, tokens)
            cross_k_calls.clear()  # count the cached decoding only
            if combo[0] == "encoder-decoder":
                cache, outs, first_cross = None, [], None
                s = 0
                for c in chunks:
                    out = model(SRC, decoder_input_ids=tokens[:, s:s + c], past_key_values=cache, use_cache=True)
                    cache, s = out.past_key_values, s + c
                    outs.append(out.logits)
                    cross = [(lc.cross_k, lc.cross_v) for lc in cache.layers]
                    if first_cross is None:
                        first_cross = cross
                    for (k0, v0), (k, v) in zip(first_cross, cross, strict=True):
                        assert k is k0 and v is v0  # cross-attention K/V computed once, then reused
                inc = torch.cat(outs, dim=1)
                assert len(cross_k_calls) == model.config.n_layers  # once per layer, not per step
            else:
                inc, cache = decode_in_chunks(model, tokens, chunks)
    finally:
        for h in hooks:
            h.remove()
    assert len(cache.layers) == model.config.n_layers
    assert cache.length == 6
    torch.testing.assert_close(inc, full, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------------------------
# Features beyond the grid


def _built(cfg: ModelConfig, seed: int = 0) -> pretune.TransformerLM:
    torch.manual_seed(seed)
    return perturbed(build_model(cfg), seed)


@pytest.mark.parametrize("P", [1, 3, 5])
@pytest.mark.parametrize("position", ["none", "learned", "relative", "alibi", "rope"])
def test_prefix_lm_masking(position, P):
    """Prefix LM: tokens inside the prefix attend to the whole prefix (but nothing after it);
    tokens after the prefix attend causally."""
    model = _built(tiny("decoder", position=position))
    tokens = ids(1, 8)
    pl = torch.tensor([P])
    with torch.no_grad():
        ref = logits(model, tokens, prefix_lengths=pl)
        if P > 1:  # the last prefix token is seen by the first one
            later = logits(model, changed(tokens, P - 1), prefix_lengths=pl)
            assert (later[:, 0] - ref[:, 0]).abs().max() > 1e-4
        for t in range(P, 8):  # a token after the prefix is invisible to every earlier position
            out = logits(model, changed(tokens, t), prefix_lengths=pl)
            torch.testing.assert_close(out[:, :t], ref[:, :t], atol=ATOL, rtol=RTOL)
            assert (out[:, t] - ref[:, t]).abs().max() > 1e-4
        causal = logits(model, tokens)
        torch.testing.assert_close(logits(model, tokens, prefix_lengths=torch.tensor([0])), causal,
                                   atol=ATOL, rtol=RTOL)
        # a 1-token prefix is plain causal attention; a longer one changes position 0, which now sees the prefix
        if P == 1:
            torch.testing.assert_close(ref, causal, atol=ATOL, rtol=RTOL)
        else:
            assert (ref[:, 0] - causal[:, 0]).abs().max() > 1e-4


@pytest.mark.parametrize("position", ["learned", "relative", "alibi", "rope"])
def test_prefix_lm_batch_and_cache(position):
    """Rows with different prefix lengths equal the rows run alone; decoding after the prefix
    with a cache (prefix in one chunk, then one token at a time) equals the full forward."""
    model = _built(tiny("decoder", position=position))
    tokens = ids(2, 8)
    with torch.no_grad():
        batch = logits(model, tokens, prefix_lengths=torch.tensor([4, 2]))
        torch.testing.assert_close(batch[:1], logits(model, tokens[:1], prefix_lengths=torch.tensor([4])),
                                   atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(batch[1:], logits(model, tokens[1:], prefix_lengths=torch.tensor([2])),
                                   atol=ATOL, rtol=RTOL)
        pl = torch.tensor([4, 4])
        full = logits(model, tokens, prefix_lengths=pl)
        inc, _ = decode_in_chunks(model, tokens, (4, 1, 1, 1, 1), prefix_lengths=pl)
    torch.testing.assert_close(inc, full, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rope"])
@pytest.mark.parametrize("arch", ARCHS)
def test_albert_factorised_embeddings(arch, position):
    cfg = tiny(arch, position=position, embed_dim=16)
    model = _built(cfg)
    full_width = build_model(tiny(arch, position=position))
    emb = model.transformer.embed.weight
    assert emb.shape == (V, 16)
    assert count_parameters(model)["embed"] == V * 16 < count_parameters(full_width)["embed"]
    for stack in (model.transformer.encoder, model.transformer.decoder):
        if stack is not None:
            assert (stack.embed_proj.in_features, stack.embed_proj.out_features) == (16, 32)
    tokens = ids(2, 6)
    out = logits(model, tokens)
    assert out.shape == (2, 6, V)
    out.square().mean().backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    if arch != "encoder":
        with torch.no_grad():
            inc, _ = decode_in_chunks(model, tokens, (3, 1, 2))
            torch.testing.assert_close(inc, logits(model, tokens), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_share_layers(arch):
    """ALBERT cross-layer sharing: one block per stack, applied n_layers times."""
    shared = _built(tiny(arch, share_layers=True, n_layers=3))
    unshared = build_model(tiny(arch, n_layers=3))
    stacks = [s for s in (shared.transformer.encoder, shared.transformer.decoder) if s is not None]
    block_params = 0
    for stack in stacks:
        assert len(stack.layers) == 1 and stack.n_layers == 3
        block_params += count_parameters(stack.layers[0])["total"]
    assert count_parameters(unshared)["total"] - count_parameters(shared)["total"] == 2 * block_params
    # the same weights applied once give a different output: the block really runs 3 times
    once = build_model(tiny(arch, share_layers=True, n_layers=1))
    once.load_state_dict(shared.state_dict())
    once.eval()
    tokens = ids(2, 6)
    with torch.no_grad():
        assert (logits(shared, tokens) - logits(once, tokens)).abs().max() > 1e-4
        if arch != "encoder":
            inc, cache = decode_in_chunks(shared, tokens, (3, 1, 2))
            assert len(cache.layers) == 3  # one cache entry per application, not per distinct block
            torch.testing.assert_close(inc, logits(shared, tokens), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("position", ["relative", "learned"])
def test_share_encoder_decoder(position):
    model = _built(tiny("encoder-decoder", position=position, share_encoder_decoder=True))
    unshared = build_model(tiny("encoder-decoder", position=position))
    enc, dec = model.transformer.encoder, model.transformer.decoder
    saved = 0
    for e, d in zip(enc.layers, dec.layers, strict=True):
        assert d.attn is e.attn and d.ffn is e.ffn and d.attn_norm is e.attn_norm and d.ffn_norm is e.ffn_norm
        assert d.cross_attn is not None
        saved += sum(count_parameters(m)["total"] for m in (e.attn, e.ffn, e.attn_norm, e.ffn_norm))
    assert count_parameters(unshared)["total"] - count_parameters(model)["total"] == saved
    tokens = ids(2, 6)
    loss = logits(model, tokens).square().mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        full = logits(model, tokens)
        out, s, cache = [], 0, None
        for c in (3, 1, 2):
            o = model(SRC, decoder_input_ids=tokens[:, s:s + c], past_key_values=cache, use_cache=True)
            cache, s = o.past_key_values, s + c
            out.append(o.logits)
    torch.testing.assert_close(torch.cat(out, 1), full, atol=ATOL, rtol=RTOL)


def _expand_kv_heads(state: dict, n_rep: int, dh: int) -> dict:
    """GQA weights -> equivalent MHA weights: kv head j serves query heads j*n_rep .. j*n_rep+n_rep-1."""
    out = {}
    for k, t in state.items():
        if ("k_proj" in k or "v_proj" in k) and t.dim() >= 1:
            rest = t.shape[1:]
            t = t.view(-1, dh, *rest).repeat_interleave(n_rep, dim=0).reshape(-1, *rest)
        out[k] = t
    return out


@pytest.mark.parametrize("position", ["rope", "relative", "alibi", "learned"])
@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder", "encoder"])
def test_grouped_query_attention(arch, position):
    cfg = tiny(arch, position=position, n_kv_heads=2)
    model = _built(cfg)
    blocks = (model.transformer.decoder or model.transformer.encoder).layers
    assert blocks[0].attn.k_proj.out_features == 2 * 8 and blocks[0].attn.q_proj.out_features == 4 * 8
    mha = build_model(tiny(arch, position=position))
    mha.load_state_dict(_expand_kv_heads(model.state_dict(), n_rep=2, dh=8))
    mha.eval()
    tokens = ids(2, 6)
    with torch.no_grad():
        full = logits(model, tokens)
        torch.testing.assert_close(full, logits(mha, tokens), atol=ATOL, rtol=RTOL)
        if arch == "encoder":
            return
        inc, cache = decode_in_chunks(model, tokens, (3, 1, 2))
    assert cache.layers[0].self_k.shape == (2, 2, 6, 8)  # (B, Hkv, T, Dh)
    if arch == "encoder-decoder":
        assert cache.layers[0].cross_k.shape == (2, 2, 7, 8)
    torch.testing.assert_close(inc, full, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("embed_dim", [None, 16])
def test_tied_and_untied_embeddings(arch, embed_dim):
    tied = build_model(tiny(arch, embed_dim=embed_dim, tie_embeddings=True))
    untied = build_model(tiny(arch, embed_dim=embed_dim, tie_embeddings=False))
    assert tied.head.weight is tied.transformer.embed.weight
    assert untied.head.weight is not untied.transformer.embed.weight
    assert untied.head.weight.shape == untied.transformer.embed.weight.shape == (V, embed_dim or 32)
    assert count_parameters(untied)["total"] - count_parameters(tied)["total"] == V * (embed_dim or 32)
    # tied: changing the embedding row of a token no input uses changes that token's logit only;
    # untied: it changes nothing
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    for model, moves in ((tied, True), (untied, False)):
        with torch.no_grad():
            before = logits(model, tokens)
            model.transformer.embed.weight[V - 1] += torch.randn(embed_dim or 32)  # not constant: LayerNorm
            after = logits(model, tokens)
        torch.testing.assert_close(after[..., : V - 1], before[..., : V - 1])
        assert ((after[..., V - 1] - before[..., V - 1]).abs().max() > 1e-3) == moves


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
def test_token_type_ids_change_encoder_outputs(arch):
    model = _built(tiny(arch, token_types=2))
    src = ids(2, 6) if arch != "encoder-decoder" else SRC
    types = torch.zeros_like(src)
    types[:, 3:] = 1
    kw = dict(decoder_input_ids=ids(2, 4)) if arch == "encoder-decoder" else {}
    with torch.no_grad():
        default = model(src, **kw)
        zeros = model(src, token_type_ids=torch.zeros_like(src), **kw)
        segs = model(src, token_type_ids=types, **kw)
    enc = "encoder_last_hidden_state" if arch == "encoder-decoder" else "last_hidden_state"
    torch.testing.assert_close(getattr(zeros, enc), getattr(default, enc))  # None means all zeros
    assert (getattr(segs, enc)[:, 3:] - getattr(default, enc)[:, 3:]).abs().max() > 1e-4
    assert (segs.logits - default.logits).abs().max() > 1e-4


def test_no_position_encoder_is_permutation_equivariant():
    """position='none' with a bidirectional encoder: a bag of tokens (permuting inputs permutes outputs)."""
    model = _built(tiny("encoder", position="none"))
    tokens = ids(1, 6)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    with torch.no_grad():
        out = logits(model, tokens)
        torch.testing.assert_close(logits(model, tokens[:, perm]), out[:, perm], atol=ATOL, rtol=RTOL)
        learned = _built(tiny("encoder", position="learned"))
        assert (logits(learned, tokens[:, perm]) - logits(learned, tokens)[:, perm]).abs().max() > 1e-4


def test_token_type_ids_without_a_segment_table_is_an_error():
    model = _built(tiny("decoder", token_types=0))
    with pytest.raises(ValueError, match="token_types=0"):
        model(ids(1, 4), token_type_ids=torch.zeros(1, 4, dtype=torch.long))


def test_prefix_lengths_on_an_encoder_is_an_error():
    model = _built(tiny("encoder"))
    with pytest.raises(ValueError, match="prefix_lengths"):
        model(ids(1, 4), prefix_lengths=torch.tensor([2]))
