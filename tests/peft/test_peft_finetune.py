"""`pretune finetune --peft METHOD`: the run trains only the adapter and head, saves a small adapter
folder that evaluate/predict load (base + adapter), and `pretune peft merge` gives a plain checkpoint."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import pretune
from conftest import corpus_paragraphs
from pretune.cli import main
from pretune.config import ConfigError
from pretune.io.tokenization import Tokenizer
from pretune.jobs.finetune import evaluate, finetune, load_finetune_config


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    sents = []
    for p in corpus_paragraphs("austen.txt.gz", 150):
        sents += [s.strip() + "." for s in p.replace("\n", " ").split(".") if len(s.split()) >= 4]
    rows = [{"text": s, "label": "long" if len(s.split()) > 14 else "short"} for s in sents[:240]]
    d = tmp_path_factory.mktemp("peftdata")
    return {"train": _write(d / "train.jsonl", rows[:160]), "dev": _write(d / "dev.jsonl", rows[160:200]),
            "test": _write(d / "test.jsonl", rows[200:240])}


@pytest.fixture(scope="module")
def base(tokenizers_by_kind, tmp_path_factory):
    """A small 'pretrained' base checkpoint (random weights) with its tokenizer."""
    tok = Tokenizer.load(tokenizers_by_kind["wordpiece"])
    model = pretune.build_model("tiny-bert-base", vocab_size=tok.vocab_size)
    path = tmp_path_factory.mktemp("base") / "base"
    pretune.save(model, path, tokenizer=tok.tk)
    return path


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def _cfg(base, data, out, method, *extra):
    return load_finetune_config(None, [f"model.init={base}", "task.name=classification", f"data.train={data['train']}",
                                       f"data.dev={data['dev']}", f"data.test={data['test']}", f"train.out={out}",
                                       "train.batch_size=16", "train.lr=5e-3", "tune.epochs=1", "train.plot=false",
                                       "train.keep_last=0", f"peft.method={method}", "peft.n_virtual=4", *extra])


@pytest.mark.parametrize("method", ["lora", "adapter", "prefix", "prompt", "ia3", "embeddings", "bitfit",
                                    "lora+prompt"])
def test_peft_finetune_saves_an_adapter_that_evaluate_reloads(method, base, data, tmp_path):
    before = _digest(base)
    res = finetune(_cfg(base, data, tmp_path / "run", method), show_progress=False, log=lambda *a: None)
    results = json.loads((res.run_dir / "results.json").read_text())
    p = results["peft"]
    assert p["method"] == method and 0 < p["trainable"] < p["total"]
    assert (res.model_dir / "pretune_adapter.json").is_file() and (res.model_dir / "task.json").is_file()
    if method != "embeddings":
        assert p["adapter_bytes"] < 0.2 * p["full_model_bytes"]
    assert _digest(base) == before  # the base checkpoint is never written
    again = evaluate(res.model_dir, data["test"], show_progress=False)
    assert again["accuracy"] == pytest.approx(res.test["accuracy"])


def test_lora_run_merges_into_a_plain_checkpoint(base, data, tmp_path, capsys):
    res = finetune(_cfg(base, data, tmp_path / "run", "lora", "peft.r=4", "peft.targets=[q_proj,v_proj,up_proj]"),
                   show_progress=False, log=lambda *a: None)
    assert main(["peft", "merge", str(res.model_dir), "--out", str(tmp_path / "merged")]) == 0
    merged = pretune.load(tmp_path / "merged")
    assert merged.config.labels == ["long", "short"] and not hasattr(merged, "peft_heads")
    acc = evaluate(tmp_path / "merged", data["test"], show_progress=False)["accuracy"]
    assert acc == pytest.approx(res.test["accuracy"])
    assert main(["peft", "info", str(res.model_dir)]) == 0
    out = capsys.readouterr().out
    assert "method lora" in out and "labels ['long', 'short']" in out


def test_cli_peft_flag_and_bad_settings(base, data, tmp_path, capsys):
    args = ["finetune", "--model", str(base), "--task", "classification", "--train", str(data["train"]),
            "--dev", str(data["dev"]), "--out", str(tmp_path / "run"), "--epochs", "1", "--quiet",
            "train.plot=false", "train.keep_last=0"]
    assert main(args + ["--peft", "ia3", "--lr", "1e-2"]) == 0
    assert "peft ia3: trainable parameters" in capsys.readouterr().out
    assert main(args + ["--peft", "lora", "peft.r=0"]) == 2
    assert "rank must be >= 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="does not combine with tune.freeze_body"):
        _cfg(base, data, tmp_path / "x", "lora", "tune.freeze_body=true")
    with pytest.raises(ConfigError, match="needs a pretrained base"):
        load_finetune_config(None, ["model.preset=tiny-bert-base", "peft.method=lora"])


def test_moved_base_is_named(base, data, tmp_path):
    res = finetune(_cfg(base, data, tmp_path / "run", "lora"), show_progress=False, log=lambda *a: None)
    meta = json.loads((res.model_dir / "pretune_adapter.json").read_text())
    meta["base"]["model"] = str(tmp_path / "gone")
    (res.model_dir / "pretune_adapter.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="gone does not exist; pass base=PATH"):
        evaluate(res.model_dir, data["test"], show_progress=False)
    assert evaluate(res.model_dir, data["test"], show_progress=False, base=str(base))["accuracy"] == \
        pytest.approx(res.test["accuracy"])


def _task_rows(task: str, sents: list[str]) -> list[dict]:
    rows = []
    for s in sents:
        words = s.split()
        if task == "tagging":
            rows.append({"tokens": words, "tags": ["B-CAP" if w[:1].isupper() else "O" for w in words]})
        elif task == "qa":
            rows.append({"context": s, "question": "What is the first word?",
                         "answers": {"text": [words[0]], "answer_start": [0]}})
        elif task == "seq2seq":
            rows.append({"source": s, "target": words[0]})
        elif task == "regression":
            rows.append({"text": s, "label": float(len(words))})
        else:  # pair
            rows.append({"text_a": s, "text_b": words[-1], "label": "long" if len(words) > 14 else "short"})
    return rows


@pytest.mark.parametrize("task, preset, kind, method", [
    ("tagging", "tiny-gpt2", "bpe", "prefix"), ("qa", "tiny-bert-base", "wordpiece", "adapter"),
    ("seq2seq", "tiny-t5-small", "unigram", "lora+prompt"), ("regression", "tiny-llama", "bpe", "ia3"),
    ("pair", "tiny-roberta-base", "bpe", "lora")])
def test_peft_works_for_every_task_and_family(task, preset, kind, method, tokenizers_by_kind, tmp_path):
    sents = []
    for p in corpus_paragraphs("austen.txt.gz", 60):
        sents += [s.strip() + "." for s in p.replace("\n", " ").split(".") if len(s.split()) >= 4]
    rows = _task_rows(task, sents[:60])
    tr, dv = _write(tmp_path / "train.jsonl", rows[:40]), _write(tmp_path / "dev.jsonl", rows[40:60])
    tok = Tokenizer.load(tokenizers_by_kind[kind])
    base = tmp_path / "base"
    pretune.save(pretune.build_model(preset, vocab_size=tok.vocab_size, pad_token_id=tok.pad_id or 0), base,
                 tokenizer=tok.tk)
    cfg = load_finetune_config(None, [f"model.init={base}", f"task.name={task}", f"data.train={tr}",
                                      f"data.dev={dv}", f"data.test={dv}", f"train.out={tmp_path / 'run'}",
                                      "train.batch_size=8", "train.lr=5e-3", "tune.epochs=1", "train.plot=false",
                                      "train.keep_last=0", f"peft.method={method}", "peft.n_virtual=3",
                                      "task.max_len=64", "task.stride=8", "task.max_target_len=4"])
    res = finetune(cfg, show_progress=False, log=lambda *a: None)
    assert json.loads((res.run_dir / "results.json").read_text())["peft"]["method"] == method
    # (reloaded, the frozen base's products may be stacked differently: the same to fp32 rounding, and a metric near
    # zero such as a weak Pearson r moves by ~1e-6 of itself on CPUs whose matmul kernel depends on the width)
    assert evaluate(res.model_dir, dv, show_progress=False) == pytest.approx(res.test, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("pooling, layout", [(None, "pretune"), ("pooler", "peft")])
def test_lora_layout_is_peft_when_transformers_has_the_head_else_the_run_says_why(pooling, layout, tokenizers_by_kind,
                                                                                 data, tmp_path, capsys):
    """The README's LoRA command on MiniLM: a sentence-transformers checkpoint, so the classification head reads the
    mean of the token states (issue 32). No transformers class classifies a mean, so peft's layout cannot hold the
    run: the adapter is pretune's, and the end of the run, results.json and `peft info` say so and why;
    task.pooling=pooler (BertForSequenceClassification's head) gives peft's layout."""
    tok = Tokenizer.load(tokenizers_by_kind["wordpiece"])
    mean_base = tmp_path / "base"  # what pretune reads from MiniLM's folder: a BERT whose sentence vector is a mean
    model = pretune.build_model("tiny-bert-base", vocab_size=tok.vocab_size, pooler=True, pooling="mean")
    pretune.save(model, mean_base, tokenizer=tok.tk)
    lines = []
    res = finetune(_cfg(mean_base, data, tmp_path / "run", "lora", "train.steps=2", "tune.epochs=0",
                        *([f"task.pooling={pooling}"] if pooling else [])),
                   show_progress=False, log=lambda *a: lines.append(" ".join(map(str, a))))
    assert (res.model_dir / "adapter_config.json").is_file() == (layout == "peft")
    peft_results = json.loads((res.run_dir / "results.json").read_text())["peft"]
    assert peft_results["layout"] == layout
    end = lines[[i for i, line in enumerate(lines) if line.startswith("model -> ")][-1] + 1:]  # after the scores
    said = [line for line in end if line.startswith("adapter layout: ")]
    assert len(said) == 1 and said[0].startswith(f"adapter layout: {layout}'s"), end
    if layout == "pretune":
        assert "pooling='mean'" in said[0] and "task.pooling=pooler" in said[0]
        assert "task.pooling=pooler" in peft_results["layout_why"]
    assert main(["peft", "info", str(res.model_dir)]) == 0
    info = capsys.readouterr().out
    assert f"layout {layout}," in info
    assert ("layout: pretune's, not peft's (" in info) == (layout == "pretune")
    if layout == "peft":
        peft_lib = pytest.importorskip("peft")
        assert peft_lib.LoraConfig.from_pretrained(str(res.model_dir)).r == 8


def test_full_lora_and_bitfit_runs_are_three_different_models(base, data, tmp_path):
    """Issue 32: the README's spam runs with full finetuning, LoRA and BitFit printed the same test figures. The
    runs train different weights, so their test probabilities differ even when their predicted labels agree."""
    tok = Tokenizer.load(base / "tokenizer.json")
    ids = torch.tensor([tok.encode("She was not at all surprised by the long letter.")])
    logits = {}
    for method in ("full", "lora", "bitfit"):
        cfg = _cfg(base, data, tmp_path / method, "" if method == "full" else method, "train.steps=3",
                   "tune.epochs=0")
        res = finetune(cfg, show_progress=False, log=lambda *a: None)
        model = pretune.load(res.model_dir).eval()
        with torch.no_grad():
            logits[method] = model(ids).logits
    assert logits["full"].shape == (1, 2)
    for a, b in (("full", "lora"), ("full", "bitfit"), ("lora", "bitfit")):
        assert not torch.allclose(logits[a], logits[b], atol=1e-4), (a, b)
