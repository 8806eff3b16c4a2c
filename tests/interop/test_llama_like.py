"""Config maps of the Llama-shaped families (interop/llama.py, qwen2.py, qwen3.py, mistral.py, gemma.py, gemma2.py):
the RoPE keys in both config.json formats (transformers 5's rope_parameters, the older rope_theta + rope_scaling of
Llama 3.x folders), sliding windows, what each family refuses, and which family a config exports as."""

from __future__ import annotations

import json

import pytest
import torch

import pretune
from pretune import InteropError
from pretune.interop import gemma, gemma2, llama, mistral, qwen2, qwen3

T = pytest.importorskip("transformers")

LLAMA_32 = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}  # Llama-3.2-1B's config.json


def _hf(**kw) -> dict:
    return {"model_type": "llama", "vocab_size": 99, "hidden_size": 32, "intermediate_size": 37,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 131072, **kw}


@pytest.mark.parametrize("hf", [_hf(rope_theta=500000.0, rope_scaling=LLAMA_32),
                                _hf(rope_parameters={**LLAMA_32, "rope_theta": 500000.0})],
                         ids=["rope_scaling", "rope_parameters"])
def test_llama3_rope_keys_in_both_formats(hf):
    cfg = llama.config_from_hf(hf, set())
    assert (cfg.rope_base, cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_seq_len) == (500000.0, "llama3", 32.0, 1.0, 4.0, 8192)
    params = llama.config_to_hf(cfg)["rope_parameters"]
    assert params == {**LLAMA_32, "rope_theta": 500000.0}


def test_llama3_without_its_original_length_takes_the_model_length_as_transformers_does():
    scaling = {k: v for k, v in LLAMA_32.items() if k != "original_max_position_embeddings"}
    assert llama.config_from_hf(_hf(rope_scaling=scaling), set()).rope_original_max_seq_len == 131072
    top = _hf(rope_scaling=scaling, original_max_position_embeddings=4096)  # Phi-3 style key outside the dict
    assert llama.config_from_hf(top, set()).rope_original_max_seq_len == 4096


@pytest.mark.parametrize("hf,match", [
    (_hf(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
    (_hf(rope_scaling={"type": "linear", "factor": 2.0}), "rope type 'linear' is not supported"),
    (_hf(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "needs low_freq_factor, high_freq_factor"),
    (_hf(attention_bias=True), "attention_bias"),
])
def test_llama_refusals_name_the_key(hf, match):
    with pytest.raises(InteropError, match=match):
        llama.config_from_hf(hf, set())


def test_a_llama_32_folder_in_the_old_format_matches_transformers(tmp_path):
    """A folder written the way Llama 3.2 checkpoints are (rope_theta + rope_scaling, tied head): both libraries
    read it, and the logits agree at positions far past the original context of this tiny config."""
    cfg = T.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True,
                        rope_parameters={**LLAMA_32, "original_max_position_embeddings": 32, "rope_theta": 5000.0})
    torch.manual_seed(0)
    T.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    written.pop("rope_parameters")
    written.update(rope_theta=5000.0, rope_scaling={**LLAMA_32, "original_max_position_embeddings": 32})
    (tmp_path / "config.json").write_text(json.dumps(written))
    hf = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    ours = pretune.from_hf(tmp_path)
    ids = torch.randint(0, 99, (2, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def _qwen(model_type: str, **kw) -> dict:
    return {**_hf(), "model_type": model_type, "max_position_embeddings": 128, **kw}


def test_qwen_sliding_window_reaches_the_layers_that_use_it():
    """transformers' Qwen2Config rules: layers from max_window_layers on (or those layer_types names) are local."""
    on = dict(use_sliding_window=True, sliding_window=16)
    cfg = qwen2.config_from_hf(_qwen("qwen2", **on, max_window_layers=1), set())
    assert (cfg.sliding_window, cfg.sliding_layers) == (16, [1])
    cfg = qwen3.config_from_hf(_qwen("qwen3", **on, layer_types=["sliding_attention", "full_attention"]), set())
    assert (cfg.sliding_window, cfg.sliding_layers) == (16, [0])
    cfg = qwen2.config_from_hf(_qwen("qwen2", **on, max_window_layers=0), set())
    assert (cfg.sliding_window, cfg.sliding_layers) == (16, None)  # every layer
    # off (every released Qwen2.5 config), or on with no layer past max_window_layers: full attention
    assert qwen2.config_from_hf(_qwen("qwen2", use_sliding_window=False, sliding_window=32768), set()).sliding_window \
        is None
    assert qwen3.config_from_hf(_qwen("qwen3", **on, max_window_layers=28), set()).sliding_window is None
    exported = qwen2.config_to_hf(qwen2.config_from_hf(_qwen("qwen2", **on, max_window_layers=1), set()))
    assert exported["use_sliding_window"] and exported["layer_types"] == ["full_attention", "sliding_attention"]


def test_qwen3_attention_bias_is_refused_and_qwen2_ignores_it_as_transformers_does():
    with pytest.raises(InteropError, match="attention_bias=True"):
        qwen3.config_from_hf(_qwen("qwen3", attention_bias=True), set())
    assert qwen2.config_from_hf(_qwen("qwen2", attention_bias=True), set()).qkv_bias


GEMMA = dict(norm="rmsnorm_plus_one", scale_embeddings=True, ffn="geglu_tanh", head_dim=12)


@pytest.mark.parametrize("options,model_type", [
    ({}, "llama"), ({"qkv_bias": True}, "qwen2"), ({"qk_norm": True, "head_dim": 12}, "qwen3"),
    ({"qkv_bias": True, "sliding_window": 8, "sliding_layers": [1]}, "qwen2"), ({"sliding_window": 8}, "mistral"),
    (GEMMA, "gemma"), ({**GEMMA, "norm_placement": "sandwich"}, "gemma2"),
    ({**GEMMA, "norm_placement": "sandwich", "attn_softcap": 50.0, "logit_softcap": 30.0, "attn_scale": 0.25,
      "sliding_window": 8, "sliding_layers": [0]}, "gemma2"),
])
def test_each_option_exports_as_its_family(options, model_type, tmp_path):
    model = pretune.build_model("tiny-llama", dropout=0.0, attn_dropout=0.0, **options)
    pretune.to_hf(model, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == model_type


def test_q_k_v_biases_with_q_k_norms_have_no_family(tmp_path):
    model = pretune.build_model("tiny-llama", qkv_bias=True, qk_norm=True)
    with pytest.raises(InteropError, match="qwen2: needs qk_norm=False.*qwen3: needs qkv_bias=False"):
        pretune.to_hf(model, tmp_path / "hf")


def test_a_window_on_some_layers_of_a_llama_has_no_family(tmp_path):
    """Mistral windows every layer; the per-layer window is Qwen2's (with q/k/v biases) or Gemma 2's."""
    model = pretune.build_model("tiny-llama", sliding_window=8, sliding_layers=[1])
    with pytest.raises(InteropError, match="llama: needs sliding_window=None.*mistral: needs sliding_layers=None"):
        pretune.to_hf(model, tmp_path / "hf")


def test_gemma_options_without_their_family_have_none(tmp_path):
    for options, why in [(dict(scale_embeddings=True), "gemma: needs norm='rmsnorm_plus_one'"),
                         ({**GEMMA, "attn_softcap": 50.0}, "gemma: needs attn_softcap=None"),
                         ({**GEMMA, "qk_norm": True}, "gemma2: needs qk_norm=False")]:
        with pytest.raises(InteropError, match=why):
            pretune.to_hf(pretune.build_model("tiny-llama", **options), tmp_path / "hf")


def _gemma(model_type: str = "gemma", **kw) -> dict:
    return {**_hf(), "model_type": model_type, "max_position_embeddings": 128, "head_dim": 12, **kw}


@pytest.mark.parametrize("fam,hf,match", [
    (gemma, _gemma(attention_bias=True), "attention_bias=True"),
    (gemma, _gemma(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (gemma, _gemma(hidden_act="relu"), "hidden_act='relu' is not supported"),
    (gemma, _gemma(architectures=["GemmaForQuestionAnswering"]), "task heads of this family"),
    (gemma2, _gemma("gemma2", hidden_activation="gelu"), "hidden_activation='gelu' is not supported"),
    (gemma2, _gemma("gemma2", sliding_window=None), "sliding_window is null"),
    (gemma2, _gemma("gemma2", sliding_window=4, layer_types=["sliding_attention"]), "for each of the 2 layers"),
])
def test_gemma_refusals_name_the_key(fam, hf, match):
    with pytest.raises(InteropError, match=match):
        fam.config_from_hf(hf, set())


def test_gemma2_defaults_and_scale_follow_transformers():
    """No layer_types: every other layer local, starting with the first; query_pre_attn_scalar = head_dim is the
    default scale; the scalar survives a round trip through attn_scale."""
    cfg = gemma2.config_from_hf(_gemma("gemma2", num_hidden_layers=4, sliding_window=6, query_pre_attn_scalar=12,
                                       attn_logit_softcapping=50.0, final_logit_softcapping=None), set())
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.attn_scale) == (6, [0, 2], None)
    assert (cfg.attn_softcap, cfg.logit_softcap, cfg.norm_placement) == (50.0, None, "sandwich")
    for scalar in (24, 7.5):
        cfg = gemma2.config_from_hf(_gemma("gemma2", sliding_window=6, query_pre_attn_scalar=scalar), set())
        assert cfg.attn_scale == scalar ** -0.5
        assert gemma2.config_to_hf(cfg)["query_pre_attn_scalar"] == scalar
    off = gemma2.config_to_hf(cfg.replace(sliding_window=None, sliding_layers=None))
    assert off["layer_types"] == ["full_attention"] * 2 and off["sliding_window"] == 128  # unused, but set


def test_mistral_window_null_is_full_attention():
    assert mistral.config_from_hf({**_hf(), "model_type": "mistral", "sliding_window": None}, set()).sliding_window \
        is None
    cfg = mistral.config_from_hf({**_hf(), "model_type": "mistral", "sliding_window": 4096,
                                  "layer_types": ["full_attention", "sliding_attention"]}, set())
    assert (cfg.sliding_window, cfg.sliding_layers) == (4096, None)  # transformers' Mistral ignores layer_types
