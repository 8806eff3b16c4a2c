"""Parity with transformers: random-weight HF models from tiny configs -> from_hf -> same logits;
our models -> to_hf -> transformers loads them -> same logits; round trips give identical tensors."""

import pytest
import torch

import pretune

transformers = pytest.importorskip("transformers")
T = transformers

V = 99


def _configs():
    return {
        "bert": (lambda: T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=37, max_position_embeddings=64), T.BertForMaskedLM),
        "bert-body": (lambda: T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=37, hidden_act="gelu_new"),
                      T.BertModel),
        "roberta": (lambda: T.RobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=37,
                                            max_position_embeddings=66, type_vocab_size=1), T.RobertaForMaskedLM),
        # untied masked-LM heads: the decoder's own weight and bias are the ones the forward uses
        "bert-untied": (lambda: T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=37, max_position_embeddings=64,
                                             tie_word_embeddings=False), T.BertForMaskedLM),
        "roberta-untied": (lambda: T.RobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=4, intermediate_size=37,
                                                   max_position_embeddings=66, type_vocab_size=1,
                                                   tie_word_embeddings=False), T.RobertaForMaskedLM),
        "gpt2": (lambda: T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0), T.GPT2LMHeadModel),
        "t5-v1.0": (lambda: T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                       relative_attention_num_buckets=8, relative_attention_max_distance=20),
                    T.T5ForConditionalGeneration),
        "t5-v1.1": (lambda: T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                       num_decoder_layers=3, num_heads=4, feed_forward_proj="gated-gelu",
                                       tie_word_embeddings=False, relative_attention_num_buckets=8,
                                       relative_attention_max_distance=20), T.T5ForConditionalGeneration),
        "llama-gqa": (lambda: T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=37,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, rope_theta=500.0, pad_token_id=0),
                      T.LlamaForCausalLM),
        "llama-tied": (lambda: T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=37,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                             tie_word_embeddings=True, pad_token_id=0), T.LlamaForCausalLM),
    }


FAMILIES = list(_configs())


def _randomize(model):
    """HF inits norms to 1/0 and some biases to 0: perturb everything so every tensor is tested."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    mask[2, 4:] = 0
    dec = torch.randint(3, V, (3, 6), generator=g)
    dec_mask = torch.ones_like(dec)
    dec_mask[2, 4:] = 0
    return ids, mask, dec, dec_mask


def _hf_out(hf, ids, mask, dec, dec_mask):
    if hf.config.is_encoder_decoder:
        return hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
    return hf(input_ids=ids, attention_mask=mask)


def _ours_out(model, ids, mask, dec, dec_mask):
    if model.config.arch == "encoder-decoder":
        return model(ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
    return model(ids, attention_mask=mask)


def _compare(hf_out, ours, mask, dec_mask, is_enc_dec):
    keep = (dec_mask if is_enc_dec else mask).bool()
    a = hf_out.logits if hasattr(hf_out, "logits") and hf_out.logits is not None else hf_out.last_hidden_state
    b = ours.logits if ours.logits is not None else ours.last_hidden_state
    assert a.shape == b.shape
    torch.testing.assert_close(b[keep], a[keep], atol=1e-4, rtol=1e-4)
    if not is_enc_dec and getattr(hf_out, "pooler_output", None) is not None:
        torch.testing.assert_close(ours.pooler_output, hf_out.pooler_output, atol=1e-4, rtol=1e-4)


@pytest.fixture(params=FAMILIES)
def hf_model(request, tmp_path):
    make_cfg, cls = _configs()[request.param]
    hf = _randomize(cls(make_cfg())).eval()
    path = tmp_path / "hf"
    hf.save_pretrained(path)
    return hf, path


def test_from_hf_logits_match(hf_model):
    hf, path = hf_model
    ours = pretune.from_hf(path)
    batch = _batch()
    with torch.no_grad():
        _compare(_hf_out(hf, *batch), _ours_out(ours, *batch), batch[1], batch[3], hf.config.is_encoder_decoder)


def test_to_hf_loads_in_transformers_with_same_logits(hf_model, tmp_path):
    hf, path = hf_model
    ours = pretune.from_hf(path)
    with torch.no_grad():  # make our weights differ from the source so the export is really tested
        for p in ours.parameters():
            p.add_(0.01)
    out = tmp_path / "exported"
    pretune.to_hf(ours, out)
    reloaded = type(hf).from_pretrained(out).eval()
    auto = T.AutoModelForMaskedLM if "MaskedLM" in type(hf).__name__ else (
        T.AutoModelForSeq2SeqLM if hf.config.is_encoder_decoder else
        T.AutoModelForCausalLM if "LMHead" in type(hf).__name__ or "CausalLM" in type(hf).__name__ else T.AutoModel)
    assert type(auto.from_pretrained(out)) is type(hf)  # the Auto* classes resolve the exported folder
    batch = _batch()
    with torch.no_grad():
        _compare(_hf_out(reloaded, *batch), _ours_out(ours, *batch), batch[1], batch[3],
                 hf.config.is_encoder_decoder)


def test_round_trip_is_identical(hf_model, tmp_path):
    _, path = hf_model
    ours = pretune.from_hf(path)
    pretune.to_hf(ours, tmp_path / "rt")
    again = pretune.from_hf(tmp_path / "rt")
    assert again.config == ours.config
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("preset,overrides", [
    ("tiny-bert-base", {}), ("tiny-roberta-base", {"token_types": 1}), ("tiny-gpt2", {}), ("tiny-t5-small", {}),
    ("tiny-t5-small", {"ffn": "geglu_tanh", "tie_embeddings": False, "tied_logit_scale": False}),  # T5 v1.1
    ("tiny-llama", {}), ("tiny-llama", {"tie_embeddings": False}),
])
def test_our_presets_export_to_transformers(preset, overrides, tmp_path):
    model = pretune.build_model(preset, dropout=0.0, attn_dropout=0.0, **overrides).eval()
    pretune.to_hf(model, tmp_path / "hf")
    arch = __import__("json").loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    hf = getattr(T, arch).from_pretrained(tmp_path / "hf").eval()
    batch = _batch()
    batch = tuple(torch.where(t > 0, t % 128, t) for t in batch)
    with torch.no_grad():
        _compare(_hf_out(hf, *batch), _ours_out(model, *batch), batch[1], batch[3], hf.config.is_encoder_decoder)
