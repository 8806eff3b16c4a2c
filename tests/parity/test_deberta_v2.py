"""Parity with transformers for DeBERTa-v2/v3 (``model_type: "deberta-v2"``; our position "disentangled").

Random-weight transformers models from small unusual configs (8 or 6 position buckets reaching 16 or 20 on rows of
30 tokens, no buckets at all with distances clipped at 12, 4 or 2 heads, token types or none, untied decoders, the
legacy ``cls.predictions`` and the new ``lm_predictions`` MLM layouts, gelu / tanh / gelu_new activations), every
parameter perturbed: imported logits within 1e-4 on a right-padded batch, exports that transformers' Auto classes
load with no missing or unexpected tensor and the same logits, identical round trips, every task head, the presets,
the settings pretune refuses, and a tiny MLM pretraining run that exports to DebertaV2ForMaskedLM."""

from __future__ import annotations

import json

import pytest
import torch

import pretune
from pretune import InteropError
from pretune.interop import deberta_v2

T = pytest.importorskip("transformers")

V = 99
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
V3 = dict(relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm",
          position_biased_input=False)


def _config(**kw) -> T.DebertaV2Config:
    base = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                max_position_embeddings=64, position_buckets=8, max_relative_positions=16, type_vocab_size=0,
                **V3)
    return T.DebertaV2Config(**{**base, **kw})


# name -> (transformers class, config)
CASES = {
    "mlm-legacy": ("DebertaV2ForMaskedLM", lambda: _config()),
    "mlm-lm-predictions": ("DebertaV2ForMaskedLM", lambda: _config(  # the released checkpoints' head layout
        legacy=False, num_attention_heads=2, num_hidden_layers=3, position_buckets=6, max_relative_positions=20,
        type_vocab_size=2, hidden_act="gelu_new", pos_att_type="p2c|c2p", layer_norm_eps=1e-5)),
    "mlm-untied-no-buckets": ("DebertaV2ForMaskedLM", lambda: _config(
        tie_word_embeddings=False, position_buckets=-1, max_relative_positions=12, pad_token_id=1)),
    "body": ("DebertaV2Model", lambda: _config(max_relative_positions=-1, type_vocab_size=1)),
    "seq": ("DebertaV2ForSequenceClassification", lambda: _config(id2label=LABELS, cls_dropout=0.2)),
    "seq-tanh-regression": ("DebertaV2ForSequenceClassification", lambda: _config(
        num_labels=1, problem_type="regression", pooler_hidden_act="tanh", type_vocab_size=2)),
    "token": ("DebertaV2ForTokenClassification", lambda: _config(num_labels=5)),
    "qa": ("DebertaV2ForQuestionAnswering", lambda: _config(position_buckets=-1, max_relative_positions=10)),
}
AUTO = {"DebertaV2ForMaskedLM": T.AutoModelForMaskedLM, "DebertaV2Model": T.AutoModel,
        "DebertaV2ForSequenceClassification": T.AutoModelForSequenceClassification,
        "DebertaV2ForTokenClassification": T.AutoModelForTokenClassification,
        "DebertaV2ForQuestionAnswering": T.AutoModelForQuestionAnswering}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _perturb(model, seed: int = 0, scale: float = 0.1):
    """Norms start at 1 and biases at 0: perturb every tensor so each one is tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def _batch(n_types: int = 0):
    """Rows of 30 tokens (beyond every bucket range above), the last two right-padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 21:] = 0
    mask[2, 6:] = 0
    types = torch.randint(0, n_types, ids.shape, generator=g) if n_types > 1 else None
    return ids, mask, types


def _outputs(hf_out) -> torch.Tensor:
    if getattr(hf_out, "start_logits", None) is not None:
        return torch.stack([hf_out.start_logits, hf_out.end_logits], dim=-1)
    logits = getattr(hf_out, "logits", None)
    return logits if logits is not None else hf_out.last_hidden_state


def _assert_same(hf, ours, n_types: int = 0):
    ids, mask, types = _batch(n_types)
    with torch.no_grad():
        want = _outputs(hf(input_ids=ids, attention_mask=mask, token_type_ids=types))
        out = ours(ids, attention_mask=mask, token_type_ids=types)
    got = out.logits if out.logits is not None else out.last_hidden_state
    assert got.shape == want.shape
    if got.dim() == 3:  # per token: the real tokens (transformers' padded rows attend to nothing, ours to the row)
        got, want = got[mask.bool()], want[mask.bool()]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(transformers model with every parameter perturbed, its folder, the same weights imported by pretune)."""
    cls, make = CASES[request.param]
    torch.manual_seed(0)
    hf = _perturb(getattr(T, cls)(make())).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path, pretune.from_hf(path)


def test_from_hf_logits_match(pair):
    hf, _, ours = pair
    assert ours.config.position == "disentangled"
    _assert_same(hf, ours, hf.config.type_vocab_size)


def test_to_hf_loads_in_transformers_with_same_logits(pair, tmp_path):
    hf, path, _ = pair
    ours = _perturb(pretune.from_hf(path), seed=3, scale=0.02)  # differ from the source: the export is tested
    pretune.to_hf(ours, tmp_path / "out")
    cls = type(hf)
    reloaded, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(AUTO[cls.__name__].from_pretrained(tmp_path / "out")) is cls
    _assert_same(reloaded.eval(), ours, hf.config.type_vocab_size)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    if "id2label" in hf.config.to_dict() and hf.config.num_labels == 3:
        assert saved["id2label"] == {str(k): v for k, v in LABELS.items()}


def test_round_trip_is_identical(pair, tmp_path):
    _, _, ours = pair
    pretune.to_hf(ours, tmp_path / "rt")
    again = pretune.from_hf(tmp_path / "rt")
    assert again.config == ours.config
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_imported_config_is_the_deberta_one(pair):
    hf, _, ours = pair
    cfg, hc = ours.config, hf.config
    want_buckets = max(getattr(hc, "position_buckets", -1), 0)
    want_max = hc.max_relative_positions if hc.max_relative_positions >= 1 else hc.max_position_embeddings
    assert (cfg.position_buckets, cfg.max_relative_positions) == (want_buckets, want_max)
    assert cfg.token_types == hc.type_vocab_size and cfg.norm_placement == "post" and cfg.pooler is False
    assert cfg.cls_act == {"gelu": "gelu", "tanh": "tanh"}[hc.pooler_hidden_act]
    if type(hf).__name__ == "DebertaV2ForSequenceClassification":
        assert cfg.sentence_pooling == "cls"
        assert cfg.classifier_dropout == getattr(hc, "cls_dropout", None)


def test_show_counts_equal_transformers(pair):
    hf, _, ours = pair
    unused = 0
    if not hf.config.tie_word_embeddings and getattr(hf, "cls", None) is not None:
        unused = hf.config.vocab_size  # an untied legacy decoder adds its own bias; cls.predictions.bias is unused
    assert pretune.count_parameters(ours)["total"] == hf.num_parameters() - unused


def test_log_buckets_equal_transformers():
    modeling = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")
    from pretune.model.position import log_buckets

    rel = torch.arange(-700, 701)[:, None] - torch.zeros(1, 1, dtype=torch.long)
    for buckets, max_distance in [(256, 512), (8, 16), (6, 20), (5, 9), (64, 128)]:
        want = modeling.make_log_bucket_position(rel, buckets, max_distance).long()
        assert torch.equal(log_buckets(rel, buckets, max_distance), want), (buckets, max_distance)


# --- our models to transformers -------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny-deberta-v3-base", "tiny-deberta-v3-xsmall"])
@pytest.mark.parametrize("head,extra", [
    ("mlm", {}), ("none", {}), ("classification", {"num_labels": 3, "labels": ["a", "b", "c"]}),
    ("regression", {"num_labels": 1}), ("tagging", {"num_labels": 4}), ("qa", {"num_labels": 2}),
    ("mlm", {"tie_embeddings": False, "token_types": 2, "ffn": "gelu_tanh", "head_act": "gelu_tanh"}),
    ("classification", {"num_labels": 2, "cls_act": "tanh", "position_buckets": 0, "max_relative_positions": 9}),
])
def test_our_presets_export_to_transformers(preset, head, extra, tmp_path):
    torch.manual_seed(0)
    model = _perturb(pretune.build_model(preset, head=head, dropout=0.0, attn_dropout=0.0, **extra)).eval()
    pretune.to_hf(model, tmp_path / "hf")
    arch = json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    hf, info = getattr(T, arch).from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    _assert_same(hf.eval(), model, model.config.token_types)
    unused = model.config.vocab_size if head == "mlm" and not model.config.tie_embeddings else 0  # as above
    assert pretune.count_parameters(model)["total"] == hf.num_parameters() - unused


@pytest.mark.parametrize("name", ["deberta-v3-xsmall", "deberta-v3-small", "deberta-v3-base", "deberta-v3-large"])
def test_preset_counts_equal_transformers(name, tmp_path):
    """`pretune show NAME` counts what transformers' DebertaV2ForMaskedLM of the same config counts."""
    with torch.device("meta"):
        model = pretune.build_model(name)
    hf_cfg = T.DebertaV2Config(**{k: v for k, v in deberta_v2.config_to_hf(model.config).items()
                                  if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf = T.DebertaV2ForMaskedLM(hf_cfg)
    assert pretune.count_parameters(model)["total"] == hf.num_parameters()


# --- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value,match", [
    ("conv_kernel_size", 3, r"conv_kernel_size=3 is not supported .*convolution"),
    ("share_att_key", False, r"share_att_key=False is not supported .*pos_key_proj"),
    ("position_biased_input", True, r"position_biased_input=True is not supported"),
    ("pos_att_type", ["c2p"], r"pos_att_type=\['c2p'\] is not supported"),
    ("norm_rel_ebd", "none", r"norm_rel_ebd='none' is not supported"),
    ("relative_attention", False, r"relative_attention=False is not supported"),
    ("embedding_size", 16, r"embedding_size=16 is not supported"),
    ("hidden_act", "mish", r"hidden_act='mish' is not supported"),
    ("pooler_hidden_act", "mish", r"pooler_hidden_act='mish' is not supported"),
    ("architectures", ["DebertaV2ForMultipleChoice"], r"DebertaV2ForMultipleChoice.* not supported"),
])
def test_unsupported_settings_are_refused(key, value, match, tmp_path):
    T.DebertaV2Model(_config()).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InteropError, match=match):
        pretune.from_hf(tmp_path)


@pytest.mark.parametrize("overrides,match", [
    ({"embed_dim": 16}, r"deberta_v2: needs embed_dim=None"),
    ({"attn_scale": 0.5}, r"deberta_v2: needs attn_scale=None"),
    ({"norm_placement": "pre"}, r"deberta_v2: needs norm_placement='post'"),
    ({"ffn": "swiglu"}, r"deberta_v2: needs a non-gated FFN"),
    ({"head_act": "relu"}, r"deberta_v2: the MLM head's activation is hidden_act"),
])
def test_exports_without_an_equivalent_are_refused(overrides, match, tmp_path):
    model = pretune.build_model("tiny-deberta-v3-base", **overrides)
    with pytest.raises(InteropError, match=match):
        pretune.to_hf(model, tmp_path / "hf")


# --- pretraining ---------------------------------------------------------------------------------------------
def test_mlm_pretraining_run_exports_to_transformers(tmp_path, small_corpus, tokenizers_by_kind):
    """A few steps of `pretune pretrain` (MLM) on tiny-deberta-v3-base; the checkpoint exports to a folder
    DebertaV2ForMaskedLM loads with the same logits."""
    from pretune.jobs.pretrain import load_run_config, pretrain

    cfg = load_run_config(overrides=[
        "model.preset=tiny-deberta-v3-base", "objective.name=mlm", f"tokenizer={tokenizers_by_kind['wordpiece']}",
        f"train.out={tmp_path / 'run'}", "train.steps=6", "train.batch_size=8", "train.lr=1e-2",
        "train.warmup_steps=2", "train.log_every=1", "train.eval_every=0", "train.save_every=0",
        "train.tensorboard=false", "train.plot=false", "data.block_size=60", "model.max_seq_len=128"])
    cfg.data.train = [str(small_corpus)]
    result = pretrain(cfg, show_progress=False, log=lambda *_: None)
    model = pretune.load(result.model_dir)
    assert model.config.position == "disentangled" and model.config.head == "mlm"
    pretune.to_hf(model, tmp_path / "hf")
    hf = T.DebertaV2ForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, model.config.vocab_size, (2, 50), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4)
