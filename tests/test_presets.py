"""Presets: each builds, the full-size ones have the published parameter counts, tiny-X keeps X's choices."""

import pytest
import torch

import pretune
from pretune import ConfigError, count_parameters, get_preset, preset_names
from pretune.presets import PRESETS

FULL = [n for n in preset_names() if not n.startswith("tiny-")]
TINY = [n for n in preset_names() if n.startswith("tiny-")]

# Exact counts: the same architecture built with transformers 5.x on the meta device
# (BertForMaskedLM / RobertaForMaskedLM without pooler, OpenAIGPTLMHeadModel, GPT2LMHeadModel,
# T5ForConditionalGeneration, LlamaForCausalLM with SmolLM2-135M's config, ElectraForPreTraining,
# ModernBertForMaskedLM), shared tensors counted once.
# The published, rounded figure is the second number (papers / model cards), checked within 1%.
PARAMS = {
    "bert-base": (109_514_298, 110e6),  # Devlin et al. 2019: 110M
    "bert-large": (335_174_458, 335e6),  # HF model card: 335M (the paper rounds to 340M)
    "distilbert-base": (66_985_530, 67e6),  # DistilBertForMaskedLM; HF distilbert-base-uncased card: 67M (body 66M)
    "roberta-base": (124_697_433, 125e6),  # Liu et al. 2019: 125M
    "gpt": (116_534_784, 117e6),  # Radford et al. 2018: 117M
    "gpt2": (124_439_808, 124e6),  # HF gpt2 model card: 124M (124,439,808 with tied embeddings)
    "gpt2-medium": (354_823_168, 355e6),  # HF gpt2-medium model card: 355M
    "gpt2-large": (774_030_080, 774e6),  # HF gpt2-large model card: 774M
    "gpt2-xl": (1_557_611_200, 1.56e9),  # HF gpt2-xl model card: 1.5B (1,557,611,200 with tied embeddings)
    "modernbert-base": (149_655_232, 149e6),  # ModernBertForMaskedLM; HF answerdotai/ModernBERT-base card: 149M
    "modernbert-large": (395_881_664, 395e6),  # ModernBertForMaskedLM; HF answerdotai/ModernBERT-large card: 395M
    "t5-small": (60_506_624, 60.5e6),  # Raffel et al. 2020 / HF t5-small: 60M
    "t5-base": (222_903_552, 223e6),  # Raffel et al. 2020: 220M; HF t5-base card: 223M
    "bart-base": (139_420_416, 140e6),  # BartForConditionalGeneration; Lewis et al. 2019 / HF bart-base: 140M
    "bart-large": (406_291_456, 406e6),  # HF facebook/bart-large card: 406M (the paper rounds to 400M)
    "llama": (134_515_008, 134.5e6),  # HuggingFaceTB/SmolLM2-135M: 134.5M
    "electra-small": (13_549_057, 13.5e6),  # ElectraForPreTraining; Clark et al. 2020 round it to 14M
    "electra-base": (109_483_009, 110e6),  # Clark et al. 2020: 110M
    "electra-large": (335_142_913, 335e6),  # Clark et al. 2020: 335M
}

CHOICES = ("arch", "position", "ffn", "norm", "norm_placement", "tie_embeddings", "bias", "norm_bias", "head",
           "embed_norm", "attn_scale", "tied_logit_scale", "rope_base", "token_types")


def _meta(name: str) -> pretune.TransformerLM:
    with torch.device("meta"):
        return pretune.build_model(name)


@pytest.mark.parametrize("name", FULL)
def test_full_size_preset_builds(name):
    model = _meta(name)
    cfg = get_preset(name)
    assert model.config == cfg
    assert count_parameters(model)["total"] > 10_000_000


@pytest.mark.parametrize("name", list(PARAMS))
def test_published_parameter_counts(name):
    exact, published = PARAMS[name]
    total = count_parameters(_meta(name))["total"]
    assert total == exact
    assert abs(total - published) / published < 0.01


def test_bert_base_count_breakdown():
    """Where 109,514,298 comes from (the shapes of Devlin et al. 2019)."""
    layer = (4 * (768 * 768 + 768)  # q, k, v, o projections
             + (768 * 3072 + 3072) + (3072 * 768 + 768)  # FFN
             + 2 * 2 * 768)  # two LayerNorms
    assert layer == 7_087_872
    parts = count_parameters(_meta("bert-base"))
    assert parts["embed"] == 30522 * 768  # token embedding, tied with the MLM decoder
    assert parts["encoder"] == 12 * layer + 512 * 768 + 2 * 768 + 2 * 768  # + positions, token types, LayerNorm
    assert parts["head"] == (768 * 768 + 768) + 2 * 768 + 30522  # MLM transform, its LayerNorm, decoder bias


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_builds_and_runs(name):
    torch.manual_seed(0)
    model = pretune.build_model(name).eval()
    cfg = model.config
    assert (cfg.dim, cfg.n_layers, cfg.n_heads) == (32, 2, 4)
    assert count_parameters(model)["total"] < 100_000
    ids = torch.randint(1, cfg.vocab_size, (2, 5))
    kw = dict(decoder_input_ids=ids[:, :3]) if cfg.arch == "encoder-decoder" else {}
    with torch.no_grad():
        out = model(ids, **kw)
    per_token = (2, 5) if cfg.head == "rtd" else (2, 3 if kw else 5, cfg.vocab_size)  # rtd: one logit per token
    assert out.logits.shape == per_token
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("name", FULL)
def test_tiny_keeps_the_choices(name):
    big, tiny = get_preset(name), get_preset(f"tiny-{name}")
    for key in CHOICES:
        assert getattr(tiny, key) == getattr(big, key), key
    assert (tiny.n_kv_heads is None) == (big.n_kv_heads is None)  # GQA stays GQA
    if big.n_kv_heads:
        assert tiny.n_kv_heads < tiny.n_heads
    assert (tiny.embed_dim is None) == (big.embed_dim is None)  # factorised stays factorised
    if big.embed_dim:
        assert tiny.embed_dim < tiny.dim
    assert tiny.pad_token_id < tiny.vocab_size


def test_every_preset_is_listed_with_its_tiny_twin():
    assert set(TINY) == {f"tiny-{n}" for n in FULL}
    assert set(preset_names()) == set(PRESETS)
    assert {"bert-base", "gpt2", "t5-small", "llama"} <= set(FULL)


def test_unknown_preset_suggests_nearest():
    with pytest.raises(ConfigError, match=r"unknown preset 'gtp2'; did you mean 'gpt2'\?"):
        pretune.build_model("gtp2")
    with pytest.raises(ConfigError, match=r"unknown preset 'bert_base'; did you mean 'bert-base'\?"):
        get_preset("bert_base")


def test_preset_overrides_are_validated():
    assert get_preset("tiny-gpt2", n_layers=3).n_layers == 3
    with pytest.raises(ConfigError, match=r"preset 'tiny-gpt2': unknown config key 'n_layer'; did you mean"):
        get_preset("tiny-gpt2", n_layer=3)
