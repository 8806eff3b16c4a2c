"""A sentence-transformers folder records the pooling its model was trained with (modules.json + 1_Pooling/);
an imported base model keeps it, so a classification head added later reads the mean-pooled vector the model
was trained to make rather than the BERT pooler. Task models and plain folders are unchanged."""

import json

import pytest

import pretune
from pretune.interop import from_hf, sentence_pooling, to_hf


def _st_folder(tmp_path, mode: dict | None):
    hf = tmp_path / "hf"
    to_hf(pretune.build_model("tiny-bert-base", head="none", pooler=True), hf)  # as all-MiniLM-L6-v2
    if mode is not None:
        (hf / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (hf / "1_Pooling").mkdir()
        (hf / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **mode}))
    return hf


@pytest.mark.parametrize("mode, expected", [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),
    ({"pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_max_tokens": True}, None),
    (None, None)])
def test_the_recorded_pooling_is_read(tmp_path, mode, expected):
    assert sentence_pooling(_st_folder(tmp_path, mode)) == expected


def test_a_mean_pooled_sentence_model_gives_its_classification_head_mean_pooling(tmp_path):
    hf = _st_folder(tmp_path, {"pooling_mode_mean_tokens": True})
    model = from_hf(hf)
    assert model.config.pooling == "mean"
    assert model.with_head(head="classification", num_labels=3).config.sentence_pooling == "mean"
    assert from_hf(_st_folder(tmp_path / "plain", None)).config.sentence_pooling == "pooler"  # transformers' choice


def test_a_classifier_finetuned_that_way_says_how_to_get_an_exportable_one(tmp_path):
    from pretune.interop import InteropError

    clf = from_hf(_st_folder(tmp_path, {"pooling_mode_mean_tokens": True})).with_head(head="classification",
                                                                                      num_labels=2)
    with pytest.raises(InteropError, match="task.pooling=pooler"):
        to_hf(clf, tmp_path / "out")
    ok = clf.with_head(head="classification", num_labels=2, pooling="pooler")
    to_hf(ok, tmp_path / "out2")
    assert json.loads((tmp_path / "out2" / "config.json").read_text())["architectures"] == [
        "BertForSequenceClassification"]
