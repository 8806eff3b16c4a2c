"""Parity with transformers' ModernBERT: ModernBertModel, ModernBertForMaskedLM and the task classes
(*ForSequenceClassification with cls and mean pooling, regression, *ForTokenClassification, *ForQuestionAnswering).

Random-weight transformers models from unusual tiny configs (local layers every other one or as ``layer_types``
names them, windows of 2-4 keys on rows of 13 tokens, separate global and local RoPE bases, biases and norm biases on
and off, tied and untied decoders, tanh-GELU and SiLU activations), every parameter perturbed: imported logits within
1e-4 on a right-padded batch with transformers' eager and SDPA attention, exports that transformers' Auto classes load
with no missing or unexpected tensor and the same logits, bitwise round trips, configs in transformers 4's keys, and
clear errors for what pretune cannot represent."""

from __future__ import annotations

import json

import pytest
import torch

import pretune
from pretune import InteropError

T = pytest.importorskip("transformers")

V = 99
LEN = 13  # longer than every window below
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _config(**kw):
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                sep_token_id=2, global_attn_every_n_layers=2, local_attention=4, global_rope_theta=500.0,
                local_rope_theta=30.0)
    return T.ModernBertConfig(**{**base, **kw})


CASES = {  # name: (class, config kwargs)
    "mlm-alternating": ("ModernBertForMaskedLM", dict(norm_bias=True, classifier_bias=True)),
    "mlm-untied-layer-types": ("ModernBertForMaskedLM", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        local_attention=6, hidden_activation="gelu_pytorch_tanh", classifier_activation="silu", attention_bias=True,
        mlp_bias=True, tie_word_embeddings=False, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 300.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}})),
    "body-every-3": ("ModernBertModel", dict(global_attn_every_n_layers=3, local_attention=2, norm_eps=1e-6)),
    "seq-cls": ("ModernBertForSequenceClassification", dict(id2label=LABELS, classifier_bias=True)),
    "seq-mean-regression": ("ModernBertForSequenceClassification", dict(
        num_labels=1, problem_type="regression", classifier_pooling="mean", classifier_activation="gelu_new")),
    "token": ("ModernBertForTokenClassification", dict(num_labels=5, norm_bias=True, classifier_dropout=0.2)),
    "qa": ("ModernBertForQuestionAnswering", dict(attention_bias=True, mlp_bias=True)),
}
AUTO = {"ModernBertForMaskedLM": "AutoModelForMaskedLM", "ModernBertModel": "AutoModel",
        "ModernBertForSequenceClassification": "AutoModelForSequenceClassification",
        "ModernBertForTokenClassification": "AutoModelForTokenClassification",
        "ModernBertForQuestionAnswering": "AutoModelForQuestionAnswering"}


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
    """Three rows of 13: the first full, the others right-padded with the pad id."""
    ids = torch.randint(3, V, (3, LEN), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 4:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _hf_logits(hf, ids, mask):
    out = hf(input_ids=ids, attention_mask=mask)
    if hasattr(out, "start_logits"):
        return torch.stack([out.start_logits, out.end_logits], dim=-1)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _assert_same(hf, ours, ids, mask):
    with torch.no_grad():
        want = _hf_logits(hf, ids, mask)
        out = ours(ids, attention_mask=mask)
        got = out.logits if out.logits is not None else out.last_hidden_state
    assert got.shape == want.shape
    if got.dim() == 2:  # one row per sequence
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        keep = mask.bool()
        torch.testing.assert_close(got[keep], want[keep], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_from_hf_logits_match(pair, attn):
    _, path, ours = pair
    hf = T.AutoConfig.from_pretrained(path)
    hf = getattr(T, hf.architectures[0]).from_pretrained(path, attn_implementation=attn).eval()
    _assert_same(hf, ours, *_padded())


def test_the_import_uses_the_family_options(pair):
    hf, _, ours = pair
    cfg, hc = ours.config, hf.config
    local = [i for i, t in enumerate(hc.layer_types) if t == "sliding_attention"]
    assert cfg.sliding_window == hc.local_attention // 2 + 1
    assert (cfg.sliding_layers or list(range(cfg.n_layers))) == local
    thetas = {t: p["rope_theta"] for t, p in hc.rope_parameters.items()}
    assert (cfg.rope_base, cfg.rope_local_base) == (thetas["full_attention"], thetas["sliding_attention"])
    assert (cfg.first_attn_norm, cfg.head_transform, cfg.norm_placement, cfg.embed_norm) == (False, True, "pre", True)
    assert (cfg.bias, cfg.norm_bias, cfg.head_dense_bias) == (hc.attention_bias, hc.norm_bias, hc.classifier_bias)
    assert cfg.tie_embeddings == hc.tie_word_embeddings
    assert isinstance(ours.transformer.encoder.layers[0].attn_norm, torch.nn.Identity)
    if cfg.head in ("classification", "regression"):
        assert cfg.sentence_pooling == hc.classifier_pooling


def _rebuilt(ours, **changes):
    other = pretune.build_model(ours.config.replace(**changes)).eval()
    other.load_state_dict(ours.state_dict())
    return other


def test_each_option_changes_the_outputs_so_parity_pins_it(pair):
    """A window one key wider or narrower, one RoPE base for every layer, no local layers: other outputs on these
    rows, so the parity above holds only for transformers' conventions (|i - j| <= local_attention // 2)."""
    _, _, ours = pair
    ids, mask = _padded()
    cfg = ours.config
    changes = {"window + 1": dict(sliding_window=cfg.sliding_window + 1),
               "window - 1": dict(sliding_window=cfg.sliding_window - 1),
               "one base": dict(rope_local_base=None),
               "all global": dict(sliding_window=None, sliding_layers=None, rope_local_base=None)}
    if cfg.sliding_window == 2:
        del changes["window - 1"]  # a window of 1 key still differs, but the row of 4 real tokens is short
        changes["window 1"] = dict(sliding_window=1)
    with torch.no_grad():
        out = ours(ids, attention_mask=mask)
        ref = out.logits if out.logits is not None else out.last_hidden_state
        for name, change in changes.items():
            o = _rebuilt(ours, **change)(ids, attention_mask=mask)
            got = o.logits if o.logits is not None else o.last_hidden_state
            assert (got - ref).abs().max() > 1e-4, name


def test_to_hf_loads_in_transformers_with_same_logits(pair, tmp_path):
    hf, path, _ = pair
    ours = pretune.from_hf(path)
    with torch.no_grad():  # weights that differ from the source, so the export is really tested
        for p in ours.parameters():
            p.add_(0.01)
    pretune.to_hf(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "modernbert"
    auto = getattr(T, AUTO[type(hf).__name__])
    reloaded, info = auto.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(reloaded) is type(hf)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert reloaded.config.layer_types == hf.config.layer_types
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


# --- config.json variants and errors ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlm_folder(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mlm")
    T.ModernBertForMaskedLM(_config()).save_pretrained(path)
    return path


def _with_config(src, dst, **changes):
    """A copy of folder src whose config.json has ``changes`` (a value None: the key removed)."""
    dst.mkdir()
    hf = json.loads((src / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            hf.pop(k, None)
        else:
            hf[k] = v
    (dst / "config.json").write_text(json.dumps(hf))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


def test_transformers_4_config_keys_give_the_same_model(mlm_folder, tmp_path):
    """ModernBERT folders written by transformers 4 have global_attn_every_n_layers and global/local_rope_theta
    instead of layer_types and rope_parameters; a null local theta means the global one."""
    new = pretune.from_hf(mlm_folder).config
    v4 = dict(layer_types=None, rope_parameters=None, global_attn_every_n_layers=2, global_rope_theta=500.0)
    old = pretune.from_hf(_with_config(mlm_folder, tmp_path / "v4", **v4, local_rope_theta=30.0)).config
    assert old == new
    assert (old.sliding_layers, old.rope_base, old.rope_local_base) == ([1, 3], 500.0, 30.0)
    hf = json.loads((_with_config(mlm_folder, tmp_path / "null", **v4) / "config.json").read_text())
    hf["local_rope_theta"] = None
    (tmp_path / "null" / "config.json").write_text(json.dumps(hf))
    one = pretune.from_hf(tmp_path / "null").config
    assert (one.rope_base, one.rope_local_base, one.sliding_layers) == (500.0, None, [1, 3])


@pytest.mark.parametrize("changes,match", [
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 5.0, "factor": 2.0}}),
     r"rope_type='linear'; only default RoPE"),
    (dict(attention_bias=True), r"attention_bias=True with mlp_bias=False is not supported"),
    (dict(decoder_bias=False), r"decoder_bias=False is not supported"),
    (dict(classifier_pooling="max"), r"classifier_pooling='max' is not supported"),
    (dict(layer_types=["full_attention"]), r"layer_types must name .* each of the 4 layers"),
    (dict(hidden_activation="tanh"), r"hidden_activation='tanh' is not supported"),
    (dict(architectures=["ModernBertForMultipleChoice"]), r"ModernBertForMultipleChoice' is not supported"),
])
def test_unsupported_configs_are_named(mlm_folder, tmp_path, changes, match):
    with pytest.raises(InteropError, match=match):
        pretune.from_hf(_with_config(mlm_folder, tmp_path / "bad", **changes))


def test_configs_without_an_equivalent_are_refused_with_the_reason(tmp_path):
    model = pretune.build_model("tiny-modernbert-base", first_attn_norm=True)
    with pytest.raises(InteropError, match=r"modernbert: needs first_attn_norm=False"):
        pretune.to_hf(model, tmp_path / "x")
    model = pretune.build_model("tiny-modernbert-base", n_kv_heads=2)
    with pytest.raises(InteropError, match=r"modernbert: needs plain multi-head attention"):
        pretune.to_hf(model, tmp_path / "y")


@pytest.mark.parametrize("head", ["mlm", "classification", "tagging"])
def test_the_preset_exports_to_transformers(head, tmp_path):
    """tiny-modernbert-base (layer 0 global, layer 1 local within 65 keys, bases 160000 / 10000) and its task heads."""
    kw = dict(num_labels=3, head=head) if head != "mlm" else {}
    model = pretune.build_model("tiny-modernbert-base", **kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    pretune.to_hf(model, tmp_path / "hf")
    arch = json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    hf = getattr(T, arch).from_pretrained(tmp_path / "hf").eval()
    assert hf.config.layer_types == ["full_attention", "sliding_attention"] and hf.config.local_attention == 128
    ids, mask = _padded()
    _assert_same(hf, model, ids, mask)
