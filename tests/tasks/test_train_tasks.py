"""Every task trains a tiny model from scratch on a small fixture and reaches a stated score.

The fixtures are real sentences (Austen's *Emma* and Wikipedia, from ../shared/data/corpus) labelled by a
deterministic rule a two-layer, 32-wide model can learn in a few hundred steps. Each threshold sits well
below the scores observed over several seeds and well above what the model scores when the feature is
broken (labels on the wrong token, spans off by one, a decoder trained on the wrong target, text_b lost):
those fall to chance or below, as the comments state. The runs are seeded (``train.seed``) and run on one
thread (conftest), so the scores are repeatable.

Every test also checks that the run does not warn that training did not take (its dev score beats the task's
baseline, its train loss fell), that ``evaluate(model_dir, test file)`` reproduces the run's test metrics and that
``predict`` writes one JSON line per record.
"""

from __future__ import annotations

import collections
import json
import random
import re
from pathlib import Path

import pytest
import torch

from conftest import corpus_paragraphs
from pretune.jobs.finetune import evaluate, finetune, load_finetune_config, predict

_SPLIT = re.compile(r"(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?<!\bSt\.)(?<=[.!?])\s+")  # sentence ends, not "Mr. Elton"

AUX = ("was", "is", "had", "could", "would", "should", "were", "did", "must", "might")


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def sentences() -> list[str]:
    """Real sentences (4-30 words): Austen's Emma, then Wikipedia."""
    out = []
    for para in corpus_paragraphs("austen.txt.gz", 2500) + corpus_paragraphs("enwiki_sample.txt.gz", 250):
        for s in _SPLIT.split(" ".join(para.split())):
            if 4 <= len(s.split()) <= 30:
                out.append(s)
    return out


def write_splits(d: Path, records: list[dict], n_train: int, n_dev: int, n_test: int) -> dict[str, Path]:
    assert len(records) >= n_train + n_dev + n_test, f"fixture too small: {len(records)} records"
    cuts = {"train": (0, n_train), "dev": (n_train, n_train + n_dev),
            "test": (n_train + n_dev, n_train + n_dev + n_test)}
    paths = {}
    for name, (a, b) in cuts.items():
        paths[name] = d / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[a:b]),
                               encoding="utf-8")
    return paths


def run(tmp_path: Path, task: str, model: str, tokenizer: str, files: dict[str, Path], *overrides: str):
    """finetune → (result, predictions of the test file); checks that evaluate() reproduces the run's test
    metrics and that predict() writes one line per record, in order."""
    key = "model.init" if Path(model).is_dir() else "model.preset"
    cfg = load_finetune_config(None, [
        f"{key}={model}", f"tokenizer={tokenizer}", f"task.name={task}", f"data.train={files['train']}",
        f"data.dev={files['dev']}", f"data.test={files['test']}", f"train.out={tmp_path / 'run'}",
        "train.seed=0", "train.batch_size=16", "train.lr=3e-3", "task.max_len=64", *overrides])
    result = finetune(cfg, show_progress=False, log=lambda *a, **k: None)
    assert result.warnings == [], result.warnings  # it learnt: better than the task's baseline, its loss fell
    again = evaluate(result.model_dir, files["test"], show_progress=False)
    assert again.keys() == result.test.keys()
    for k, v in result.test.items():
        assert again[k] == pytest.approx(v, rel=1e-4, abs=1e-4), (k, again, result.test)
    out = tmp_path / "pred.jsonl"
    n = predict(result.model_dir, files["test"], out, show_progress=False)
    lines = out.read_text(encoding="utf-8").splitlines()
    n_records = len(files["test"].read_text(encoding="utf-8").splitlines())
    assert n == len(lines) == n_records
    preds = [json.loads(line) for line in lines]
    assert all("prediction" in p and p["row"] == f"test.jsonl:{i + 1}" for i, p in enumerate(preds))
    return result, preds


# ------------------------------------------------------------------------------------------------ tagging
def entity_tags(words: list[str]) -> list[str]:
    """BIO tags: a run of capitalised words after the first word is an entity (ENT); punctuation at the end of
    a word ends its entity ("Tolstoy, Dorothy Day" is two)."""
    tags: list[str] = []
    for i, w in enumerate(words):
        if i > 0 and w[:1].isupper():
            inside = tags[-1] != "O" and words[i - 1][-1].isalpha()
            tags.append("I-ENT" if inside else "B-ENT")
        else:
            tags.append("O")
    return tags


def tagging_records(sentences: list[str]) -> list[dict]:
    """Sentences of plain words ("word", "word," ...) tagged by :func:`entity_tags`: every one with a
    multi-word entity (about 200), 500 with only one-word entities and 196 with none, shuffled."""
    clean = [s for s in sentences if all(re.fullmatch(r"[A-Za-z]+[,.;:!?]?", w) for w in s.split())]
    records = [{"tokens": s.split(), "tags": entity_tags(s.split())} for s in clean]
    rng = random.Random(0)
    rng.shuffle(records)
    multi = [r for r in records if "I-ENT" in r["tags"]]
    single = [r for r in records if "B-ENT" in r["tags"] and "I-ENT" not in r["tags"]]
    none = [r for r in records if "B-ENT" not in r["tags"]]
    records = multi + single[:500] + none[:196]
    rng.shuffle(records)
    return records


# Context-free rules on this test set: every capitalised word B-ENT scores 0.58, every capitalised word after
# the first B-ENT 0.77 but never says I-ENT (I-ENT recall 0); labels one token to the right of their word:
# 0.08. Observed 0.84-0.92 entity F1, 0.45-0.77 I-ENT recall (of 47 words) for seeds 0-5.
TAGGING_MIN_ENTITY_F1 = 0.75
TAGGING_MIN_I_RECALL = 0.3  # share of gold I-ENT words tagged I-ENT: only the previous word tells B from I


def test_tagging_trains(tmp_path, sentences, tokenizers_by_kind):
    records = tagging_records(sentences)
    files = write_splits(tmp_path, records, 600, 100, 200)
    # byte-level BPE, cased: words after the first get their "Ġ"; rotary positions make "the previous word"
    # easy to learn for a model this small
    result, preds = run(tmp_path, "tagging", "tiny-modernbert-base", tokenizers_by_kind["bpe"], files, "tune.epochs=6")
    assert result.test["entity_f1"] >= TAGGING_MIN_ENTITY_F1, result.test
    gold = records[700:900]
    assert all(len(p["prediction"]) == len(g["tokens"]) and p["tokens"] == g["tokens"] for p, g in zip(preds, gold))
    inside = [p == "I-ENT" for pr, g in zip(preds, gold) for p, t in zip(pr["prediction"], g["tags"]) if t == "I-ENT"]
    assert len(inside) >= 20 and sum(inside) >= TAGGING_MIN_I_RECALL * len(inside), (sum(inside), len(inside))


# ----------------------------------------------------------------------------------------------------- qa
def qa_records(sentences: list[str], n: int, seed: int = 0) -> list[dict]:
    """Contexts of real sentences with a planted fact "The code is WORD." (the answer WORD, a real lowercase
    word); a quarter have no fact (unanswerable); every fourth context has 5-8 sentences, longer than one
    window of max_len 64 tokens, so the sliding window is needed to find the answer."""
    rng = random.Random(seed)
    words = sorted({w for s in sentences for w in s.split() if w.isalpha() and w.islower() and 3 <= len(w) <= 8})
    out = []
    for i in range(n):
        k = rng.randint(5, 8) if i % 4 == 0 else rng.randint(1, 3)
        ctx = [rng.choice(sentences) for _ in range(k)]
        answer = rng.choice(words)
        if rng.random() < 0.75:
            fact = f"The code is {answer}."
            ctx.insert(rng.randint(0, k), fact)
            start = " ".join(ctx).index(fact) + len("The code is ")
            answers = {"text": [answer], "answer_start": [start]}
        else:
            answers = {"text": [], "answer_start": []}
        out.append({"context": " ".join(ctx), "question": "What is the code?", "answers": answers})
    return out


# Chance: answering "" everywhere scores 25 (the unanswerable share); spans off by one token score ~0 on the
# answerable ones. Observed 90-93 (exact match) and 90-94 (F1) for seeds 0-3.
QA_MIN_EXACT_MATCH = 75.0
QA_MIN_F1 = 75.0
# Share of the answers outside the first window found (a window offset bug, or windows never consulted: 0).
# Observed 0.78-0.93 (35-42 of 45) for seeds 0-3.
QA_MIN_LATE_FOUND = 0.6


def test_qa_trains_with_sliding_windows_and_no_answer(tmp_path, sentences, tokenizers_by_kind):
    from pretune.jobs.finetune import load_finetuned
    from pretune.tasks.base import Record

    records = qa_records(sentences, 950)
    files = write_splits(tmp_path, records, 700, 100, 150)
    # ModernBERT-style (rotary positions): "the word after 'code is'" is a relative-position pattern
    result, preds = run(tmp_path, "qa", "tiny-modernbert-base", tokenizers_by_kind["wordpiece"], files,
                        "task.stride=16", "tune.epochs=3")
    assert result.test["exact_match"] >= QA_MIN_EXACT_MATCH, result.test
    assert result.test["f1"] >= QA_MIN_F1, result.test
    # the long contexts really were cut into windows, and answers that only a later window holds were found
    _, _, task = load_finetuned(result.model_dir)
    test = records[800:950]
    feats = [task.encode(Record("t", r)) for r in test]
    assert max(map(len, feats)) >= 3 and sum(len(f) > 1 for f in feats) >= 20
    late = [i for i, f in enumerate(feats) if f[0]["start_positions"] == 0 and any(g["start_positions"] for g in f)]
    assert len(late) >= 10
    found = sum(preds[i]["prediction"] == test[i]["answers"]["text"][0] for i in late)
    assert found >= QA_MIN_LATE_FOUND * len(late), (found, len(late))


# --------------------------------------------------------------------------------------------- regression
# Random labels: pearson -0.01. Observed 0.87-0.92 for seeds 0-7 (with 3 epochs instead of 6, two seeds of
# eight had not yet left the plateau a post-norm model from scratch starts on: 0.36, 0.51).
REGRESSION_MIN_PEARSON = 0.75


def test_regression_trains(tmp_path, sentences, tokenizers_by_kind):
    records = [{"text": s, "label": round(5 * sum(w[:1].isupper() for w in s.split()) / len(s.split()), 4)}
               for s in sentences]  # 5 x the share of capitalised words
    random.Random(0).shuffle(records)
    files = write_splits(tmp_path, records, 800, 100, 200)
    # a cased tokenizer (byte-level BPE): the capitals must be visible
    result, preds = run(tmp_path, "regression", "tiny-roberta-base", tokenizers_by_kind["bpe"], files,
                        "tune.epochs=6")
    assert result.test["pearson"] >= REGRESSION_MIN_PEARSON, result.test
    assert all(isinstance(p["prediction"], float) for p in preds)


# ------------------------------------------------------------------------------------------------ seq2seq
def first_word_records(sentences: list[str], k: int = 20) -> list[dict]:
    """"source: a sentence" → its first word, for sentences (<= 20 words) starting with one of the k most
    frequent first words ("I", "The", "She", "Emma", ...)."""
    ss = [s for s in sentences if s.split()[0].isalpha() and len(s.split()) <= 20]
    top = {w for w, _ in collections.Counter(s.split()[0] for s in ss).most_common(k)}
    records = [{"source": s, "target": s.split()[0]} for s in ss if s.split()[0] in top]
    random.Random(0).shuffle(records)
    return records


def t5_checkpoint(path: Path, tokenizer: str) -> Path:
    """tiny-t5-small with Mesh TensorFlow / Hugging Face T5 initialisation, saved as a checkpoint.

    T5 has no 1/sqrt(d) attention scale (attn_scale=1.0): it relies on its initialisation (q ~ (d * d_kv)^-1/2,
    k, v ~ d^-1/2, embeddings ~ 1) for non-flat attention. With the uniform std 0.02 of ``TransformerLM``'s
    default init the attention logits start ~0.03 and a from-scratch T5 needs thousands of steps to learn to
    copy; this one learns the fixture in a few hundred, like the decoders."""
    from pretune.io.checkpoint import save
    from pretune.io.tokenization import Tokenizer
    from pretune.model import TransformerLM
    from pretune.presets import get_preset

    tok = Tokenizer.load(tokenizer)
    cfg = get_preset("tiny-t5-small", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id,
                     decoder_start_token_id=tok.pad_id)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    d, dkv = cfg.dim, cfg.dh
    std = {"q_proj": (d * dkv) ** -0.5, "k_proj": d ** -0.5, "v_proj": d ** -0.5, "o_proj": (cfg.n_heads * dkv) ** -0.5,
           "up_proj": d ** -0.5, "gate_proj": d ** -0.5, "down_proj": cfg.ffn_dim ** -0.5, "bias_table": d ** -0.5}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "transformer.embed.weight":
                torch.nn.init.normal_(p, std=1.0)
                continue
            for part, s in std.items():
                if f".{part}." in name:
                    torch.nn.init.normal_(p, std=s)
    return save(model, path, tokenizer=tokenizer)


# The majority answer ("I") scores 0.28; a target shifted by one token (T5 decoder input = labels, or the
# decoder-only labels one position early) scores 0.0. Observed: T5 0.76-0.80 (train seeds 0-2, init seeds
# 1-3), GPT-2 0.81-0.85 (seeds 0-2). The default T5 init (see t5_checkpoint) stays at ~0.2 here.
SEQ2SEQ_MIN_EXACT_MATCH = 0.6


@pytest.mark.parametrize("family", ["encoder-decoder", "decoder"])
def test_seq2seq_trains(family, tmp_path, sentences, tokenizers_by_kind):
    records = first_word_records(sentences)
    files = write_splits(tmp_path, records, 600, 100, 200)
    if family == "encoder-decoder":
        tok = tokenizers_by_kind["unigram"]
        model, recipe = str(t5_checkpoint(tmp_path / "t5-init", tok)), ("tune.epochs=10", "train.lr=3e-3")
    else:
        tok, model, recipe = tokenizers_by_kind["bpe"], "tiny-gpt2", ("tune.epochs=8", "train.lr=5e-3")
    result, preds = run(tmp_path, "seq2seq", model, tok, files, *recipe, "task.max_target_len=8",
                        "train.eval_every=125")  # a few dev evaluations: generation is the slow part
    assert result.test["exact_match_text"] >= SEQ2SEQ_MIN_EXACT_MATCH, result.test
    assert result.test["perplexity"] < 3.0, result.test
    assert all(p["source"] == r["source"] for p, r in zip(preds, records[700:900]))


# --------------------------------------------------------------------------------------------------- pair
def negate(sentence: str) -> str | None:
    """The sentence with "not" after its first auxiliary ("she was happy" → "she was not happy")."""
    words = sentence.split()
    for i, w in enumerate(words):
        if w in AUX:
            return " ".join(words[: i + 1] + ["not"] + words[i + 1:])
    return None


def pair_records(sentences: list[str], n: int, seed: int = 0) -> list[dict]:
    """NLI by negation: text_b is text_a (entailment) or text_a negated (contradiction), half each."""
    ss = sorted({s for s in sentences if negate(s) and "not" not in s.split() and "n't" not in s
                 and len(s.split()) <= 16})  # short enough that a pair fits max_len 64 uncut
    random.Random(seed).shuffle(ss)
    out = []
    for i, a in enumerate(ss[:n]):  # each sentence once: no text_a is shared between train and test
        b, label = (a, "entailment") if i % 2 else (negate(a), "contradiction")
        out.append({"text_a": a, "text_b": b, "label": label})
    return out


# Chance: 0.5 (balanced); text_b lost: 0.5; the label map reordered between training and prediction: < 0.1.
# Observed: BERT 0.95-0.97, GPT-2 0.90-0.96 for seeds 0-4 (with 3 epochs, BERT stayed on its initial plateau
# at 0.5 for one seed in five). The session's WordPiece tokenizer is not the same from run to run (the tokenizers
# library's WordPiece trainer breaks count ties in hash-map order: huggingface/tokenizers#1794), so BERT's score at
# seed 0 varies too: 0.86-0.955 over eight runs alone, 0.745 once inside the suite (2026-11-29); BPE is stable.
PAIR_MIN_ACCURACY = 0.70


@pytest.mark.parametrize("style", ["gpt", "bert"])
def test_pair_trains(style, tmp_path, sentences, tokenizers_by_kind):
    files = write_splits(tmp_path, pair_records(sentences, 900), 600, 100, 200)
    preset, tok = ("tiny-gpt2", "bpe") if style == "gpt" else ("tiny-bert-base", "wordpiece")
    result, preds = run(tmp_path, "pair", preset, tokenizers_by_kind[tok], files, "tune.epochs=8",
                        f"task.pair_style={style}")
    assert result.test["accuracy"] >= PAIR_MIN_ACCURACY, result.test
    assert {p["prediction"] for p in preds} <= {"contradiction", "entailment"}
    config = json.loads((result.model_dir / "config.json").read_text())
    assert config["labels"] == ["contradiction", "entailment"]  # sorted label map, saved with the model
