"""pretune finetune / evaluate / predict: modes (full, frozen body, from scratch, keep-best, early
stopping), the saved checkpoint (label map, task.json, HF export) and bad input naming its row."""

import json

import pytest
import torch
import yaml

from conftest import corpus_paragraphs
from pretune import load
from pretune.cli import main
from pretune.config import ConfigError
from pretune.data.readers import DataError
from pretune.jobs.finetune import evaluate, finetune, load_finetune_config, predict


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def sentences():
    out = []
    for p in corpus_paragraphs("austen.txt.gz", 200):
        out += [s.strip() + "." for s in p.replace("\n", " ").split(".") if len(s.split()) >= 4]
    return out[:400]


@pytest.fixture(scope="module")
def cls_data(tmp_path_factory, sentences):
    """A learnable labelling of real sentences: 'question' when the sentence contains a question-ish word."""
    d = tmp_path_factory.mktemp("cls")

    def label(s):
        return "long" if len(s.split()) > 14 else "short"

    rows = [{"text": s, "label": label(s)} for s in sentences]
    return {"train": _write(d / "train.jsonl", rows[:240]), "dev": _write(d / "dev.jsonl", rows[240:320]),
            "test": _write(d / "test.jsonl", rows[320:400]), "dir": d}


def _cfg(tokenizers_by_kind, data, out, *extra, preset="tiny-bert-base", task="classification"):
    return load_finetune_config(None, [f"model.preset={preset}", f"tokenizer={tokenizers_by_kind['wordpiece']}",
                                       f"task.name={task}", f"data.train={data['train']}", f"data.dev={data['dev']}",
                                       f"data.test={data['test']}", f"train.out={out}", "train.batch_size=16",
                                       "train.lr=2e-3", "tune.epochs=2", "train.plot=false", *extra])


def test_finetune_saves_a_checkpoint_with_label_map_and_task(tokenizers_by_kind, cls_data, tmp_path):
    res = finetune(_cfg(tokenizers_by_kind, cls_data, tmp_path / "run"), show_progress=False, log=lambda *a: None)
    model = load(res.model_dir)
    assert model.config.head == "classification" and model.config.labels == ["long", "short"]
    task = json.loads((res.model_dir / "task.json").read_text())
    assert task["name"] == "classification" and task["text_field"] == "text"
    assert (res.model_dir / "tokenizer.json").is_file()
    results = json.loads((res.run_dir / "results.json").read_text())
    assert results["test"] == res.test and 0 <= res.test["accuracy"] <= 1
    assert set(res.test) == {"accuracy", "macro_f1", "micro_f1", "mcc"}
    # what the dev score is judged against (the task's baseline) and the warnings when it is no better
    assert results["baseline"]["what"] == "always 'long' (the most frequent training label, 53%)"
    assert results["baseline"]["split"] == "dev" and results["warnings"] == res.warnings
    # evaluate reproduces the run's own test score; predict writes one line per record
    again = evaluate(res.model_dir, cls_data["test"], show_progress=False)
    assert again["accuracy"] == pytest.approx(res.test["accuracy"])
    n = predict(res.model_dir, cls_data["test"], tmp_path / "p.jsonl", show_progress=False)
    lines = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert n == len(lines) == 80 and lines[0]["row"] == "test.jsonl:1" and lines[0]["prediction"] in ("long", "short")


def test_keep_best_restores_the_best_dev_evaluation(tokenizers_by_kind, cls_data, tmp_path):
    # fp32: the run's dev evaluations then compute what evaluate() does (under bf16 autocast a borderline example
    # could flip between the two, seen once on an AMD EPYC with native bf16)
    cfg = _cfg(tokenizers_by_kind, cls_data, tmp_path / "run", "tune.evals_per_epoch=3", "tune.epochs=3",
               "train.precision=fp32")
    res = finetune(cfg, show_progress=False, log=lambda *a: None)
    accs = [h["accuracy"] for _, h in res.history]
    assert len(accs) >= 6
    best_step, best = max(res.history, key=lambda h: h[1]["accuracy"])
    assert res.best_step == best_step and res.dev["accuracy"] == best["accuracy"]
    again = evaluate(res.model_dir, cls_data["dev"], show_progress=False)
    assert again["accuracy"] == pytest.approx(best["accuracy"])  # the saved model is the best one


def test_early_stopping_stops_after_patience(tokenizers_by_kind, cls_data, tmp_path):
    # lr 0 → no evaluation ever improves on the first: stop after `patience` more evaluations
    cfg = _cfg(tokenizers_by_kind, cls_data, tmp_path / "run", "tune.evals_per_epoch=4", "tune.patience=2",
               "train.lr=1e-12", "tune.epochs=5")
    res = finetune(cfg, show_progress=False, log=lambda *a: None)
    assert len(res.history) == 3 and res.best_step == res.history[0][0]
    assert json.loads((res.run_dir / "results.json").read_text())["stopped_early"] is True


def test_a_run_that_cannot_learn_warns_with_the_numbers_and_what_to_try(tokenizers_by_kind, tmp_path):
    # every text the same: no model beats the majority class; a batch of the whole training set at lr 1e-12 without
    # dropout: every step's loss is the same, so it does not fall
    d = tmp_path / "data"
    d.mkdir()
    labels = ["a", "b", "a", "a", "b"] * 8  # 60% 'a'
    rows = [{"text": "the same words every time", "label": x} for x in labels]
    data = {"train": _write(d / "train.jsonl", rows), "dev": _write(d / "dev.jsonl", rows[:20]),
            "test": _write(d / "test.jsonl", rows[:10])}
    lines = []
    cfg = _cfg(tokenizers_by_kind, data, tmp_path / "run", "train.batch_size=64", "tune.epochs=0", "train.steps=6",
               "train.lr=1e-12", "model.dropout=0.0")
    res = finetune(cfg, show_progress=False, log=lines.append)
    results = json.loads((res.run_dir / "results.json").read_text())
    assert results["warnings"] == res.warnings
    by_kind = {w["kind"]: w for w in res.warnings}
    assert set(by_kind) == {"no_better_than_baseline", "loss_did_not_fall"}
    base = by_kind["no_better_than_baseline"]
    assert base["baseline"] == results["baseline"]["accuracy"] == 0.6  # the dev records are 60% 'a' too
    assert base["baseline_what"] == "always 'a' (the most frequent training label, 60%)"
    assert base["value"] == res.dev["accuracy"] <= 0.6 and base["metric"] == "accuracy" and base["split"] == "dev"
    loss = by_kind["loss_did_not_fall"]
    assert loss["last"] == pytest.approx(loss["first"], rel=1e-4) and loss["steps_averaged"] == 1
    said = lines[-1]  # the last thing the run says
    assert said.startswith("warning: training did not take: dev accuracy") and "the train loss did not fall" in said
    assert "6 optimizer steps (6 epochs of 1 step of 40 examples) at lr 1e-12" in said
    assert "--epochs 12" in said and "--lr 5e-05" in said and f"check the labels in {data['train']}" in said


def test_freeze_body_trains_only_the_head(tokenizers_by_kind, cls_data, tmp_path):
    first = finetune(_cfg(tokenizers_by_kind, cls_data, tmp_path / "a", "tune.epochs=1"), show_progress=False,
                     log=lambda *a: None)
    cfg = load_finetune_config(None, [f"model.init={first.model_dir}", "task.name=classification",
                                      f"data.train={cls_data['train']}", f"data.dev={cls_data['dev']}",
                                      f"train.out={tmp_path / 'b'}", "tune.freeze_body=true", "tune.epochs=1",
                                      "train.lr=1e-2", "train.batch_size=16", "tune.keep_best=false",
                                      "train.plot=false"])
    res = finetune(cfg, show_progress=False, log=lambda *a: None)
    before, after = load(first.model_dir).state_dict(), load(res.model_dir).state_dict()
    for k in before:
        if k.startswith("head."):
            assert not torch.equal(before[k], after[k]), k
        else:
            assert torch.equal(before[k], after[k]), k


def test_from_scratch_keeps_the_architecture_and_drops_the_weights(tokenizers_by_kind, cls_data, tmp_path):
    first = finetune(_cfg(tokenizers_by_kind, cls_data, tmp_path / "a", "tune.epochs=1"), show_progress=False,
                     log=lambda *a: None)
    cfg = load_finetune_config(None, [f"model.init={first.model_dir}", "task.name=classification",
                                      f"data.train={cls_data['train']}", f"train.out={tmp_path / 'b'}",
                                      "tune.from_scratch=true", "train.lr=1e-12", "tune.epochs=1",
                                      "train.batch_size=16", "train.plot=false"])
    res = finetune(cfg, show_progress=False, log=lambda *a: None)
    a, b = load(first.model_dir), load(res.model_dir)
    assert a.config == b.config
    emb_a, emb_b = a.transformer.embed.weight, b.transformer.embed.weight
    assert emb_a.shape == emb_b.shape and not torch.allclose(emb_a, emb_b)


def test_finetuned_model_exports_to_hf_sequence_classification(tokenizers_by_kind, cls_data, tmp_path):
    transformers = pytest.importorskip("transformers")
    from pretune import to_hf

    cfg = _cfg(tokenizers_by_kind, cls_data, tmp_path / "run", "tune.epochs=1", "model.pooler=true")
    res = finetune(cfg, show_progress=False, log=lambda *a: None)
    ours = load(res.model_dir)
    to_hf(ours, tmp_path / "hf")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "BertForSequenceClassification"
    assert hf.config.id2label == {0: "long", 1: "short"}
    x = torch.randint(5, 500, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, ours(x).logits, atol=1e-5, rtol=1e-5)


# -- bad input: each a clear error naming the row -------------------------------------------------
def test_unknown_label_at_test_time_names_the_row(tokenizers_by_kind, cls_data, tmp_path):
    res = finetune(_cfg(tokenizers_by_kind, cls_data, tmp_path / "run", "tune.epochs=1"), show_progress=False,
                   log=lambda *a: None)
    bad = _write(tmp_path / "bad.jsonl", [{"text": "a fine day.", "label": "short"},
                                          {"text": "another day.", "label": "medium"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: label 'medium' is not in the model's label map \(long, short"):
        evaluate(res.model_dir, bad, show_progress=False)


def test_labels_that_do_not_match_the_models_label_map(tokenizers_by_kind, cls_data, tmp_path):
    res = finetune(_cfg(tokenizers_by_kind, cls_data, tmp_path / "run", "tune.epochs=1"), show_progress=False,
                   log=lambda *a: None)
    rows = [{"text": f"sentence number {i}.", "label": "short"} for i in range(20)]
    rows[7]["label"] = "positive"
    train = _write(tmp_path / "more.jsonl", rows)
    cfg = load_finetune_config(None, [f"model.init={res.model_dir}", "task.name=classification",
                                      f"data.train={train}", f"train.out={tmp_path / 'again'}"])
    with pytest.raises(DataError, match=r"more.jsonl:8: label 'positive' is not in the model's label map"):
        finetune(cfg, show_progress=False, log=lambda *a: None)


def test_missing_field_names_the_row_and_the_fix(tokenizers_by_kind, cls_data, tmp_path):
    # no row has the field: name the setting that renames it; only this row lacks it: say so (issue 32)
    train = _write(tmp_path / "train.jsonl", [{"sentence": "one.", "label": "a"}, {"sentence": "two.", "label": "b"}])
    data = dict(cls_data, train=train)
    with pytest.raises(DataError, match=r"train.jsonl:1: missing field 'text'.*the record has: label, sentence.*"
                                        r"task.text_field"):
        finetune(_cfg(tokenizers_by_kind, data, tmp_path / "run"), show_progress=False, log=lambda *a: None)
    train = _write(tmp_path / "train.jsonl", [{"text": "one.", "label": "a"}, {"sentence": "two.", "label": "b"}])
    with pytest.raises(DataError, match=r"train.jsonl:2: missing field 'text'; the record has: label, sentence. "
                                        r"Other records of the file have it: fill it in or drop the record$"):
        finetune(_cfg(tokenizers_by_kind, dict(data, train=train), tmp_path / "run"), show_progress=False,
                 log=lambda *a: None)


def test_empty_dataset_is_an_error(tokenizers_by_kind, cls_data, tmp_path):
    empty = tmp_path / "train.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="train.jsonl: no records"):
        finetune(_cfg(tokenizers_by_kind, dict(cls_data, train=empty), tmp_path / "run"), show_progress=False,
                 log=lambda *a: None)


def test_single_label_training_set_is_an_error(tokenizers_by_kind, cls_data, tmp_path):
    train = _write(tmp_path / "train.jsonl", [{"text": "one.", "label": "a"}, {"text": "two.", "label": "a"}])
    with pytest.raises(DataError, match="1 distinct label"):
        finetune(_cfg(tokenizers_by_kind, dict(cls_data, train=train, dev=train), tmp_path / "run"),
                 show_progress=False, log=lambda *a: None)


def test_qa_answer_not_in_context_names_the_row(tokenizers_by_kind, cls_data, tmp_path):
    rows = [{"context": "The code is alpha. It rained.", "question": "What is the code?",
             "answers": {"text": ["alpha"], "answer_start": [12]}},
            {"context": "The code is beta. It rained.", "question": "What is the code?",
             "answers": {"text": ["gamma"], "answer_start": [12]}}]
    train = _write(tmp_path / "qa.jsonl", rows)
    with pytest.raises(DataError, match=r"qa.jsonl:2: .*gamma"):
        finetune(_cfg(tokenizers_by_kind, dict(cls_data, train=train, dev=train, test=""), tmp_path / "run",
                      task="qa"), show_progress=False, log=lambda *a: None)


def test_bad_config_values_name_the_key(tokenizers_by_kind, cls_data, tmp_path):
    with pytest.raises(ConfigError, match="task.name='clasification': expected one of .*did you mean 'classification'"):
        load_finetune_config(None, ["task.name=clasification"])
    with pytest.raises(ConfigError, match="did you mean 'epochs'"):
        load_finetune_config(None, ["tune.epoch=3"])
    with pytest.raises(ConfigError, match="no model"):
        finetune(load_finetune_config(None, [f"data.train={cls_data['train']}", "task.name=classification"]),
                 show_progress=False, log=lambda *a: None)


def test_task_head_mismatch_is_refused(tokenizers_by_kind, cls_data, tmp_path):
    res = finetune(_cfg(tokenizers_by_kind, cls_data, tmp_path / "run", "tune.epochs=1"), show_progress=False,
                   log=lambda *a: None)
    with pytest.raises(ConfigError, match="needs head='tagging'"):
        evaluate(res.model_dir, cls_data["test"], task_overrides={"name": "tagging"}, show_progress=False)


# -- CLI ------------------------------------------------------------------------------------------
def test_cli_finetune_evaluate_predict(tokenizers_by_kind, cls_data, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["finetune", "--preset", "tiny-bert-base", "--tokenizer", str(tokenizers_by_kind["wordpiece"]),
               "--task", "classification", "--train", str(cls_data["train"]), "--dev", str(cls_data["dev"]),
               "--test", str(cls_data["test"]), "--epochs", "1", "--out", str(out), "--quiet", "train.lr=2e-3",
               "train.plot=false"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "test: accuracy" in text and str(out / "model") in text
    assert main(["evaluate", str(out / "model"), str(cls_data["test"]), "--json", str(tmp_path / "m.json"),
                 "--quiet"]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["accuracy"] >= 0
    assert main(["predict", str(out / "model"), str(cls_data["test"]), "--out", str(tmp_path / "p.jsonl"),
                 "--quiet"]) == 0
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 80
    # a bad value is exit code 2 with the message, no traceback
    assert main(["finetune", "--task", "nope", "--train", str(cls_data["train"])]) == 2
    assert "task.name='nope'" in capsys.readouterr().err


def test_head_lr_trains_the_task_head_at_its_own_rate(tokenizers_by_kind, cls_data, tmp_path, monkeypatch):
    import pretune.train.optim as optim

    made = []

    def spy(*a, **kw):
        made.append(optim.build_optimizer.__wrapped__(*a, **kw))
        return made[-1]

    spy.__wrapped__ = optim.build_optimizer
    monkeypatch.setattr(optim, "build_optimizer", spy)
    lines = []
    finetune(_cfg(tokenizers_by_kind, cls_data, tmp_path / "run", "tune.head_lr=3e-2", "tune.epochs=1"),
             show_progress=False, log=lines.append)
    groups = made[0].param_groups
    head = [g for g in groups if any(n.startswith("0.head.") for n in g["names"])]
    body = [g for g in groups if not any(n.startswith("0.head.") for n in g["names"])]
    assert head and body and all(all(n.startswith("0.head.") for n in g["names"]) for g in head)
    assert {g["initial_lr"] for g in head} == {3e-2} and {g["initial_lr"] for g in body} == {2e-3}
    assert any("task head" in line and "lr 0.03" in line for line in lines)


def test_head_lr_needs_a_task_head(tokenizers_by_kind, cls_data, tmp_path):
    with pytest.raises(ConfigError, match="tune.head_lr"):
        _cfg(tokenizers_by_kind, cls_data, tmp_path / "run", "tune.head_lr=-1")


def test_cli_flags_beat_the_yaml_file(tmp_path, capsys):
    conf = tmp_path / "ft.yaml"
    conf.write_text("task: {name: classification}\ntrain: {lr: 5e-5, out: runs/yaml, batch_size: 16}\n"
                    "tune: {epochs: 3}\n")
    assert main(["finetune", "--config", str(conf), "--lr", "1e-3", "--out", str(tmp_path / "flag"),
                 "--epochs", "2", "train.batch_size=8", "--batch-size", "4", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["train"]["lr"] == 1e-3 and cfg["train"]["out"] == str(tmp_path / "flag")
    assert cfg["tune"]["epochs"] == 2 and cfg["train"]["batch_size"] == 8  # section.key=value beats the flag too
    assert cfg["task"]["name"] == "classification"


def test_cli_print_config(capsys):
    assert main(["finetune", "--print-config", "--task", "pair", "tune.epochs=2"]) == 0
    out = capsys.readouterr().out
    assert "name: pair" in out and "epochs: 2" in out and "text_a_field: text_a" in out


def test_epochs_zero_trains_for_train_steps_and_says_so(tokenizers_by_kind, cls_data, tmp_path):
    said = []
    res = finetune(_cfg(tokenizers_by_kind, cls_data, tmp_path / "run", "tune.epochs=0", "train.steps=4"),
                   show_progress=False, log=said.append)
    assert res.steps == 4
    head = next(line for line in said if line.startswith("pretune finetune:"))
    assert "4 steps of 16 (train.steps, as tune.epochs=0)" in head and "(0 epochs)" not in head
    assert any(line.startswith("precision: ") for line in said)
    end = said[-1 - bool(res.warnings)]  # 4 steps from scratch do not take: the warning comes last
    assert end.startswith("model -> ") and "the run folder holds" in end and " MB" in end


def test_predictions_carry_the_gold_label_and_scores_on_request(tokenizers_by_kind, cls_data, tmp_path):
    res = finetune(_cfg(tokenizers_by_kind, cls_data, tmp_path / "run"), show_progress=False, log=lambda *a: None)
    rows = [json.loads(x) for x in (res.run_dir / "test_predictions.jsonl").read_text().splitlines()]
    gold = [json.loads(x)["label"] for x in cls_data["test"].read_text().splitlines()]
    assert [r["gold"] for r in rows] == gold and "scores" not in rows[0]
    assert sum(r["gold"] == r["prediction"] for r in rows) / len(rows) == pytest.approx(res.test["accuracy"])
    unlabelled = tmp_path / "new.jsonl"
    unlabelled.write_text(json.dumps({"text": "A short one."}) + "\n" + json.dumps({"text": "Another."}) + "\n")
    assert predict(res.model_dir, unlabelled, tmp_path / "p.jsonl", show_progress=False, scores=True) == 2
    lines = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert "gold" not in lines[0] and set(lines[0]["scores"]) == {"long", "short"}
    assert sum(lines[0]["scores"].values()) == pytest.approx(1.0, abs=1e-5)
    assert lines[0]["prediction"] == max(lines[0]["scores"], key=lines[0]["scores"].get)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.jsonl", "p.jsonl", "run"]  # no temp file left
