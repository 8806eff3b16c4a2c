"""The rerank task (a cross-encoder): its losses equal sentence-transformers' cross-encoder losses on a fixed batch
(binary cross-entropy; listwise = ST's ListNetLoss with a one-hot target), the ranking metrics by hand, bad records
named, and a run whose model/ CrossEncoder(folder) scores as pretune does."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from bert_fixtures import load_tiny, tiny_bert_folder  # noqa: E402

from pretune.data.readers import DataError  # noqa: E402
from pretune.loading import load_pretrained  # noqa: E402
from pretune.tasks import TaskConfig, build_task  # noqa: E402
from pretune.tasks.base import Record  # noqa: E402
from pretune.tasks.rerank import rerank_metrics  # noqa: E402

WORDS = ("the a cat dog sat ran on under mat tree big small red blue house car man woman child plays reads "
         "book ball park river bank money walk fast slow old new green in with an has of who what where").split()
LISTS = [("who sat on the mat", "the cat sat on the mat", ["the man reads a book", "a red car"]),
         ("where did the dog run", "a dog ran in the park", ["money in the bank", "an old house"]),
         ("what does the child play", "the child plays with a ball", ["a blue ball in the park", "the woman reads"])]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random-weight BertForSequenceClassification with one label (every parameter perturbed) and a
    word-level WordPiece vocabulary, as a Hugging Face folder both libraries read."""
    return tiny_bert_folder(tmp_path_factory.mktemp("tiny_ce"), [*WORDS, "did", "does", "run", "play"],
                            transformers.BertForSequenceClassification, num_labels=1)


@pytest.fixture(scope="module")
def ours(folder):
    model, tok = load_tiny(folder)
    return model.eval(), tok


def _loss(ours, records, **cfg):
    model, tok = ours
    task = build_task(TaskConfig(name="rerank", **cfg), model.config, tok)
    batch = task.collate([f for r in records for f in task.encode(r)])
    loss, _ = task.loss(model, batch, task.counts(batch))
    return float(loss)


def test_listwise_equals_sentence_transformers(ours, folder):
    """ST's ListNetLoss is the cross-entropy of softmax(scores) against softmax(labels): with the positive's label
    100 above the negatives' the target is one-hot (to e^-100), which is the listwise loss."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.cross_encoder.losses import ListNetLoss

    records = [Record(f"l:{i}", {"query": q, "positive": p, "negative": n}) for i, (q, p, n) in enumerate(LISTS)]
    ce = CrossEncoder(str(folder), device="cpu")
    ce.eval()
    with torch.no_grad():
        want = ListNetLoss(ce, activation_fn=torch.nn.Identity())(
            [[q for q, _, _ in LISTS], [[p, *n] for _, p, n in LISTS]],
            [torch.tensor([100.0] + [0.0] * len(n)) for _, _, n in LISTS])
        got = _loss(ours, records)
    assert abs(got - float(want)) < 1e-5, (got, float(want))


def test_bce_equals_sentence_transformers(ours, folder):
    from sentence_transformers import CrossEncoder
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    pairs = [(q, d, 1.0) for q, d, _ in LISTS] + [(q, n[0], 0.0) for q, _, n in LISTS]
    records = [Record(f"j:{i}", {"query": q, "document": d, "label": y}) for i, (q, d, y) in enumerate(pairs)]
    ce = CrossEncoder(str(folder), device="cpu")
    ce.eval()
    with torch.no_grad():
        want = BinaryCrossEntropyLoss(ce)([[q for q, _, _ in pairs], [d for _, d, _ in pairs]],
                                          torch.tensor([y for _, _, y in pairs]))
        got = _loss(ours, records)
    assert abs(got - float(want)) < 1e-5, (got, float(want))


def test_rerank_metrics_by_hand():
    # query 1: the relevant one ranked 2nd of 3; query 2: graded gains 2, 0, 1 ranked as given
    m = rerank_metrics([[(0.9, 0), (0.5, 1), (0.1, 0)], [(3.0, 2), (2.0, 0), (1.0, 1)], [(1.0, 0)]])
    ideal2 = 2 + 1 / 1.584962500721156
    assert m["mrr@10"] == pytest.approx((0.5 + 1) / 2)
    assert m["ndcg@10"] == pytest.approx((1 / 1.584962500721156 + (2 + 1 / 2) / ideal2) / 2)
    assert m["map"] == pytest.approx((0.5 + (1 + 2 / 3) / 2) / 2)


@pytest.mark.parametrize("data,message", [
    ({"query": "who", "positive": "the cat"}, "missing field 'negative'"),
    ({"query": "who", "document": "the cat"}, "missing field 'label'"),
    ({"query": "who", "document": "the cat", "label": "yes"}, "field 'label' should be int or float"),
    ({"question": "who"}, "missing field 'query'"),
    ({"query": "who"}, "expected 'query' with 'positive'"),
])
def test_bad_records_are_named(ours, data, message):
    model, tok = ours
    task = build_task(TaskConfig(name="rerank"), model.config, tok)
    with pytest.raises(DataError, match=message) as err:
        task.encode(Record("train.jsonl:3", data))
    assert "train.jsonl:3" in str(err.value)


def test_a_run_exports_what_cross_encoder_scores_alike(folder, tmp_path):
    from sentence_transformers import CrossEncoder

    from pretune.jobs.finetune import finetune, load_finetune_config

    rows = [{"query": q, "positive": p, "negative": n} for q, p, n in LISTS]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    cfg = load_finetune_config(None, [f"model.init={folder}", "task.name=rerank", f"train.out={tmp_path / 'run'}",
                                      f"data.train={tmp_path / 'train.jsonl'}", f"data.dev={tmp_path / 'train.jsonl'}",
                                      "train.batch_size=3", "tune.epochs=4", "train.lr=1e-3"])
    result = finetune(cfg, show_progress=False, log=lambda *a, **k: None)
    assert result.dev["mrr@10"] >= result.history[0][1]["mrr@10"] and result.dev["mrr@10"] > 0.5
    pairs = [[q, d] for q, p, n in LISTS for d in [p, *n]]
    want = CrossEncoder(str(result.model_dir), device="cpu").predict(pairs, activation_fn=torch.nn.Identity(),
                                                                     convert_to_tensor=True)
    loaded = load_pretrained(result.model_dir)
    task = build_task(TaskConfig(name="rerank"), loaded.model.config, loaded.tokenizer)
    batch = task.collate(task.encode(Record("x:1", {"query": LISTS[0][0], "positive": LISTS[0][1],
                                                    "negative": LISTS[0][2]})))
    with torch.no_grad():
        got = task.scores(loaded.model.eval(), batch)
    torch.testing.assert_close(got, want[:3].float(), atol=1e-5, rtol=0)


def test_a_model_transformers_cannot_hold_stays_a_pretune_checkpoint(ours, tmp_path):
    """BERT without its pooler classifies [CLS] with pretune's dense + tanh, which no BertForSequenceClassification
    computes: model/ keeps pretune's files and the run says why."""
    import pretune
    from pretune.io.checkpoint import save

    model, tok = ours
    bare = pretune.build_model(model.config.replace(pooler=False, pooling=None))
    save(bare, tmp_path / "model", tokenizer=tok)
    before = sorted(p.name for p in (tmp_path / "model").iterdir())
    lines = []
    task = build_task(TaskConfig(name="rerank"), bare.config, tok)
    assert task.write_model_files(bare, tok, tmp_path / "model", lines.append) == []
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == before
    assert len(lines) == 1 and "stays a pretune checkpoint" in lines[0]
    assert load_pretrained(tmp_path / "model").model.config.sentence_pooling == "cls"


def test_a_lora_run_writes_merged_weights_cross_encoder_scores_alike(folder, tmp_path):
    """--peft lora: model/ is the base with the adapter (and its trained head) merged in, a folder CrossEncoder loads
    and scores as the adapter does in pretune; the adapter itself is in RUN/adapter."""
    from sentence_transformers import CrossEncoder

    from pretune.jobs.finetune import finetune, load_finetune_config

    rows = [{"query": q, "positive": p, "negative": n} for q, p, n in LISTS]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    cfg = load_finetune_config(None, [f"model.init={folder}", "task.name=rerank", f"train.out={tmp_path / 'run'}",
                                      f"data.train={tmp_path / 'train.jsonl'}", "peft.method=lora",
                                      "train.batch_size=3", "tune.epochs=2", "train.lr=5e-2", "train.plot=false"])
    run = finetune(cfg, show_progress=False, log=lambda *a, **k: None).run_dir
    assert (run / "adapter" / "adapter_config.json").is_file() and not (run / "model" / "adapter_config.json").exists()

    def pretune_scores(path):
        loaded = load_pretrained(path)
        task = build_task(TaskConfig(name="rerank"), loaded.model.config, loaded.tokenizer)
        batch = task.collate([f for i, (q, p, n) in enumerate(LISTS)
                              for f in task.encode(Record(f"x:{i}", {"query": q, "positive": p, "negative": n}))])
        with torch.no_grad():
            return task.scores(loaded.model.eval(), batch)

    adapter = pretune_scores(run / "adapter")  # the trained adapter on its base, unmerged
    assert (adapter - pretune_scores(folder)).abs().max() > 1e-3  # training moved the scores
    pairs = [[q, d] for q, p, n in LISTS for d in [p, *n]]
    want = CrossEncoder(str(run / "model"), device="cpu").predict(pairs, activation_fn=torch.nn.Identity(),
                                                                  convert_to_tensor=True)
    torch.testing.assert_close(adapter, want.float(), atol=1e-5, rtol=0)
