"""Parity with transformers' GPT-1 (OpenAIGPTModel, OpenAIGPTLMHeadModel, OpenAIGPTForSequenceClassification).

Random-weight transformers models from unusual tiny configs (tanh-GELU, ReLU and SiLU MLPs, tied and untied LM heads,
an unusual norm epsilon), every parameter perturbed: imported logits within 1e-4 on a right-padded batch, exports
that transformers' Auto classes load with no missing or unexpected tensor and the same logits, bitwise round trips,
greedy generation with the same tokens, and the ``gpt`` preset equal to openai-gpt's config and parameter count."""

from __future__ import annotations

import json

import pytest
import torch

import pretune
from pretune import InteropError, count_parameters, get_preset
from pretune.generation import generate

T = pytest.importorskip("transformers")

V = 99
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _config(**kw):
    base = dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, layer_norm_epsilon=1e-4,
                pad_token_id=0)
    return T.OpenAIGPTConfig(**{**base, **kw})


CASES = {  # name: (class, config kwargs)
    "lm": ("OpenAIGPTLMHeadModel", {}),
    "lm-untied-relu": ("OpenAIGPTLMHeadModel", dict(afn="relu", n_layer=3, n_head=2, tie_word_embeddings=False)),
    "body-silu": ("OpenAIGPTModel", dict(afn="silu")),
    "seq": ("OpenAIGPTForSequenceClassification", dict(id2label=LABELS)),
    "seq-regression": ("OpenAIGPTForSequenceClassification", dict(num_labels=1, problem_type="regression")),
}
# what the export is: OpenAIGPTModel imports as the LM whose head is tied to its embeddings (no tensor of its own), as
# GPT2Model does, so it exports as OpenAIGPTLMHeadModel
EXPORTED = {"OpenAIGPTLMHeadModel": "OpenAIGPTLMHeadModel", "OpenAIGPTModel": "OpenAIGPTLMHeadModel",
            "OpenAIGPTForSequenceClassification": "OpenAIGPTForSequenceClassification"}
AUTO = {"OpenAIGPTLMHeadModel": "AutoModelForCausalLM",
        "OpenAIGPTForSequenceClassification": "AutoModelForSequenceClassification"}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(transformers model with every parameter perturbed, its folder, the same weights imported by pretune)."""
    cls, kw = CASES[request.param]
    torch.manual_seed(0)
    hf = getattr(T, cls)(_config(**kw))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms start at 1, biases at 0: perturb every tensor so each one is tested
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.eval().save_pretrained(path)
    return hf, path, pretune.from_hf(path)


def _padded():
    """Three rows of 11: the first full, the others right-padded with the pad id (0, never a real token)."""
    ids = torch.randint(3, V, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _assert_same(hf, ours, ids, mask):
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask)
        want = out.logits if hasattr(out, "logits") else out.last_hidden_state
        mine = ours(ids, attention_mask=mask)
        got = mine.logits if hasattr(out, "logits") else mine.last_hidden_state  # OpenAIGPTModel: hidden states
    assert got.shape == want.shape
    if got.dim() == 2:  # one row per sequence (the last real token's)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        keep = mask.bool()
        torch.testing.assert_close(got[keep], want[keep], atol=1e-4, rtol=1e-4)


def test_from_hf_logits_match(pair):
    hf, _, ours = pair
    cfg = ours.config
    assert (cfg.norm_placement, cfg.embed_norm, cfg.final_norm, cfg.position) == ("post", False, False, "learned")
    assert cfg.ffn == {"gelu": "gelu_tanh", "relu": "relu", "silu": "swish"}[hf.config.afn]
    _assert_same(hf, ours, *_padded())


def test_to_hf_loads_in_transformers_with_same_logits(pair, tmp_path):
    hf, path, _ = pair
    ours = pretune.from_hf(path)
    with torch.no_grad():  # weights that differ from the source, so the export is really tested
        for p in ours.parameters():
            p.add_(0.01)
    pretune.to_hf(ours, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "openai-gpt"
    cls = EXPORTED[type(hf).__name__]
    reloaded, info = getattr(T, AUTO[cls]).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(reloaded).__name__ == cls
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    _assert_same(reloaded.eval(), ours, *_padded())


def test_round_trip_is_identical(pair, tmp_path):
    _, _, ours = pair
    pretune.to_hf(ours, tmp_path / "rt")
    again = pretune.from_hf(tmp_path / "rt")
    assert again.config == ours.config
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("case", ["lm", "lm-untied-relu"])
def test_greedy_generation_gives_the_tokens_of_transformers(case, tmp_path):
    """Unpadded prompts: transformers' GPT-1 takes no position ids, so a left-padded row would shift its positions
    there (pretune's generate starts each row's positions at its first real token)."""
    cls, kw = CASES[case]
    torch.manual_seed(0)
    hf = getattr(T, cls)(_config(**kw))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    hf.eval().save_pretrained(tmp_path)
    ours = pretune.from_hf(tmp_path)
    ids = torch.randint(3, V, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, min_new_tokens=10,
                           eos_token_id=None, pad_token_id=0)
    got = generate(ours, ids, mask, max_new_tokens=10, pad_token_id=0, eos_token_id=None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_gpt_preset_is_openai_gpt():
    """The ``gpt`` preset imports from (and exports to) openai-gpt's config, with transformers' parameter count."""
    hf = T.OpenAIGPTConfig()  # openai-community/openai-gpt's values are the defaults
    from pretune.interop import openai_gpt

    imported = openai_gpt.config_from_hf(hf.to_dict(), set())
    preset = get_preset("gpt")
    for key in ("arch", "vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len", "ffn", "norm", "norm_eps",
                "norm_placement", "position", "token_types", "embed_norm", "bias", "head", "tie_embeddings"):
        assert getattr(preset, key) == getattr(imported, key), key
    assert openai_gpt.export_mismatch(preset) is None
    with torch.device("meta"):
        ours = count_parameters(pretune.build_model("gpt"))["total"]
        theirs = T.OpenAIGPTLMHeadModel(hf).num_parameters()
    assert ours == theirs == 116_534_784


def test_the_tiny_preset_exports_to_transformers(tmp_path):
    model = pretune.build_model("tiny-gpt", ffn_dim=128, dropout=0.0, attn_dropout=0.0).eval()  # 4 x dim
    pretune.to_hf(model, tmp_path / "hf")
    hf = T.OpenAIGPTLMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids, mask = _padded()
    _assert_same(hf, model, ids, mask)


def test_unsupported_checkpoints_are_named(tmp_path):
    T.OpenAIGPTDoubleHeadsModel(_config()).save_pretrained(tmp_path / "double")
    with pytest.raises(InteropError, match="OpenAIGPTDoubleHeadsModel .* is not supported"):
        pretune.from_hf(tmp_path / "double")
    T.OpenAIGPTLMHeadModel(_config()).save_pretrained(tmp_path / "tanh")
    hf = json.loads((tmp_path / "tanh" / "config.json").read_text())
    (tmp_path / "tanh" / "config.json").write_text(json.dumps({**hf, "afn": "tanh"}))
    with pytest.raises(InteropError, match=r"afn='tanh' is not supported"):
        pretune.from_hf(tmp_path / "tanh")
    model = pretune.build_model("tiny-gpt", ffn_dim=48)
    with pytest.raises(InteropError, match=r"openai_gpt: needs ffn_dim = 4 \* dim \(128\), got 48"):
        pretune.to_hf(model, tmp_path / "x")
