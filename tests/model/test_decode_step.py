"""The flat decoding step (model/decode_step.py): which models get it, and that it computes exactly what the model's
forward computes — bitwise with the forward's kernels (``exact=True``), to fp32 rounding with oneDNN's matrix-vector
kernel for the products (the default in fp32 on CPU) — for every family it accepts, on left-padded batches;
generation through it gives the tokens generation through the forward gives (greedy, sampling, beam search)."""

from __future__ import annotations

import pytest
import torch
from decoder_fixtures import V, ids, perturbed

import pretune.generation.decode as decode
import pretune.model.fast.decode_step as decode_step
from pretune import KVCache, ModelConfig, peft
from pretune.generation import generate
from pretune.model.fast.decode_step import FlatDecoder, _why_not


def tiny(**kw) -> ModelConfig:
    base = dict(arch="decoder", head="lm", vocab_size=V, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48,
                max_seq_len=64, dropout=0.0, attn_dropout=0.0, position="rope", norm="rmsnorm", norm_eps=1e-6,
                norm_placement="pre", ffn="swiglu", bias=False, embed_norm=False, token_types=0)
    return ModelConfig(**{**base, **kw})


FAMILIES = {  # what each family changes in the decoding step
    "llama": {},
    "llama-untied": dict(tie_embeddings=False),
    "qwen2": dict(qkv_bias=True),  # biases on q/k/v only
    "gemma": dict(norm="rmsnorm_plus_one", scale_embeddings=True, ffn="geglu_tanh", head_dim=12),
    "mistral": dict(sliding_window=4),  # every layer local; rows below are longer than the window
    "alternating-window": dict(sliding_window=4, sliding_layers=[0, 2], rope_local_base=100.0),
    "gpt2": dict(position="learned", norm="layernorm", norm_eps=1e-5, ffn="gelu_tanh", bias=True, n_kv_heads=None),
    "no-positions": dict(position="none", ffn="relu"),
    "qwen3": dict(qk_norm=True, head_dim=12),  # RMSNorm on each head's q and k, head_dim apart from dim / heads
    "gemma2": dict(norm="rmsnorm_plus_one", scale_embeddings=True, ffn="geglu_tanh", head_dim=12,
                   norm_placement="sandwich", attn_softcap=50.0, logit_softcap=30.0, sliding_window=4,
                   sliding_layers=[0, 2]),
}


def _padded(B=3, T=7):
    x = ids(B, T)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1:2, :3] = 0  # left padding (rows that exist)
    mask[2:3, :1] = 0
    return x, mask


PEFT = {  # methods that change the step's parts: each goes through the wrapped part's own method
    "lora-all-linear": dict(method="lora", r=2, targets=["all-linear"]),
    "lora-qv-dora": dict(method="lora", r=2, dora=True),
    "lora-bf16-base": dict(method="lora", r=2, targets=["all-linear"], base_dtype="bf16"),
    "ia3": dict(method="ia3"),
    "adapter": dict(method="adapter", reduction_factor=4),
    "bitfit": dict(method="bitfit"),
}


def _model(family: str):
    if family.startswith("peft:"):
        model = perturbed(tiny(**FAMILIES["qwen2"]))
        peft.inject(model, peft.PeftConfig(**PEFT[family[5:]]), seed=0)
        with torch.no_grad():  # LoRA's B and the adapters' up projections start at 0: make them count
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype) * 0.1)
        return model.eval()
    return perturbed(tiny(**FAMILIES[family]))


def _assert_steps_bitwise(model, *, steps=6, autocast=False, dtype=None, batch=3, exact=True, bitwise=True):
    """Prompt a left-padded batch into two caches, then decode ``steps`` tokens (past the sliding window) through
    the forward and through the flat step (``FlatDecoder.of(model, exact)``): the logits must be equal, bitwise
    (or, with ``bitwise=False``, to fp32 rounding)."""
    x, mask = _padded(batch)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ours, theirs = model.new_cache(16), model.new_cache(16)
        for cache in (ours, theirs):
            model(x, mask, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        flat = FlatDecoder.of(model, exact)
        token, p = x[:, -1:], pos[:, -1:]
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], 1)
            p = p + 1
            want = model(token, mask, position_ids=p, past_key_values=theirs, use_cache=True,
                         logits_to_keep=1).logits[:, -1]
            got = flat.step(token, ours, mask, p)
            assert dtype is None or got.dtype == want.dtype == dtype
            if bitwise:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            token = want.argmax(-1, keepdim=True)
    assert ours.length == theirs.length == 7 + steps


@pytest.mark.parametrize("batch", [3, 1])
@pytest.mark.parametrize("family", sorted(FAMILIES) + [f"peft:{m}" for m in sorted(PEFT)])
def test_flat_step_is_bitwise_the_forward_with_a_cache(family, batch):
    model = _model(family)
    assert _why_not(model) is None
    _assert_steps_bitwise(model, autocast="bf16-base" in family, batch=batch)  # (a bf16 base runs under autocast)


def _count_onednn(monkeypatch) -> list:
    """Shapes of the weights the flat step multiplies through oneDNN's kernel, in order."""
    calls, real = [], decode_step._LINEAR_POINTWISE
    assert real is not None, "this torch has no oneDNN linear"
    monkeypatch.setattr(decode_step, "_LINEAR_POINTWISE",
                        lambda x, w, *a: calls.append(tuple(w.shape)) or real(x, w, *a))
    return calls


@pytest.mark.parametrize("batch", [3, 1])
@pytest.mark.parametrize("family", sorted(FAMILIES) + [f"peft:{m}" for m in sorted(PEFT)])
def test_flat_step_with_onednn_products_is_the_forward_to_fp32_rounding(family, batch, monkeypatch):
    """The default step (fp32, CPU): the plain projections and a plain LM head through oneDNN's matrix-vector
    kernel, the same products summed in another order; the rest as the exact step."""
    model = _model(family)
    calls = _count_onednn(monkeypatch)
    _assert_steps_bitwise(model, autocast="bf16-base" in family, batch=batch, exact=False,
                          bitwise="bf16-base" in family)  # (under autocast: the forward's kernels, bitwise)
    if "bf16-base" in family:
        assert calls == []
    else:
        assert calls and all(len(shape) == 2 for shape in calls)


def _plain_products(cfg: ModelConfig, head: bool) -> list:
    """The (out, in) weights of one step's plain products: per layer stacked q/k/v, o, stacked gate/up, down."""
    dh = cfg.head_dim or cfg.dim // cfg.n_heads
    qkv = (cfg.n_heads + 2 * (cfg.n_kv_heads or cfg.n_heads)) * dh
    layer = [(qkv, cfg.dim), (cfg.dim, cfg.n_heads * dh), (2 * cfg.ffn_dim, cfg.dim), (cfg.dim, cfg.ffn_dim)]
    return layer * cfg.n_layers + ([(cfg.vocab_size, cfg.dim)] if head else [])


@pytest.mark.parametrize("family,what", [("llama", "all"), ("qwen2", "all"), ("gemma2", "layers"),
                                         ("peft:lora-all-linear", "head")])
def test_which_products_go_through_onednn(family, what, monkeypatch):
    """Every plain product of a step and a plain LM head; not a soft-capped head (Gemma 2) nor a LoRA-wrapped
    projection (each runs its own forward); nothing at all under bf16 autocast or with exact=True."""
    model = _model(family)
    cfg = model.config
    calls = _count_onednn(monkeypatch)
    _assert_steps_bitwise(model, steps=2, batch=1, exact=False, bitwise=False)
    want = {"all": _plain_products(cfg, head=True), "layers": _plain_products(cfg, head=False),
            "head": [(cfg.vocab_size, cfg.dim)]}[what]
    assert calls == want * 2
    calls.clear()
    _assert_steps_bitwise(model, steps=2, batch=1, exact=True)
    _assert_steps_bitwise(model, steps=2, batch=1, exact=False, autocast=True)
    assert calls == []


def test_a_torch_without_onednn_takes_the_forward_kernels(monkeypatch):
    monkeypatch.setattr(decode_step, "_LINEAR_POINTWISE", None)
    model = _model("llama")
    assert not FlatDecoder.of(model).onednn
    _assert_steps_bitwise(model, steps=2, batch=1, exact=False)  # bitwise: nothing else to run


@pytest.mark.parametrize("family,rows", [("llama", True), ("gemma2", True), ("qwen3", True), ("gpt2", False)])
def test_one_row_steps_carry_the_residual_as_signed_rows_where_every_norm_is_an_rmsnorm(family, rows, monkeypatch):
    """Batch 1 with RMSNorms only: the residual stream is (x, -x), each residual sum one addcmul with the signs and
    each norm a layer_norm over those rows (the values stay bitwise the forward's: the test above)."""
    model = _model(family)
    calls = []
    real = torch.addcmul
    monkeypatch.setattr(torch, "addcmul", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    _assert_steps_bitwise(model, steps=2, batch=1)
    n = model.config.n_layers
    assert calls == ([(1, 2, model.config.dim)] * 2 * n * 2 if rows else [])
    calls.clear()
    _assert_steps_bitwise(model, steps=2, batch=3)  # more rows: the forward's own norms and sums
    assert calls == []


def test_flat_step_without_padding_or_positions_given():
    model = perturbed(tiny())
    x = ids(2, 5)
    with torch.inference_mode():
        ours, theirs = model.new_cache(), model.new_cache()  # no reserved capacity: the buffers grow
        for cache in (ours, theirs):
            model(x, past_key_values=cache, use_cache=True)
        flat = FlatDecoder.of(model, exact=True)
        for t in range(4):
            token = x[:, t:t + 1]
            want = model(token, past_key_values=theirs, use_cache=True).logits[:, -1]
            assert torch.equal(flat.step(token, ours), want)


NOT_FLAT = {
    "post-norm": dict(norm_placement="post"),
    "ALiBi": dict(position="alibi"),
    "T5 relative buckets": dict(position="relative"),
}


@pytest.mark.parametrize("what", sorted(NOT_FLAT))
def test_models_the_flat_step_does_not_cover_decode_through_the_forward(what):
    model = perturbed(tiny(**NOT_FLAT[what]))
    assert _why_not(model) is not None and FlatDecoder.of(model) is None


def test_training_mode_hooks_prefixes_and_soft_prompts_keep_the_forward():
    model = perturbed(tiny())
    assert FlatDecoder.of(model) is not None
    model.train()
    assert "training" in _why_not(model)
    model.eval()
    handle = model.transformer.decoder.layers[1].ffn.register_forward_hook(lambda *a: None)
    assert "hook" in _why_not(model)
    handle.remove()
    assert _why_not(model) is None
    for method in ("prefix", "prompt"):  # extra keys in every layer / extra input positions
        wrapped = perturbed(tiny())
        peft.inject(wrapped, peft.PeftConfig(method=method, n_virtual=3), seed=0)
        assert FlatDecoder.of(wrapped.eval()) is None, method
    encdec = perturbed(tiny(arch="encoder-decoder", n_decoder_layers=2, position="relative"))
    assert FlatDecoder.of(encdec) is None


@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=20, seed=3), dict(num_beams=3)],
                         ids=["greedy", "sampling", "beam"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral", "qwen3", "gemma2", "peft:lora-all-linear",
                                    "peft:adapter"])
def test_generate_takes_the_flat_step_and_gives_the_same_tokens(monkeypatch, family, kwargs):
    model = _model(family)
    x, mask = _padded()
    steps = []
    real_step = FlatDecoder.step

    def counted(self, *a, **k):
        steps.append(1)
        return real_step(self, *a, **k)

    monkeypatch.setattr(FlatDecoder, "step", counted)
    fast = generate(model, x, mask, max_new_tokens=8, min_new_tokens=8, **kwargs)
    assert len(steps) == 7  # every step after the prompt
    monkeypatch.setattr(decode.FlatDecoder, "of", staticmethod(lambda m: None))
    plain = generate(model, x, mask, max_new_tokens=8, min_new_tokens=8, **kwargs)
    assert len(steps) == 7
    assert torch.equal(fast, plain)


def test_write_heads_is_append_tokens_for_one_token():
    from pretune.model.fast.cache import FastLayerCache as LayerCache

    a, b = LayerCache(capacity=6), LayerCache(capacity=6)
    first = torch.randn(2, 3, 4, 5)
    a.append_tokens(first)
    b.append_tokens(first)
    for _ in range(5):  # the fourth write outgrows the capacity: write_heads falls back and grows
        kv = torch.randn(2, 1, 4, 5)  # token-major (B, 1, 2 Hkv, Dh); write_heads takes it head-major
        ka, va = a.append_tokens(kv)
        kb, vb = b.write_heads(kv.transpose(1, 2))
        assert torch.equal(ka, kb) and torch.equal(va, vb) and kb.shape == (2, 2, a.length, 5)
    b.reorder(torch.tensor([1, 0]))
    a.reorder(torch.tensor([1, 0]))
    kv = torch.randn(2, 1, 4, 5)
    assert all(torch.equal(p, q) for p, q in zip(a.append_tokens(kv), b.write_heads(kv.transpose(1, 2))))


# Every ModelConfig field, with what the flat step does about it. A new field fails this test until it is added
# here — after checking that FlatDecoder either computes it as the forward does or refuses it in _why_not.
CONSIDERED = {
    # the same in the flat step as in the forward (it reads the modules the field built)
    "dim", "n_heads", "n_kv_heads", "head_dim", "n_layers", "ffn", "ffn_dim", "bias", "qkv_bias", "norm",
    "norm_eps", "norm_bias", "vocab_size", "tie_embeddings", "tied_logit_scale", "logit_bias", "logit_softcap",
    "embed_dim", "scale_embeddings", "position", "position_offset", "max_seq_len", "rope_base", "rope_scaling",
    "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len",
    "rope_local_base", "sliding_window", "sliding_layers", "share_layers", "first_attn_norm", "attn_scale",
    # inactive at inference, or outside one decoding step of a decoder's LM logits
    "dropout", "attn_dropout", "classifier_dropout", "pad_token_id", "eos_token_id", "decoder_start_token_id",
    "forced_bos_token_id", "forced_eos_token_id", "decoder_layout", "pooler", "pooling", "pair_head",
    "num_labels", "labels", "multi_label", "cls_act", "task_stack", "head_act", "head_dense_bias",
    "head_transform", "n_decoder_layers", "decoder_heads", "decoder_ffn_dim",
    "share_encoder_decoder", "relative_buckets", "relative_max_distance",
    "max_relative_positions", "position_buckets",
    "attn_softcap", "qk_norm",  # through the attention's own methods
    # refused by _why_not (checked on the modules they build) where they change the step
    "arch", "head", "norm_placement", "embed_norm", "token_types",
}


def test_every_config_field_is_considered_by_the_flat_step():
    import dataclasses

    assert {f.name for f in dataclasses.fields(ModelConfig)} == CONSIDERED


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
@pytest.mark.parametrize("precision", ["bf16-weights", "bf16-autocast"])
def test_flat_step_is_bitwise_the_forward_in_bf16(family, precision):
    model = perturbed(tiny(**FAMILIES[family]))
    if precision == "bf16-weights":
        model = model.to(torch.bfloat16)
    _assert_steps_bitwise(model, steps=5, autocast=precision == "bf16-autocast", dtype=torch.bfloat16)


def test_under_autocast_the_flat_step_casts_the_plain_weights_once_per_generation(monkeypatch):
    """Under bf16 autocast the output projections, FFNs and LM head are cast once for the generation (autocast
    would cast the fp32 weights every step), and every step's products run on those bf16 copies."""
    model = perturbed(tiny())
    flat = FlatDecoder.of(model)
    seen = []
    real = decode_step.F.linear
    monkeypatch.setattr(decode_step.F, "linear", lambda x, w, b=None: seen.append(w) or real(x, w, b))
    casts = []
    monkeypatch.setattr(flat, "_plain_weights", lambda c, real=flat._plain_weights: casts.append(c) or real(c))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = KVCache()
        model(ids(2, 4), past_key_values=cache, use_cache=True)
        for _ in range(3):
            flat.step(ids(2, 1), cache)
    layers, head = flat._casts[torch.bfloat16]
    assert casts == [torch.bfloat16] * 3 and list(flat._casts) == [torch.bfloat16]  # built once, reused
    cached = {id(t) for layer in layers for t in layer if t is not None} | {id(head[0])}
    assert all(t.dtype == torch.bfloat16 for layer in layers for t in layer if t is not None)
    assert head[0].dtype == torch.bfloat16 and model.head.weight.dtype == torch.float32
    # per step: o, FFN up and down per layer and the head from the cache (q/k/v: the stacked weights' own cache)
    per_step = [w for w in seen if id(w) in cached]
    assert len(per_step) == 3 * (3 * len(layers) + 1)


def test_flat_step_takes_one_token_after_the_prompt():
    model = perturbed(tiny())
    flat = FlatDecoder.of(model)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="after the prompt"):
            flat.step(ids(2, 1), KVCache())  # nothing cached yet
        cache = KVCache()
        model(ids(2, 4), past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="one new token"):
            flat.step(ids(2, 3), cache)
