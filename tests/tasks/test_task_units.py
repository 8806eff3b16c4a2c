"""Unit tests of the task layer: input layouts, tagging label alignment, greedy generation with the KV cache,
label maps, regression labels and QA answer parsing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import tokenizers
import torch

from pretune.config import ConfigError
from pretune.data.readers import DataError
from pretune.io.tokenization import Tokenizer
from pretune.model import TransformerLM
from pretune.objectives.base import IGNORE
from pretune.presets import get_preset
from pretune.tasks import TaskConfig, build_task
from pretune.tasks.base import Layout, Record
from pretune.tasks.classify import Classification, Pair, Regression
from pretune.tasks.tagging import Tagging


@pytest.fixture(scope="module")
def toks(tokenizers_by_kind) -> dict[str, Tokenizer]:
    return {k: Tokenizer.load(p) for k, p in tokenizers_by_kind.items()}


def model_cfg(preset: str, tok: Tokenizer, **kw):
    return get_preset(preset, vocab_size=tok.vocab_size, pad_token_id=tok.pad_id if tok.pad_id is not None else 0,
                      **kw)


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.tk.encode(text, add_special_tokens=False).ids


A, B = "Emma was very happy with the visit.", "Mr. Knightley said nothing."


# ---------------------------------------------------------------------------------------------- layouts
def test_bert_layout_is_cls_a_sep_b_sep_with_segment_ids(toks):
    tok = toks["wordpiece"]
    cfg = model_cfg("tiny-bert-base", tok)
    lay = Layout(tok, cfg)
    a, b = ids(tok, A), ids(tok, B)
    out = lay.build(a, b, 64)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    assert out["input_ids"].tolist() == [cls, *a, sep, *b, sep]
    assert out["token_type_ids"].tolist() == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    assert out["attention_mask"].tolist() == [1] * (len(a) + len(b) + 3)
    single = lay.build(a, None, 64)
    assert single["input_ids"].tolist() == [cls, *a, sep]
    assert single["token_type_ids"].tolist() == [0] * (len(a) + 2)
    assert lay.n_special(True) == 3 and lay.n_special(False) == 2


def test_gpt_layout_takes_start_delim_extract_from_the_tokenizer_roles(toks):
    # a vocabulary with three distinct roles: [START] = bos, [DELIM] = sep, [EXTRACT] = eos
    tok = Tokenizer(toks["unigram"].tk, roles={"bos": "<extra_id_0>", "sep": "<extra_id_1>", "eos": "</s>"})
    start, delim, extract = (tok.token_to_id(t) for t in ("<extra_id_0>", "<extra_id_1>", "</s>"))
    assert len({start, delim, extract}) == 3
    lay = Layout(tok, model_cfg("tiny-gpt2", tok))
    assert lay.style == "gpt"
    a, b = ids(tok, A), ids(tok, B)
    out = lay.build(a, b, 64)
    assert out["input_ids"].tolist() == [start, *a, delim, *b, extract]
    assert "token_type_ids" not in out
    assert lay.build(a, None, 64)["input_ids"].tolist() == [start, *a, extract]

    # BERT's vocabulary on a decoder: [CLS] a [SEP] b [SEP] (bos falls back to cls, sep/eos to [SEP])
    wp = toks["wordpiece"]
    lay = Layout(wp, model_cfg("tiny-gpt2", wp))
    a, b = ids(wp, A), ids(wp, B)
    assert lay.build(a, b, 64)["input_ids"].tolist() == [wp.cls_id, *a, wp.sep_id, *b, wp.sep_id]


def gpt2_like_tokenizer() -> Tokenizer:
    """A word-level vocabulary whose only special token is GPT-2's <|endoftext|> (bos = eos = unk)."""
    vocab = {"<|endoftext|>": 0, **{w: i + 1 for i, w in enumerate("emma was very happy he said nothing".split())}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<|endoftext|>"])
    return Tokenizer(tk)


def test_gpt2_layout_uses_endoftext_as_delimiter_and_extract():
    tok = gpt2_like_tokenizer()
    assert tok.bos_id == tok.eos_id == 0
    lay = Layout(tok, get_preset("tiny-gpt2", vocab_size=tok.vocab_size, pad_token_id=0))
    assert lay.start is None  # no separate [START]
    a, b = ids(tok, "emma was happy"), ids(tok, "he said nothing")
    assert lay.build(a, b, 16)["input_ids"].tolist() == [*a, 0, *b, 0]
    assert lay.build(a, None, 16)["input_ids"].tolist() == [*a, 0]


def test_roberta_layout_double_separator_and_no_segment_ids(toks):
    tok = toks["bpe"]
    cfg = model_cfg("tiny-roberta-base", tok)  # one token type, as RoBERTa
    lay = Layout(tok, cfg)
    a, b = ids(tok, A), ids(tok, B)
    out = lay.build(a, b, 64)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert out["input_ids"].tolist() == [bos, *a, eos, eos, *b, eos]  # Hugging Face's RoBERTa pair
    assert "token_type_ids" not in out
    assert lay.n_special(True) == 4
    # the whole pair task runs on such a model (segment id 1 would index past its one type embedding)
    task = Pair(TaskConfig(name="pair"), cfg.replace(head="classification", num_labels=2, labels=["no", "yes"]), tok)
    batch = task.collate([task.encode(Record("r:1", {"text_a": A, "text_b": B, "label": "yes"}))[0]])
    model = TransformerLM(task.model_cfg)
    assert model(batch["input_ids"], batch["attention_mask"]).logits.shape == (1, 2)


def test_t5_layout_is_a_eos_b_eos(toks):
    tok = toks["unigram"]
    lay = Layout(tok, model_cfg("tiny-t5-small", tok))
    a, b = ids(tok, A), ids(tok, B)
    assert lay.build(a, b, 64)["input_ids"].tolist() == [*a, tok.eos_id, *b, tok.eos_id]
    assert lay.build(a, None, 64)["input_ids"].tolist() == [*a, tok.eos_id]


def test_layout_style_must_fit_the_family(toks):
    tok = toks["wordpiece"]
    with pytest.raises(ConfigError, match="needs an encoder"):
        Layout(tok, model_cfg("tiny-gpt2", tok), "bert")
    with pytest.raises(ConfigError, match="decoder-only"):
        Layout(tok, model_cfg("tiny-bert-base", tok), "gpt")


def truncate_seq_pair(a: list, b: list, budget: int) -> tuple[list, list]:
    """Google BERT's run_classifier._truncate_seq_pair: pop from the longer, from b on a tie."""
    a, b = list(a), list(b)
    while len(a) + len(b) > budget:
        if len(a) > len(b):
            a.pop()
        else:
            b.pop()
    return a, b


def test_longest_first_truncation_fits_max_len_exactly(toks):
    tok = toks["wordpiece"]
    lay = Layout(tok, model_cfg("tiny-bert-base", tok))
    cls, sep = tok.cls_id, tok.sep_id
    a, b = list(range(100, 110)), list(range(200, 204))
    out = lay.build(a, b, 11)  # 8 text tokens: a cut to 4, b kept
    assert out["input_ids"].tolist() == [cls, 100, 101, 102, 103, sep, 200, 201, 202, 203, sep]
    assert out["token_type_ids"].tolist() == [0] * 6 + [1] * 5
    tie = lay.build(list(range(100, 105)), list(range(200, 205)), 12)  # 9 of 10: the tie is cut from b
    assert tie["input_ids"].tolist() == [cls, *range(100, 105), sep, *range(200, 204), sep]
    assert lay.build(a, None, 6)["input_ids"].tolist() == [cls, 100, 101, 102, 103, sep]
    rng = random.Random(0)
    for _ in range(300):
        la, lb, max_len = rng.randint(1, 40), rng.randint(1, 40), rng.randint(5, 60)
        a, b = list(range(1000, 1000 + la)), list(range(2000, 2000 + lb))
        ea, eb = truncate_seq_pair(a, b, max_len - 3)
        got = lay.build(a, b, max_len)["input_ids"].tolist()
        assert got == [cls, *ea, sep, *eb, sep]
        assert len(got) == min(max_len, la + lb + 3)
    with pytest.raises(ConfigError, match="no room"):
        lay.build(a, b, 4)


# ----------------------------------------------------------------------------------------------- tagging
TAGS = ["O", "B-PER", "I-PER"]
WORDS = ["Emma", "Woodhouse,", "handsome,", "clever,", "and", "rich,", "unaccountably", "Hartfield's", "heiress."]
WORD_TAGS = ["B-PER", "I-PER", "O", "O", "O", "O", "O", "O", "O"]


def tagging_task(tok: Tokenizer, preset: str, max_len: int = 64) -> Tagging:
    cfg = model_cfg(preset, tok, head="tagging", num_labels=3, labels=TAGS)
    return build_task(TaskConfig(name="tagging", max_len=max_len), cfg, tok)


@pytest.mark.parametrize("kind,preset", [("wordpiece", "tiny-bert-base"), ("bpe", "tiny-roberta-base"),
                                         ("unigram", "tiny-t5-small"), ("bpe", "tiny-gpt2")])
def test_tagging_labels_sit_on_first_subwords_only(kind, preset, toks):
    tok = toks[kind]
    task = tagging_task(tok, preset)
    (feat,) = task.encode(Record("t:1", {"tokens": WORDS, "tags": WORD_TAGS}))
    enc = tok.tk.encode(task_words(task, WORDS), is_pretokenized=True, add_special_tokens=False)
    offset = 1 if task.layout.start is not None else 0
    assert feat["input_ids"].tolist()[offset:offset + len(enc.ids)] == enc.ids
    firsts = [enc.word_ids.index(w) + offset for w in range(len(WORDS))]
    assert feat["_first"].tolist() == firsts
    assert len(set(enc.word_ids)) == len(WORDS) and len(enc.ids) > len(WORDS)  # some words have several pieces
    want = np.full(len(feat["input_ids"]), IGNORE)
    for w, pos in enumerate(firsts):
        want[pos] = TAGS.index(WORD_TAGS[w])
    assert feat["labels"].tolist() == want.tolist()  # -100 on continuation pieces and special tokens
    unlabelled = task.encode(Record("t:1", {"tokens": WORDS}), labelled=False)[0]
    assert "labels" not in unlabelled and unlabelled["_first"].tolist() == firsts


def task_words(task: Tagging, words: list[str]) -> list[str]:
    return [words[0], *(" " + w for w in words[1:])] if task.space_words else words


def test_byte_level_words_are_encoded_as_running_text(toks):
    tok = toks["bpe"]
    task = tagging_task(tok, "tiny-roberta-base")
    words = "She was not struck by anything remarkably clever in Miss Smith".split()
    (feat,) = task.encode(Record("t:1", {"tokens": words, "tags": ["O"] * len(words)}))
    assert feat["input_ids"][1:-1].tolist() == ids(tok, " ".join(words))
    pieces = [tok.id_to_token(int(feat["input_ids"][p])) for p in feat["_first"][1:]]
    assert all(p.startswith("Ġ") for p in pieces)  # "Ġwas", not "w" "as"


def test_tagging_predictions_align_with_words_when_words_are_cut(toks):
    tok = toks["wordpiece"]
    task = tagging_task(tok, "tiny-bert-base", max_len=8)  # 6 word pieces fit
    rec = Record("t:1", {"tokens": WORDS, "tags": WORD_TAGS})
    (feat,) = task.encode(rec)
    first = feat["_first"]
    assert len(feat["input_ids"]) == 8 and (first >= 0).sum() < len(WORDS)
    assert first[: (first >= 0).sum()].min() >= 1 and (first[(first >= 0).sum():] == -1).all()
    # outputs that say I-PER at every kept word: kept words get I-PER, cut words the fallback "O"
    out = np.zeros((len(feat["input_ids"]), 3), dtype=np.float32)
    out[:, 2] = 1.0
    pred = task.predict([rec], [feat], [out])[0]
    kept = int((first >= 0).sum())
    assert pred == ["I-PER"] * kept + ["O"] * (len(WORDS) - kept)
    # and through a real model and the batching of finetune.run_outputs (padding trimmed per example)
    from pretune.jobs.finetune import encode_records, run_outputs

    records = [rec, Record("t:2", {"tokens": WORDS[:2], "tags": WORD_TAGS[:2]})]
    feats = encode_records(task, records)
    model = TransformerLM(task.model_cfg)
    preds = task.predict(records, feats, run_outputs(task, model, feats))
    assert [len(p) for p in preds] == [len(WORDS), 2]
    assert all(t in TAGS for p in preds for t in p)
    assert preds[0][kept:] == ["O"] * (len(WORDS) - kept)


def test_tagging_label_set_and_errors(toks):
    recs = [Record("t:1", {"tokens": ["a", "b"], "tags": ["B-PER", "O"]}),
            Record("t:2", {"tokens": "c d e", "tags": "I-LOC B-LOC I-PER"})]
    assert Tagging.label_set(TaskConfig(name="tagging"), recs) == ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    task = tagging_task(toks["wordpiece"], "tiny-bert-base")
    with pytest.raises(DataError, match="t:3: 1 tags for 2 words"):
        task.encode(Record("t:3", {"tokens": ["a", "b"], "tags": ["O"]}))
    with pytest.raises(DataError, match="t:4: tag 'B-LOC'"):
        task.encode(Record("t:4", {"tokens": ["a"], "tags": ["B-LOC"]}))


# ------------------------------------------------------------------------------------ greedy generation
SOURCES = ["Emma was very happy.", "Mr. Knightley said nothing at all, which was rather odd for him.", "Yes."]


def random_seq2seq(preset: str, tok: Tokenizer, std: float, layout: str = "auto"):
    """A random model with untied, widely spread weights: varied greedy outputs, no near-ties."""
    cfg = model_cfg(preset, tok, tie_embeddings=False, dropout=0.0, decoder_start_token_id=tok.pad_id or 0)
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, std)
    task = build_task(TaskConfig(name="seq2seq", max_len=64, max_target_len=12, layout=layout), cfg, tok)
    return model, task


@torch.no_grad()
def greedy_without_cache(model, task, source: list[int], n: int) -> list[int]:
    """Greedy decoding that recomputes the whole decoder input at every step (no KV cache)."""
    out: list[int] = []
    src = torch.tensor([source])
    for _ in range(n):
        if task.model_cfg.arch == "decoder":  # the source read causally, or bidirectionally (prefix LM)
            prefix = torch.tensor([len(source)]) if task.layout.name == "prefix_lm" else None
            logits = model(torch.tensor([source + out]), prefix_lengths=prefix).logits
        else:
            logits = model(src, torch.ones_like(src), decoder_input_ids=torch.tensor([[task.start] + out])).logits
        nxt = int(logits[0, -1].argmax())
        if nxt == task.eos:
            break
        out.append(nxt)
    return out


@pytest.mark.parametrize("preset,kind,std,layout", [("tiny-t5-small", "unigram", 1.0, "auto"),
                                                    ("tiny-gpt2", "bpe", 0.3, "causal"),
                                                    ("tiny-gpt2", "bpe", 0.3, "prefix_lm"),
                                                    ("tiny-llama", "bpe", 0.3, "causal"),
                                                    ("tiny-llama", "bpe", 0.3, "prefix_lm")])
def test_greedy_generation_with_cache_equals_recomputing(preset, kind, std, layout, toks):
    tok = toks[kind]
    model, task = random_seq2seq(preset, tok, std, layout)
    records = [Record(f"s:{i}", {"source": s, "target": "x"}) for i, s in enumerate(SOURCES)]
    feats = [task.encode(r, labelled=False)[0] for r in records]
    cached = task.generate(model, task.collate(feats))  # one padded batch
    expected = [greedy_without_cache(model, task, f["input_ids"].tolist(), 12) for f in feats]
    assert cached == expected
    assert sum(len(set(c)) > 2 for c in cached) >= 2  # real sequences, not one repeated token
    # labelled features (the decoder-only ones hold the target too) generate the same
    labelled = [task.encode(r)[0] for r in records]
    assert task.generate(model, task.collate(labelled)) == expected
    assert task.generate(model, task.collate(feats), max_new_tokens=3) == [e[:3] for e in expected]


def test_seq2seq_features(toks):
    tok = toks["unigram"]
    cfg = model_cfg("tiny-t5-small", tok)
    task = build_task(TaskConfig(name="seq2seq", prefix="first word: ", max_len=16, max_target_len=4), cfg, tok)
    source = "Emma was very happy with the visit of Mr. Knightley."
    (f,) = task.encode(Record("s:1", {"source": source, "target": "Emma Woodhouse and Harriet"}))
    assert f["input_ids"].tolist() == ids(tok, "first word: " + source)[:15] + [tok.eos_id]  # prefix, cut, EOS
    assert f["labels"].tolist()[-1] == tok.eos_id and len(f["labels"]) == 4  # target cut to max_target_len
    assert f["decoder_input_ids"].tolist() == [cfg.decoder_start_token_id, *f["labels"][:-1].tolist()]
    gpt = toks["bpe"]
    dcfg = model_cfg("tiny-gpt2", gpt)
    # a decoder pretrained as a prefix LM: source EOS target EOS, bidirectional over source + EOS
    dtask = build_task(TaskConfig(name="seq2seq", max_len=24, max_target_len=6, layout="prefix_lm"), dcfg, gpt)
    (d,) = dtask.encode(Record("s:1", {"source": " ".join(["word"] * 40), "target": "the answer"}))
    k = int(d["prefix_lengths"])
    assert len(d["input_ids"]) <= 24 and d["input_ids"][k - 1] == gpt.eos_id and int(d["prompt_len"]) == k
    assert (d["labels"][:k] == IGNORE).all() and d["labels"][k:].tolist() == d["input_ids"][k:].tolist()
    assert gpt.decode(d["input_ids"][k:-1].tolist()) == "the answer"
    # a causally pretrained decoder (the default for GPT-2, Llama, imported LLMs): source target EOS, no separator
    ctask = build_task(TaskConfig(name="seq2seq", max_len=24, max_target_len=6), dcfg, gpt)
    assert ctask.layout.name == "causal"
    (c,) = ctask.encode(Record("s:1", {"source": " ".join(["word"] * 40), "target": "the answer"}))
    k = int(c["prompt_len"])
    assert "prefix_lengths" not in c and len(c["input_ids"]) <= 24 and c["input_ids"][-1] == gpt.eos_id
    assert (c["labels"][:k] == IGNORE).all() and c["labels"][k:].tolist() == c["input_ids"][k:].tolist()
    assert gpt.decode(c["input_ids"][k:-1].tolist()) == " the answer"  # continues the source as running text
    assert k == 24 - 1 - 6  # the source cut to what max_len leaves beside max_target_len


# ---------------------------------------------------------------------------------------------- label maps
def labels_of(values, **cfg) -> list[str]:
    return Classification.label_set(TaskConfig(**cfg), [Record(f"t:{i}", {"label": v}) for i, v in enumerate(values)])


def test_classification_label_map_order():
    assert labels_of(["pos", "neg", "neutral", "neg"]) == ["neg", "neutral", "pos"]
    assert labels_of([10, 2, 1, 0, 2]) == ["0", "1", "2", "10"]  # numbers in numeric order, not "10" < "2"
    assert labels_of(["10", "9", "-3"]) == ["-3", "9", "10"]
    assert labels_of([-1, 0.5, 2, 1.5, 10.0]) == ["-1", "0.5", "1.5", "2", "10"]
    assert labels_of([1, 1.0, "1", 0]) == ["0", "1"]  # 1, 1.0 and "1" are one label
    assert labels_of(["b", "10", "a", "2"]) == ["2", "10", "a", "b"]  # numbers first, then names
    assert labels_of(["x", "y"], labels=["y", "x", "z"]) == ["y", "x", "z"]  # task.labels wins
    with pytest.raises(DataError, match="at least 2"):
        labels_of(["only", "only"])


def test_classification_targets_follow_the_label_map(toks):
    tok = toks["wordpiece"]
    labels = labels_of([0, 1, 2, 10])
    cfg = model_cfg("tiny-bert-base", tok, head="classification", num_labels=4, labels=labels)
    task = Classification(TaskConfig(), cfg, tok)
    for value, index in ((10, 3), (2.0, 2), ("0", 0)):
        (f,) = task.encode(Record("t:1", {"text": "some text", "label": value}))
        assert int(f["labels"]) == index
    assert task.predict([], [], [np.array([0.0, 0.0, 0.0, 5.0])]) == ["10"]
    with pytest.raises(DataError, match="t:9: label '7' is not in the model's label map"):
        task.encode(Record("t:9", {"text": "some text", "label": 7}))


# -------------------------------------------------------------------------------------------- regression
def test_regression_labels(toks):
    tok = toks["wordpiece"]
    cfg = model_cfg("tiny-bert-base", tok, head="regression", num_labels=1)
    task = Regression(TaskConfig(name="regression"), cfg, tok)
    for value, want in ((3, 3.0), (2.5, 2.5), ("4.25", 4.25), (" -1e-3 ", -0.001), (0.1, 0.1)):
        rec = Record("r:1", {"text": "a sentence", "label": value})
        (f,) = task.encode(rec)
        assert f["labels"].dtype == np.float32 and float(f["labels"]) == pytest.approx(want)
        ref = task.reference(rec)
        assert type(ref) is float and ref == want  # the reference is not rounded to float32
    for bad, msg in (("abc", "r:2: regression label 'abc' is not a number"), ("nan", "not finite"),
                     ("inf", "not finite")):
        with pytest.raises(DataError, match=msg):
            task.encode(Record("r:2", {"text": "a sentence", "label": bad}))
    with pytest.raises(DataError, match="missing field 'label'"):
        task.encode(Record("r:3", {"text": "a sentence"}))
    assert Regression.label_set(TaskConfig(), []) == []
    assert Regression.head_config(TaskConfig(pooling="mean"), []) == {"head": "regression", "num_labels": 1,
                                                                      "labels": None, "pooling": "mean"}
    # a record with text_a/text_b (STS-B) is a pair: [CLS] a [SEP] b [SEP]
    (f,) = task.encode(Record("r:4", {"text_a": "a cat", "text_b": "a dog", "label": 3.8}))
    assert f["token_type_ids"].tolist().count(1) == len(ids(tok, "a dog")) + 1
    assert task.predict([], [], [np.array([1.5], dtype=np.float32)]) == [1.5]


# --------------------------------------------------------------------------------------------------- qa
def qa_task(tok: Tokenizer, preset: str, **kw):
    cfg = model_cfg(preset, tok, head="qa", num_labels=2)
    return build_task(TaskConfig(name="qa", **kw), cfg, tok)


def test_qa_answer_formats(toks):
    task = qa_task(toks["wordpiece"], "tiny-bert-base")

    def answers(value):
        return task.answers(Record("q:1", {"answers": value}))

    assert answers({"text": ["Paris", "Lyon"], "answer_start": [3, 10]}) == [("Paris", 3), ("Lyon", 10)]
    assert answers({"text": "Paris"}) == [("Paris", None)]  # one string, no answer_start
    assert answers({"text": "Paris", "answer_start": 3}) == [("Paris", 3)]
    assert answers({"text": [], "answer_start": []}) == []
    assert answers([{"text": "Paris", "answer_start": 3}, "Lyon"]) == [("Paris", 3), ("Lyon", None)]
    assert answers("") == [] and answers("Paris") == [("Paris", None)]
    with pytest.raises(DataError, match="q:1: answers has 2 text"):
        answers({"text": ["a", "b"], "answer_start": [1]})


def test_qa_layout_follows_the_model(toks):
    ctx = "Emma lived at Hartfield with her father. The code is sunrise."
    rec = Record("q:1", {"context": ctx, "question": "What is the code?",
                         "answers": {"text": ["sunrise"], "answer_start": [ctx.index("sunrise")]}})
    bert = qa_task(toks["wordpiece"], "tiny-bert-base")
    (f,) = bert.encode(rec)
    assert bert.layout == "bert" and set(f["token_type_ids"].tolist()) == {0, 1}
    roberta = qa_task(toks["bpe"], "tiny-roberta-base")
    (g,) = roberta.encode(rec)
    eos = toks["bpe"].eos_id
    assert roberta.layout == "roberta" and "token_type_ids" not in g
    q = ids(toks["bpe"], "What is the code?")
    assert g["input_ids"][: len(q) + 3].tolist() == [toks["bpe"].bos_id, *q, eos, eos]
    for feat in (f, g):
        s, e = int(feat["start_positions"]), int(feat["end_positions"])
        a, b = feat["_offsets"][s][0], feat["_offsets"][e][1]
        assert ctx[a:b] == "sunrise"
    model = TransformerLM(roberta.model_cfg)
    batch = roberta.collate([g])
    assert roberta.forward_logits(model, batch).shape == (1, len(g["input_ids"]), 2)


def test_qa_window_settings_are_checked_up_front(toks):
    with pytest.raises(ConfigError, match=r"task qa: .*stride.*task.max_len=24, task.stride=16"):
        qa_task(toks["wordpiece"], "tiny-bert-base", max_len=24, stride=16)
