"""Decoding (generation.decode, generation.beam): token-for-token parity with transformers' generate on imported
random-weight GPT-2, Llama and T5 (greedy, beam search, length penalty, several EOS ids, left-padded batches),
cache == no cache, seeded sampling, batched == one by one, stop strings, streaming, the KV cache, bad input and
``pretune generate``."""

from __future__ import annotations

import json

import pytest
import torch

import pretune
from conftest import _has_cxx, requires_cxx
from pretune.cli import main
from pretune.generation import GenerationError, generate
from pretune.model import KVCache

T = pytest.importorskip("transformers")

V = 99
NEW = 10


def _hf_models():
    return {
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                       bos_token_id=0, eos_token_id=0)),
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0, pad_token_id=0)),
        "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=V, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0,
            eos_token_id=1, pad_token_id=0)),
    }


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """family -> (transformers model, the same weights imported with pretune.from_hf)."""
    out = {}
    for name, make in _hf_models().items():
        torch.manual_seed(0)
        hf = make()
        g = torch.Generator().manual_seed(0)
        scale = 0.2 if name == "t5" else 0.05  # less and the tiny T5 writes one token over and over
        with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb every tensor
            for p in hf.parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)
        d = tmp_path_factory.mktemp(name)
        hf.eval().save_pretrained(d)
        out[name] = (hf, pretune.from_hf(d))
    return out


def _batch(family: str):
    """Three prompts of 7 tokens: decoders left-padded (rows 1 and 2 shorter), the encoder input right-padded."""
    ids = torch.randint(3, V, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if family == "t5":
        mask[1, 5:] = 0
        mask[2, 3:] = 0
    else:
        mask[1, :2] = 0
        mask[2, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _hf_generate(hf, ids, mask, **kw):
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, do_sample=False, **kw)


def _eos(hf, ids, mask, family) -> int:
    """An EOS id that greedy decoding of row 0 meets at its 3rd new token, so that sequences end early."""
    start = 1 if family == "t5" else ids.shape[1]
    probe = _hf_generate(hf, ids, mask, max_new_tokens=4, min_new_tokens=4, eos_token_id=None, pad_token_id=2)
    return int(probe[0, start + 2])


SETTINGS = {  # name: (generate options, whether some returned sequence ends before max_new_tokens)
    "greedy": ({}, True),
    "beam4": (dict(num_beams=4), False),
    "beam4-two-lp": (dict(num_beams=4, num_return_sequences=2, length_penalty=0.6), True),
    "beam3-early-negative-lp": (dict(num_beams=3, early_stopping=True, length_penalty=-0.5), True),
    "beam3-never-lp2": (dict(num_beams=3, early_stopping="never", length_penalty=2.0, num_return_sequences=3), False),
}


@pytest.mark.parametrize("static_cache", [False, True], ids=["cache", "static-cache"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_same_tokens_as_transformers(pair, family, setting, static_cache):
    """Also with the fixed-shape cache that compile=True decodes with (masked attention over every column)."""
    hf, ours = pair[family]
    ids, mask = _batch(family)
    eos = _eos(hf, ids, mask, family)
    options, ends_early = SETTINGS[setting]
    kw = dict(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=2, **options)
    want = _hf_generate(hf, ids, mask, **kw)
    got = generate(ours, ids, mask, static_cache=static_cache, **kw)
    assert got.dtype == torch.long
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    start = 1 if family == "t5" else ids.shape[1]
    if ends_early:  # EOS handling is exercised: a row ends, the others go on
        assert (got[:, start:-1] == eos).any() and got.shape[1] > start + 1


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_several_eos_ids_and_default_pad_like_transformers(pair, family):
    """Two EOS ids (beam search keeps 3 x num_beams candidates) and the config's pad id (T5: 0, which
    transformers' beam search replaces by the EOS id when filling finished beams)."""
    hf, ours = pair[family]
    ids, mask = _batch(family)
    eos = [_eos(hf, ids, mask, family), 7]
    pad = ours.config.pad_token_id
    for kw in ({}, dict(num_beams=3, num_return_sequences=3)):
        want = _hf_generate(hf, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=pad, **kw)
        got = generate(ours, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=pad, **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_eos_comes_from_the_imported_config(pair, tmp_path):
    """from_hf keeps config.json's eos_token_id (to_hf writes it back), so generate stops where transformers
    does without being told."""
    assert [pair[f][1].config.eos_token_id for f in ("gpt2", "llama", "t5")] == [0, 2, 1]
    hf, ours = pair["llama"]
    pretune.to_hf(ours, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == 2
    ids, mask = _batch("llama")
    eos = _eos(hf, ids, mask, "llama")
    before = (hf.generation_config.eos_token_id, ours.config.eos_token_id)
    hf.generation_config.eos_token_id, ours.config.eos_token_id = eos, eos
    try:
        want = _hf_generate(hf, ids, mask, max_new_tokens=NEW, pad_token_id=0)
        got = pretune.generate(ours, ids, mask, max_new_tokens=NEW)  # the public function; pad: config.pad_token_id
    finally:
        hf.generation_config.eos_token_id, ours.config.eos_token_id = before
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got[:, ids.shape[1]:-1] == eos).any()


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_cache_and_no_cache_give_the_same_tokens(pair, family):
    ours = pair[family][1]
    ids, mask = _batch(family)
    for kw in ({}, dict(num_beams=3, num_return_sequences=2), dict(do_sample=True, seed=3, top_p=0.9)):
        with_cache = generate(ours, ids, mask, max_new_tokens=NEW, eos_token_id=5, **kw)
        without = generate(ours, ids, mask, max_new_tokens=NEW, eos_token_id=5, use_cache=False, **kw)
        torch.testing.assert_close(with_cache, without, rtol=0, atol=0)


def _alone(model, ids, mask, **kw) -> list[list[int]]:
    """Each prompt generated on its own, without padding; new tokens only, padding removed."""
    out = []
    for row, m in zip(ids, mask):
        one = row[m.bool()][None]
        res = generate(model, one, max_new_tokens=NEW, **kw)
        start = 1 if model.config.arch == "encoder-decoder" else one.shape[1]
        out += [r[start:].tolist() for r in res]
    return out


def _new_tokens(model, ids, out, pad) -> list[list[int]]:
    start = 1 if model.config.arch == "encoder-decoder" else ids.shape[1]
    rows = [r[start:].tolist() for r in out]
    for r in rows:
        while r and r[-1] == pad:
            r.pop()
    return rows


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_batched_left_padded_equals_one_by_one(pair, family):
    ours = pair[family][1]
    ids, mask = _batch(family)
    for kw in ({}, dict(num_beams=2)):
        batched = generate(ours, ids, mask, max_new_tokens=NEW, eos_token_id=5, pad_token_id=2, **kw)
        alone = _alone(ours, ids, mask, eos_token_id=5, pad_token_id=2, **kw)
        assert _new_tokens(ours, ids, batched, 2) == [_strip(a, 2) for a in alone]


def _strip(row, pad):
    row = list(row)
    while row and row[-1] == pad:
        row.pop()
    return row


@pytest.mark.parametrize("position", ["learned", "rope", "alibi", "relative", "sinusoidal"])
def test_padding_does_not_change_a_decoder_prompt(position):
    """Every position kind: learned/sinusoidal/RoPE read position ids from the mask; relative/ALiBi biases
    depend only on distances, which left padding does not change."""
    torch.manual_seed(0)
    cfg = pretune.ModelConfig(arch="decoder", vocab_size=V, dim=32, n_layers=2, n_heads=4, ffn_dim=64,
                              max_seq_len=64, dropout=0.0, attn_dropout=0.0, head="lm", position=position,
                              norm_placement="pre", embed_norm=False, token_types=0)
    model = pretune.build_model(cfg).eval()
    ids, mask = _batch("gpt2")
    batched = generate(model, ids, mask, max_new_tokens=NEW)
    alone = _alone(model, ids, mask)
    assert [r[ids.shape[1]:].tolist() for r in batched] == alone


def test_sampling_is_seeded_and_leaves_the_global_rng_alone(pair):
    ours = pair["llama"][1]
    ids, mask = _batch("llama")
    state = torch.get_rng_state()
    a = generate(ours, ids, mask, max_new_tokens=NEW, do_sample=True, seed=7, temperature=1.5)
    b = generate(ours, ids, mask, max_new_tokens=NEW, do_sample=True, seed=7, temperature=1.5)
    c = generate(ours, ids, mask, max_new_tokens=NEW, do_sample=True, seed=8, temperature=1.5)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b) and not torch.equal(a, c)
    many = generate(ours, ids, mask, max_new_tokens=NEW, do_sample=True, seed=7, num_return_sequences=4,
                    temperature=1.5)
    assert many.shape == (12, ids.shape[1] + NEW)
    assert len({tuple(r) for r in many[:4, ids.shape[1]:].tolist()}) > 1  # four different samples of prompt 0
    beams = [generate(ours, ids, mask, max_new_tokens=NEW, do_sample=True, num_beams=3, seed=1) for _ in range(2)]
    assert torch.equal(beams[0], beams[1])


def test_top_k_1_and_tiny_top_p_are_greedy(pair):
    ours = pair["gpt2"][1]
    ids, mask = _batch("gpt2")
    greedy = generate(ours, ids, mask, max_new_tokens=NEW)
    assert torch.equal(generate(ours, ids, mask, max_new_tokens=NEW, do_sample=True, top_k=1, seed=0), greedy)
    assert torch.equal(generate(ours, ids, mask, max_new_tokens=NEW, do_sample=True, top_p=1e-6, seed=0), greedy)


def test_a_draw_follows_the_probabilities_and_never_takes_a_token_of_probability_zero(monkeypatch):
    """Sampling's draw (inverse CDF): token frequencies over many draws match the probabilities (rows of different
    totals, as after top-k), zero-probability tokens never come out, and a uniform that rounds up to the row's total
    still lands on the last token that has probability."""
    from pretune.generation.decode import _draw

    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0], [0.0, 0.25, 0.0, 0.0, 0.25]])  # (the second sums to 0.5)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, 5)
    for _ in range(4000):
        counts.scatter_add_(1, _draw(probs, g)[:, None], torch.ones(2, 1))
    freq = counts / 4000
    torch.testing.assert_close(freq, probs / probs.sum(-1, keepdim=True), atol=0.03, rtol=0)
    assert counts[probs == 0].sum() == 0
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw.get("dtype")))  # u = 1
    assert _draw(probs, None).tolist() == [3, 4]


def test_min_new_tokens_forbids_eos(pair):
    ours = pair["gpt2"][1]
    ids, mask = _batch("gpt2")
    eos = _eos(pair["gpt2"][0], ids, mask, "gpt2")
    early = generate(ours, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=2)
    late = generate(ours, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=2, min_new_tokens=NEW)
    assert (early[:, ids.shape[1]:] == eos).any()
    assert not (late[:, ids.shape[1]:] == eos).any() and late.shape[1] == ids.shape[1] + NEW


@pytest.fixture(scope="module")
def tok():
    texts = ["the cat sat on the mat. the dog sat on the log.", "a bird in the hand; two in the bush!"] * 40
    return pretune.train_tokenizer(texts=texts, kind="bpe", vocab_size=300, show_progress=False)


@pytest.fixture(scope="module")
def lm(tok):
    torch.manual_seed(0)
    return pretune.build_model(pretune.get_preset("tiny-gpt2", vocab_size=tok.vocab_size)).eval()


def test_stop_strings_end_a_row_and_stay_in_it(lm, tok):
    prompt = torch.tensor([tok.encode("the cat sat")])
    for kw in ({}, dict(num_beams=2)):
        free = generate(lm, prompt, max_new_tokens=24, eos_token_id=[], **kw)[0, prompt.shape[1]:].tolist()
        text = tok.decode(free)
        stop = text[len(text) // 2: len(text) // 2 + 2]  # a piece from the middle of what it writes anyway
        assert stop and stop in text
        out = generate(lm, prompt, max_new_tokens=24, eos_token_id=[], pad_token_id=0, stop=[stop, "§never§"],
                       tokenizer=tok, **kw)
        new = _strip(out[0, prompt.shape[1]:].tolist(), 0)
        if kw:  # beam search: the best beam either ends at the stop string or runs to max_new_tokens
            assert (stop in tok.decode(new) and stop not in tok.decode(new[:-1])) or len(new) == 24
            continue
        assert stop in tok.decode(new) and stop not in tok.decode(new[:-1])  # the token that completes it stays
        assert new == free[: len(new)] and len(new) < len(free)


def test_stop_strings_in_a_batch_pad_the_finished_rows(lm, tok):
    rows = [tok.encode("the cat sat"), tok.encode("a bird")]
    ids = torch.zeros(2, max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, -len(r):] = torch.tensor(r)
        mask[i, -len(r):] = 1
    free = generate(lm, ids, mask, max_new_tokens=16, eos_token_id=[])
    text0 = tok.decode(free[0, ids.shape[1]:].tolist())
    stop = text0[4:7]
    out = generate(lm, ids, mask, max_new_tokens=16, eos_token_id=[], pad_token_id=0, stop=stop, tokenizer=tok)
    new0 = _strip(out[0, ids.shape[1]:].tolist(), 0)
    assert stop in tok.decode(new0) and len(new0) < 16
    n = out.shape[1] - ids.shape[1]
    assert out[0, ids.shape[1] + len(new0):].eq(0).all()
    assert out[1, ids.shape[1]:].tolist() == free[1, ids.shape[1]: ids.shape[1] + n].tolist() or stop in \
        tok.decode(out[1, ids.shape[1]:].tolist())


def test_streamer_sees_every_new_token(lm, tok):
    prompt = torch.tensor([tok.encode("the dog")])
    seen = []
    out = generate(lm, prompt, max_new_tokens=8, streamer=seen.extend, eos_token_id=[])
    assert seen == out[0, prompt.shape[1]:].tolist()


def test_max_new_tokens_0_and_one_dimensional_prompt(lm, tok):
    prompt = torch.tensor(tok.encode("the dog"))
    assert torch.equal(generate(lm, prompt, max_new_tokens=0), prompt[None])
    assert generate(lm, prompt, max_new_tokens=3, eos_token_id=[]).shape == (1, len(prompt) + 3)


def test_the_model_is_left_in_its_mode(lm, tok):
    lm.train()
    try:
        generate(lm, torch.tensor([tok.encode("the dog")]), max_new_tokens=2)
        assert lm.training
    finally:
        lm.eval()


@pytest.mark.parametrize("method", ["prompt", "prefix", "lora+prompt"])
def test_peft_models_generate_the_same_with_and_without_cache(method):
    """Prompt tuning puts virtual tokens in the cache and prefix tuning prepends keys/values after it: a
    left-padded batch decodes the same incrementally as by rerunning everything."""
    from pretune.peft.config import PeftConfig
    from pretune.peft.inject import inject

    torch.manual_seed(0)
    model = pretune.build_model(pretune.get_preset("tiny-gpt2", vocab_size=V)).eval()
    inject(model, PeftConfig(method=method, n_virtual=3), train=False)
    with torch.no_grad():  # non-zero prompts / prefixes / LoRA B, so each changes the output
        for name, p in model.named_parameters():
            if "peft" in name or "prompt" in name or "prefix" in name or "lora" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    ids, mask = _batch("gpt2")
    for kw in ({}, dict(num_beams=2)):
        cached = generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], **kw)
        torch.testing.assert_close(cached, generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[],
                                                    use_cache=False, **kw), rtol=0, atol=0)
        if "prompt" not in method:  # prefixes in front of a fixed-shape cache: the same tokens
            torch.testing.assert_close(cached, generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[],
                                                        static_cache=True, **kw), rtol=0, atol=0)
    if "prompt" in method:
        with pytest.raises(GenerationError, match="static_cache=True does not support prompt tuning"):
            generate(model, ids, mask, static_cache=True)


# ------------------------------------------------------------------------------------------------ compile=True
@requires_cxx
def test_compiled_decoding_gives_the_eager_tokens_in_one_graph(pair):
    """compile=True on Llama (RoPE, grouped-query attention): a left-padded batch greedily, then beam search
    (another batch size: a second compiled graph in the same process); the same tokens as eager decoding, and
    dynamo captured each step whole (a graph break would silently bring the per-op overhead back)."""
    from torch._dynamo.utils import counters

    hf, ours = pair["llama"]
    ids, mask = _batch("llama")
    counters.clear()
    for kw in ({}, dict(num_beams=3, num_return_sequences=2)):
        want = generate(ours, ids, mask, max_new_tokens=NEW, eos_token_id=[], **kw)
        for _ in range(2):  # the second call reuses the compiled step
            got = generate(ours, ids, mask, max_new_tokens=NEW, eos_token_id=[], compile=True, **kw)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] >= 2  # compiled, once per batch size
    assert not counters["graph_break"], dict(counters["graph_break"])
    with pytest.raises(GenerationError, match="compile=True needs use_cache=True"):
        generate(ours, ids, compile=True, use_cache=False)


def test_a_failing_compilation_is_a_clear_error(pair, monkeypatch):
    from pretune.generation import decode

    def broken(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\n(long traceback)")

    monkeypatch.setattr(decode, "_compiled_step", lambda device: broken)
    ids, mask = _batch("llama")
    with pytest.raises(GenerationError, match=r"torch.compile failed \(RuntimeError: InvalidCxxCompiler: No working "
                                              r"C\+\+ compiler found\); generate without compile"):
        generate(pair["llama"][1], ids, mask, max_new_tokens=3, compile=True)


@requires_cxx
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_compiled_decoding_of_gpt2_and_t5_equals_transformers(pair, family):
    """Learned positions (GPT-2); an encoder-decoder with relative position biases and cross-attention (T5)."""
    hf, ours = pair[family]
    ids, mask = _batch(family)
    eos = _eos(hf, ids, mask, family)
    for kw in ({}, dict(num_beams=4)):
        kw = dict(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=2, **kw)
        got = generate(ours, ids, mask, compile=True, **kw)
        torch.testing.assert_close(got, _hf_generate(hf, ids, mask, **kw), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ KV cache
def test_kv_cache_writes_in_place_and_reorders():
    from pretune.model.fast.cache import FastKVCache as KVCache

    cache = KVCache(capacity=8)
    lc = cache.layer(0)
    k = torch.randn(2, 3, 5, 4)
    full_k, full_v = lc.append(k, k + 1)
    buf = lc._kv  # keys and values in one token-major buffer (B, capacity, 2 * Hkv, Dh)
    assert buf.shape == (2, 8, 6, 4) and cache.length == 5 and torch.equal(full_k, k) and torch.equal(full_v, k + 1)
    step = torch.randn(2, 3, 1, 4)
    full_k, full_v = lc.append(step, step)
    assert lc._kv is buf and full_k.shape == (2, 3, 6, 4)  # no reallocation within the capacity
    assert torch.equal(full_k[:, :, 5:], step) and torch.equal(lc.self_k, full_k) and torch.equal(lc.self_v, full_v)
    # token-major keys and values (a slice of the fused q/k/v heads) go in with one write
    tokens = torch.randn(2, 1, 6, 4)  # (B, T, 2 * Hkv, Dh): keys in heads 0-2, values in 3-5
    full_k, full_v = lc.append_tokens(tokens)
    assert torch.equal(full_k[:, :, 6], tokens[:, 0, :3]) and torch.equal(full_v[:, :, 6], tokens[:, 0, 3:])
    for _ in range(2):  # past the capacity: the buffer doubles, the contents stay
        lc.append(step, step)
    assert lc._kv.shape[1] == 16 and cache.length == 9 and torch.equal(lc.self_k[:, :, :5], k)
    assert torch.equal(lc.self_v[:, :, :5], k + 1)
    before_k, before_v = lc.self_k.clone(), lc.self_v.clone()
    cache.reorder(torch.tensor([1, 1]))  # same batch size: in place
    assert torch.equal(lc.self_k, before_k[[1, 1]]) and torch.equal(lc.self_v, before_v[[1, 1]])
    cache.reorder(torch.tensor([0, 1, 0]))  # another batch size
    assert lc.self_k.shape == (3, 3, 9, 4) and torch.equal(lc.self_k, before_k[[1, 1, 1]])
    grow = KVCache().layer(0)  # no capacity given: exactly what the first append needs, then doubling
    grow.append(k, k)
    assert grow._kv.shape[1] == 5
    grow.append(step, step)
    assert grow._kv.shape[1] == 10


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_fused_qkv_path_gives_the_general_paths_logits_and_gradients(pair, family, monkeypatch):
    """Plain q/k/v linears take the lean path (FastAttention._fused_qkv): token-major heads rotated in place, keys and
    values cached in one copy. Decoding a left-padded batch step by step gives the general path's logits (RoPE as a
    matmul rounds differently, so within 1e-5), and a training forward/backward its loss and gradients."""
    from pretune.model.fast.attention import FastAttention as Attention

    ours = pair[family][1]
    ids, mask = _batch(family)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    lean = Attention._fused_qkv
    taken = []

    def spy(self, *args):
        out = lean(self, *args)
        taken.append(out is not None)
        return out

    def steps(fused_qkv):
        monkeypatch.setattr(Attention, "_fused_qkv", fused_qkv)
        cache, out = ours.new_cache(10), []
        with torch.no_grad():
            out.append(ours(ids, mask, position_ids=pos, past_key_values=cache).logits)
            for t in range(3):  # one new token per row per step
                new = ids[:, t:t + 1]
                full = torch.cat([mask, torch.ones(3, t + 1, dtype=mask.dtype)], dim=1)
                out.append(ours(new, full, position_ids=pos[:, -1:] + t + 1, past_key_values=cache).logits)
        labels = ids.masked_fill(mask == 0, -100)
        loss = ours(ids, mask, position_ids=pos, labels=labels).loss
        return out, [loss, *torch.autograd.grad(loss, list(ours.parameters()), allow_unused=True)]

    (got, got_train), (want, want_train) = steps(spy), steps(lambda *args: None)
    assert taken and all(taken)  # every layer of every step, and the training forward
    for g, w in zip(got + got_train, want + want_train):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_static_cache_writes_at_its_index_and_attends_over_its_capacity():
    from pretune.model.attention import build_mask
    from pretune.model.cache import StaticKVCache

    key_mask = torch.tensor([[1] * 8, [0, 0] + [1] * 6])
    cache = StaticKVCache(8, key_mask=key_mask)
    lc = cache.layer(0)
    k = torch.randn(2, 3, 5, 4)
    full_k, full_v = lc.append(k, k + 1)
    assert full_k.shape == (2, 3, 8, 4) and torch.equal(full_k[:, :, :5], k) and not full_k[:, :, 5:].any()
    cache.advance(5)
    step = torch.randn(2, 3, 1, 4)
    lc.append(step, step)
    assert lc._k is full_k and torch.equal(full_k[:, :, 5:6], step) and cache.length == 5  # advance is the stack's
    mask, is_causal = build_mask(q_len=1, k_len=8, q_offset=cache.index, causal=True, key_padding=cache.key_mask)
    hidden = mask[:, 0, 0] < -1e30  # (B, 8): left padding and the columns after the newest token
    assert not is_causal and hidden.tolist() == [[False] * 6 + [True] * 2, [True] * 2 + [False] * 4 + [True] * 2]
    cache.reorder(torch.tensor([1, 1, 0]))
    assert lc._k.shape == (3, 3, 8, 4) and torch.equal(cache.key_mask, key_mask[[1, 1, 0]].bool())
    with pytest.raises(ValueError, match="key_mask must be"):
        StaticKVCache(8, key_mask=torch.ones(2, 7))


def test_kv_cache_keeps_autograd_intact():
    lc = KVCache(capacity=8).layer(0)
    k = torch.randn(1, 2, 3, 4, requires_grad=True)
    a, _ = lc.append(k, k)
    b, _ = lc.append(k[:, :, :1] * 2, k[:, :, :1])
    (a.sum() + b.sum()).backward()  # an in-place write into a saved tensor would raise here
    assert k.grad is not None


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_arguments_name_the_problem(pair, lm, tok):
    ours = pair["gpt2"][1]
    ids, mask = _batch("gpt2")
    with pytest.raises(GenerationError, match="max_new_tokens=-1"):
        generate(ours, ids, max_new_tokens=-1)
    with pytest.raises(GenerationError, match="num_return_sequences=5 must be <= num_beams=4"):
        generate(ours, ids, num_beams=4, num_return_sequences=5)
    with pytest.raises(GenerationError, match="do_sample=True"):
        generate(ours, ids, num_return_sequences=2)
    with pytest.raises(GenerationError, match="need tokenizer="):
        generate(ours, ids, stop=["\n"])
    with pytest.raises(GenerationError, match="left-padded"):
        generate(ours, ids, mask.flip(1))
    with pytest.raises(GenerationError, match="temperature"):
        generate(ours, ids, do_sample=True, temperature=0)
    with pytest.raises(GenerationError, match="top_p"):
        generate(ours, ids, do_sample=True, top_p=1.5)
    with pytest.raises(GenerationError, match="streamer needs one sequence"):
        generate(ours, ids, streamer=print)
    with pytest.raises(GenerationError, match="LongTensor"):
        generate(ours, ids.float())
    encoder = pretune.build_model(pretune.get_preset("tiny-bert-base", vocab_size=V))
    with pytest.raises(GenerationError, match="arch='encoder'"):
        generate(encoder, ids)


def test_a_prompt_longer_than_the_position_table_is_refused(pair):
    ours = pair["gpt2"][1]  # learned positions, n_positions=64
    long = torch.randint(3, V, (1, 60))
    with pytest.raises(GenerationError, match=r"needs 69 positions \(prompt 60 tokens, max_new_tokens 10\).*has 64"):
        generate(ours, long, max_new_tokens=10)
    with pytest.raises(GenerationError, match="prompt 70 tokens"):
        generate(ours, torch.randint(3, V, (1, 70)), max_new_tokens=1)
    assert generate(ours, long, max_new_tokens=5, eos_token_id=[]).shape == (1, 65)  # 64 positions fed: fits


# ------------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def ckpt(lm, tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    tok.save(d / "tok")
    pretune.save(lm, d / "model", tokenizer=d / "tok" / "tokenizer.json")
    return d / "model"


def test_cli_streams_one_prompt(ckpt, capsys):
    assert main(["generate", str(ckpt), "the cat", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out.strip()) > 0


@requires_cxx
def test_cli_compile_prints_the_eager_text(ckpt, capsys):
    args = ["generate", str(ckpt), "the cat", "the dog sat", "--max-new-tokens", "6"]
    assert main(args) == 0
    eager = capsys.readouterr().out
    assert main(args + ["--compile"]) == 0
    captured = capsys.readouterr()
    assert captured.out == eager and "--compile: the first batch" in captured.err


def test_cli_batch_beams_stop_and_file(ckpt, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat\n\na bird in\n", encoding="utf-8")
    out = tmp_path / "gen.jsonl"
    assert main(["generate", str(ckpt), "the dog", "--file", str(prompts), "--num-beams", "3",
                 "--num-return-sequences", "2", "--stop", "\\n", "--max-new-tokens", "5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[1.1] the dog" in printed and "[3.2] a bird in" in printed
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == ["the dog", "the cat", "a bird in"]
    assert all(len(x["generated"]) == 2 for x in lines)
    assert main(["generate", str(ckpt), "the dog", "--do-sample", "--seed", "1", "--top-k", "5",
                 "--temperature", "0.8", "--max-new-tokens", "4", "--no-stream"]) == 0


def test_cli_errors_are_messages(ckpt, capsys):
    assert main(["generate", str(ckpt)]) == 2
    assert "no prompt" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "x", "--num-beams", "2", "--num-return-sequences", "3"]) == 2
    assert "num_return_sequences=3 must be <= num_beams=2" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "x", "--chat"]) == 2
    assert "chat template" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ real model
@pytest.mark.slow
def test_smollm2_greedy_equals_transformers():
    from pretune.generation.scoring import prompt_ids
    from pretune.io.tokenization import Tokenizer
    from pretune.realmodels import smollm2_dir

    try:
        folder = smollm2_dir()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))
    hf = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = pretune.from_hf(folder)
    tok = Tokenizer.load(folder)
    rows = [prompt_ids(p, tok, ours) for p in ("The capital of France is", "def fibonacci(n):")]
    chat = prompt_ids("Name three primary colours.", tok, ours, chat_source=folder)
    for ids in rows + [chat]:
        x = torch.tensor([ids])
        want = _hf_generate(hf, x, torch.ones_like(x), max_new_tokens=40)
        got = generate(ours, x, max_new_tokens=40, tokenizer=tok)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if _has_cxx():  # the compiled step: the same tokens
        x = torch.tensor([rows[0]])
        want = _hf_generate(hf, x, torch.ones_like(x), max_new_tokens=40)
        torch.testing.assert_close(generate(ours, x, max_new_tokens=40, compile=True), want, rtol=0, atol=0)
    width = max(map(len, rows))  # the two plain prompts as one left-padded batch, and beam search
    x = torch.tensor([[tok.pad_id] * (width - len(r)) + r for r in rows])
    m = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    for kw in ({}, dict(num_beams=3)):
        want = _hf_generate(hf, x, m, max_new_tokens=32, **kw)
        got = generate(ours, x, m, max_new_tokens=32, **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
