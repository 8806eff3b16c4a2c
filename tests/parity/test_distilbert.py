"""Parity with transformers for DistilBERT: DistilBertModel, DistilBertForMaskedLM (tied and untied projector,
sinusoidal positions, ReLU activation), DistilBertForSequenceClassification (pre_classifier + ReLU on [CLS]),
ForTokenClassification, ForQuestionAnswering.

Random-weight transformers models from unusual tiny configs (hidden_dim 37, 3 layers, 2 heads of 16), every parameter
perturbed: imported logits within 1e-4 on a right-padded batch, exports that transformers' Auto classes load with
no missing or unexpected tensors and the same logits, identical round trips, and ``pretune show``'s parameter count
equal to transformers'."""

from __future__ import annotations

import json

import pytest
import torch

import pretune
from pretune import ConfigError, InteropError
from pretune.model import count_parameters

T = pytest.importorskip("transformers")

V = 99
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _config(**kw):
    base = dict(vocab_size=V, dim=32, n_layers=3, n_heads=2, hidden_dim=37, max_position_embeddings=40,
                pad_token_id=0)
    return T.DistilBertConfig(**{**base, **kw})


# name -> (HF class, config extras, Auto class)
CASES = {
    "body": ("DistilBertModel", {}, "AutoModel"),
    "mlm": ("DistilBertForMaskedLM", {}, "AutoModelForMaskedLM"),
    "mlm-untied-relu": ("DistilBertForMaskedLM", {"tie_word_embeddings": False, "activation": "relu"},
                        "AutoModelForMaskedLM"),
    "mlm-sinusoidal": ("DistilBertForMaskedLM", {"sinusoidal_pos_embds": True}, "AutoModelForMaskedLM"),
    "seq": ("DistilBertForSequenceClassification", {"id2label": LABELS, "seq_classif_dropout": 0.3},
            "AutoModelForSequenceClassification"),
    "regression": ("DistilBertForSequenceClassification", {"num_labels": 1, "problem_type": "regression"},
                   "AutoModelForSequenceClassification"),
    "token": ("DistilBertForTokenClassification", {"num_labels": 5}, "AutoModelForTokenClassification"),
    "qa": ("DistilBertForQuestionAnswering", {}, "AutoModelForQuestionAnswering"),
}


def _randomize(model):
    """HF inits norms to 1/0 and biases to 0: perturb every tensor so each one is tested."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _batch():
    """Right-padded batch: real tokens never equal the pad id, padded positions hold it."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 3:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _hf_logits(hf, ids, mask):
    out = hf(input_ids=ids, attention_mask=mask)
    if hasattr(out, "start_logits"):
        return torch.stack([out.start_logits, out.end_logits], dim=-1)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _ours_logits(model, ids, mask):
    out = model(ids, attention_mask=mask)
    return out.logits if out.logits is not None else out.last_hidden_state


def _compare(a, b, mask):
    assert a.shape == b.shape
    if a.dim() == 2:  # one row per sequence
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    else:
        keep = mask.bool()
        torch.testing.assert_close(b[keep], a[keep], atol=1e-4, rtol=1e-4)


@pytest.fixture(params=list(CASES))
def case(request, tmp_path):
    cls, extra, auto = CASES[request.param]
    hf = _randomize(getattr(T, cls)(_config(**extra))).eval()
    hf.save_pretrained(tmp_path / "hf")
    return request.param, hf, tmp_path / "hf", auto


def test_from_hf_logits_match(case):
    name, hf, path, _ = case
    ours = pretune.from_hf(path)
    assert ours.config.token_types == 0 and ours.config.norm_eps == 1e-12
    ids, mask = _batch()
    with torch.no_grad():
        _compare(_hf_logits(hf, ids, mask), _ours_logits(ours, ids, mask), mask)


def test_to_hf_loads_in_transformers_with_same_logits(case, tmp_path):
    name, hf, path, auto = case
    ours = pretune.from_hf(path)
    with torch.no_grad():  # make our weights differ from the source so the export is really tested
        for p in ours.parameters():
            p.add_(0.01)
    pretune.to_hf(ours, tmp_path / "out")
    reloaded, info = getattr(T, auto).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(reloaded) is type(hf)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, mask = _batch()
    with torch.no_grad():
        _compare(_hf_logits(reloaded.eval(), ids, mask), _ours_logits(ours, ids, mask), mask)
    if name == "seq":
        exported = json.loads((tmp_path / "out" / "config.json").read_text())
        assert exported["id2label"] == {str(k): v for k, v in LABELS.items()}
        assert exported["seq_classif_dropout"] == 0.3


def test_round_trip_is_identical(case, tmp_path):
    _, _, path, _ = case
    ours = pretune.from_hf(path)
    pretune.to_hf(ours, tmp_path / "rt")
    again = pretune.from_hf(tmp_path / "rt")
    assert again.config == ours.config
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_show_counts_equal_transformers(case):
    _, hf, path, _ = case
    assert count_parameters(pretune.from_hf(path))["total"] == sum(p.numel() for p in hf.parameters())


def test_imported_heads_have_distilbert_shape(case):
    name, _, path, _ = case
    cfg = pretune.from_hf(path).config
    expected = {"body": "none", "mlm": "mlm", "mlm-untied-relu": "mlm", "mlm-sinusoidal": "mlm",
                "seq": "classification", "regression": "regression", "token": "tagging", "qa": "qa"}[name]
    assert cfg.head == expected
    if expected in ("classification", "regression"):
        assert (cfg.sentence_pooling, cfg.cls_act) == ("cls", "relu")
    if name == "seq":
        assert cfg.labels == list(LABELS.values()) and cfg.classifier_dropout == 0.3


def test_classifier_added_to_an_imported_body_exports(tmp_path):
    """Every imported DistilBERT records cls_act='relu', so a classifier finetuned on its body is DistilBERT's."""
    T.DistilBertModel(_config()).save_pretrained(tmp_path / "body")
    model = pretune.from_hf(tmp_path / "body").with_head(head="classification", num_labels=3).eval()
    assert (model.config.sentence_pooling, model.config.cls_act) == ("cls", "relu")
    pretune.to_hf(model, tmp_path / "out")
    hf = T.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "DistilBertForSequenceClassification"
    ids, mask = _batch()
    with torch.no_grad():
        _compare(_hf_logits(hf, ids, mask), _ours_logits(model, ids, mask), mask)


def test_distilbert_preset_exports_and_counts(tmp_path):
    """The preset's tiny twin exports to DistilBertForMaskedLM with the same logits; the full size has
    DistilBERT's published parameter count (distilbert-base-uncased: 66,985,530 with the tied projector)."""
    model = pretune.build_model("tiny-distilbert-base", dropout=0.0, attn_dropout=0.0).eval()
    pretune.to_hf(model, tmp_path / "hf")
    hf = T.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "DistilBertForMaskedLM"
    ids, mask = _batch()
    with torch.no_grad():
        _compare(_hf_logits(hf, ids, mask), _ours_logits(model, ids, mask), mask)
    with torch.device("meta"):
        full = pretune.build_model("distilbert-base")
        ref = T.DistilBertForMaskedLM(T.DistilBertConfig())
    assert count_parameters(full)["total"] == sum(p.numel() for p in ref.parameters()) == 66_985_530


def test_sinusoidal_positions_export(tmp_path):
    """A pretune model with sinusoidal positions exports its table with sinusoidal_pos_embds=True."""
    model = pretune.build_model("tiny-distilbert-base", position="sinusoidal", dropout=0.0, attn_dropout=0.0).eval()
    pretune.to_hf(model, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["sinusoidal_pos_embds"] is True
    hf = T.DistilBertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    ids, mask = _batch()
    with torch.no_grad():
        _compare(_hf_logits(hf, ids, mask), _ours_logits(model, ids, mask), mask)


def test_bad_configs_are_named(tmp_path):
    hf = T.DistilBertForMaskedLM(_config())
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "activation": "tanh"}))
    with pytest.raises(InteropError, match="activation='tanh'"):
        pretune.from_hf(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "architectures": ["DistilBertForMultipleChoice"]}))
    with pytest.raises(InteropError, match="DistilBertForMultipleChoice"):
        pretune.from_hf(tmp_path / "hf")
    model = pretune.build_model("tiny-distilbert-base", head="classification", num_labels=2, cls_act="tanh")
    with pytest.raises(InteropError, match="ReLU"):  # a tanh head is RoBERTa's, not DistilBERT's
        pretune.to_hf(model, tmp_path / "out")
    with pytest.raises(ConfigError):
        pretune.build_model("tiny-distilbert-base", cls_act="sigmoid")
