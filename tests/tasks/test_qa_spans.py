import itertools

import numpy as np
import pytest

from pretune.data.readers import DataError
from pretune.io.tokenization import Tokenizer
from pretune.tasks.qa_spans import best_span, decode_answer, find_answer, qa_features, top_spans

CONTEXT = ("The Eiffel Tower was built for the 1889 World's Fair in Paris. It was designed by the engineering "
           "company of Gustave Eiffel, and it stood as the tallest structure in the world for forty-one years.")
QUESTION = "Who designed the Eiffel Tower?"
ANSWER = "Gustave Eiffel"

LONG_CONTEXT = " ".join(
    f"Sentence number {i} talks about the weather in town {i}, which was mild and rather pleasant." for i in range(12))


@pytest.fixture(scope="module", params=["wordpiece", "bpe", "unigram", "minilm"])
def tok(request, tokenizers_by_kind):
    if request.param == "minilm":
        from pretune.realmodels import minilm_dir

        try:
            return Tokenizer.load(minilm_dir())
        except FileNotFoundError as e:
            pytest.skip(str(e))
    return Tokenizer.load(tokenizers_by_kind[request.param])


@pytest.fixture(scope="module")
def wordpiece(tokenizers_by_kind):
    return Tokenizer.load(tokenizers_by_kind["wordpiece"])


def peaked(n, s, e, *, null=-5.0, high=10.0):
    """Start/end logits of length n: ``high`` at s (start) and e (end), 0 elsewhere, ``null`` at position 0."""
    start, end = np.zeros(n), np.zeros(n)
    start[s] = end[e] = high
    start[0] = end[0] = null
    return start, end


def brute_force(start, end, offsets, max_answer_len):
    best = None
    for s, e in itertools.product(range(len(offsets)), repeat=2):
        if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > max_answer_len:
            continue
        score = start[s] + end[e]
        if best is None or score > best[2]:
            best = (s, e, score)
    return best


# ---- (a) short context: labels decode back to the answer --------------------------------------------

@pytest.mark.parametrize("layout", ["bert", "roberta"])
def test_short_context_labels_decode_to_answer(tok, layout):
    span = find_answer(CONTEXT, ANSWER)
    assert CONTEXT[span[0]:span[1]] == ANSWER
    feats = qa_features(tok, QUESTION, CONTEXT, [span], max_len=256, stride=32, layout=layout)
    assert len(feats) == 1
    f = feats[0]
    s, e = f["start_positions"], f["end_positions"]
    assert 0 < s <= e < len(f["input_ids"])
    assert CONTEXT[f["offsets"][s][0]:f["offsets"][e][1]] == ANSWER
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert f[key].dtype == np.int64 and f[key].shape == f["input_ids"].shape
    assert f["attention_mask"].all()
    null_id = tok.cls_id if tok.cls_id is not None else tok.pad_id
    assert f["input_ids"][0] == null_id and f["input_ids"][-1] == tok.sep_id
    n_q = len(tok.encode(QUESTION))
    n_c = len(tok.encode(CONTEXT))
    assert len(f["input_ids"]) == n_q + n_c + (3 if layout == "bert" else 4)
    assert list(f["input_ids"][1:1 + n_q]) == tok.encode(QUESTION)
    assert all(o is None for o in f["offsets"][:1 + n_q + (1 if layout == "bert" else 2)])
    assert f["offsets"][-1] is None
    if layout == "bert":
        assert list(f["token_type_ids"]) == [0] * (n_q + 2) + [1] * (n_c + 1)
    else:
        assert not f["token_type_ids"].any()
    # the labelled ids are the answer's tokens (small trained vocabularies may hold [UNK]s)
    decoded = tok.decode(f["input_ids"][s:e + 1]).strip()
    assert decoded.lower() == ANSWER.lower() or "[UNK]" in decoded
    start, end = peaked(len(f["input_ids"]), s, e)
    assert decode_answer(feats, [start], [end], CONTEXT, max_answer_len=30) == (ANSWER, 20.0)


def test_answer_with_answer_start_and_several_answers(wordpiece):
    second = CONTEXT.index("Eiffel", 10)
    assert find_answer(CONTEXT, "Eiffel") == (4, 10)
    assert find_answer(CONTEXT, "Eiffel", second) == (second, second + 6)
    spans = [find_answer(CONTEXT, "Eiffel", second), (4, 10)]
    f = qa_features(wordpiece, "Who?", CONTEXT, spans, max_len=128, stride=16)[0]
    assert f["offsets"][f["start_positions"]][0] == second  # the first gold span is the label


# ---- (b) long context, answer across a window boundary ---------------------------------------------

def test_answer_across_window_boundary(tok):
    max_len, stride = 24, 4
    enc = tok.tk.encode(LONG_CONTEXT, add_special_tokens=False)
    plain = qa_features(tok, "What was the weather?", LONG_CONTEXT, [], max_len=max_len, stride=stride)
    assert len(plain) >= 3
    (a0, b0), (a1, _) = plain[0]["context_tokens"], plain[1]["context_tokens"]
    assert a0 == 0 and a1 == b0 - stride
    # a 3-token answer whose last token is the first visible one after window 0: window 0 holds only part of it
    visible = [i for i, (a, b) in enumerate(enc.offsets) if LONG_CONTEXT[a:b].strip()]
    k = next(k for k, i in enumerate(visible) if i >= b0)
    t_s, t_e = visible[k - 2], visible[k]
    assert t_s < b0 <= t_e
    a, b = enc.offsets[t_s][0], enc.offsets[t_e][1]
    answer = LONG_CONTEXT[a:b].strip()
    span = find_answer(LONG_CONTEXT, answer, LONG_CONTEXT.index(answer, a))
    feats = qa_features(tok, "What was the weather?", LONG_CONTEXT, [span], max_len=max_len, stride=stride)
    assert [f["context_tokens"] for f in feats] == [f["context_tokens"] for f in plain]
    labelled = [f for f in feats if f["start_positions"]]
    assert labelled, "some window must hold the whole answer"
    for f in feats:
        a, b = f["context_tokens"]
        whole = a <= t_s and t_e < b
        if f["start_positions"]:
            assert whole
            s, e = f["start_positions"], f["end_positions"]
            assert LONG_CONTEXT[f["offsets"][s][0]:f["offsets"][e][1]] == answer
        else:
            assert f["end_positions"] == 0
            assert not whole
    assert feats[0]["start_positions"] == feats[0]["end_positions"] == 0  # partial: 0
    assert feats[1]["start_positions"] > 0  # window 1 holds it whole

    rng = np.random.default_rng(0)
    starts, ends = [], []
    for f in feats:
        n = len(f["input_ids"])
        starts.append(rng.normal(0, 0.5, n))
        ends.append(rng.normal(0, 0.5, n))
    f = feats[1]
    starts[1], ends[1] = peaked(len(f["input_ids"]), f["start_positions"], f["end_positions"], null=-3.0)
    text, score = decode_answer(feats, starts, ends, LONG_CONTEXT, max_answer_len=10)
    assert text == answer and score == 20.0


# ---- (c) unanswerable --------------------------------------------------------------------------------

def test_unanswerable_labels_and_null_decoding(wordpiece):
    feats = qa_features(wordpiece, "When did it snow?", LONG_CONTEXT, [], max_len=32, stride=8)
    assert len(feats) > 2
    assert all(f["start_positions"] == f["end_positions"] == 0 for f in feats)
    starts, ends = [], []
    for f in feats:
        start, end = np.zeros(len(f["input_ids"])), np.zeros(len(f["input_ids"]))
        start[0] = end[0] = 5.0  # null score 10 in every window, best span score 0
        starts.append(start)
        ends.append(end)
    assert decode_answer(feats, starts, ends, LONG_CONTEXT, max_answer_len=20) == ("", 10.0)
    text, score = decode_answer(feats, starts, ends, LONG_CONTEXT, max_answer_len=20, null_threshold=float("inf"))
    assert text and score == 0.0  # SQuAD 1.1: always answer


def test_null_convention(wordpiece):
    feats = qa_features(wordpiece, "Who designed it?", CONTEXT, [], max_len=40, stride=8)
    assert len(feats) >= 2
    span_pos = next(i for i, o in enumerate(feats[0]["offsets"]) if o is not None)
    starts, ends = [], []
    for f in feats:
        start, end = np.full(len(f["input_ids"]), -1.0), np.full(len(f["input_ids"]), -1.0)
        start[0] = end[0] = 2.5  # null 5 in every window
        starts.append(start)
        ends.append(end)
    starts[0][span_pos] = ends[0][span_pos] = 2.0  # best span: score 4
    word = CONTEXT[slice(*feats[0]["offsets"][span_pos])]
    dec = lambda **kw: decode_answer(feats, starts, ends, CONTEXT, max_answer_len=5, **kw)
    assert dec() == ("", 5.0)  # null 5 > 4 + 0
    assert dec(null_threshold=0.5) == ("", 5.0)
    assert dec(null_threshold=1.0) == (word, 4.0)  # tie keeps the span
    assert dec(null_threshold=2.0) == (word, 4.0)
    # the null score is the minimum over windows: one window with a low null lets the span win
    starts[-1][0] = ends[-1][0] = 1.0  # null 2 there
    assert dec() == (word, 4.0)


# ---- (d) best_span -----------------------------------------------------------------------------------

def test_best_span_never_ends_before_start():
    offsets = [None] + [(i, i + 1) for i in range(9)]
    start, end = np.zeros(10), np.zeros(10)
    start[7], end[3] = 10.0, 10.0  # the favourite end comes before the favourite start
    s, e, score = best_span(start, end, offsets, max_answer_len=10)
    assert s <= e
    assert score == 10.0
    assert (s, e, score) == brute_force(start, end, offsets, 10)


def test_best_span_respects_max_answer_len_and_context_only():
    offsets = [None, None, (0, 3), (4, 7), (8, 9), None, (10, 12), (13, 15), None]
    start, end = np.zeros(9), np.zeros(9)
    start[2], end[7] = 5.0, 5.0  # 6 tokens apart
    start[0] = end[0] = 100.0  # the null token is not a span
    start[5] = end[5] = 50.0  # nor is a position without offsets
    assert best_span(start, end, offsets, max_answer_len=6) == (2, 7, 10.0)
    s, e, score = best_span(start, end, offsets, max_answer_len=3)
    assert e - s + 1 <= 3 and score == 5.0
    assert best_span(start, end, [None] * 9, max_answer_len=3) is None
    assert top_spans(start, end, [None] * 9, max_answer_len=3) == []
    with pytest.raises(ValueError, match="max_answer_len"):
        best_span(start, end, offsets, max_answer_len=0)
    with pytest.raises(ValueError, match="shorter"):
        best_span(start[:4], end[:4], offsets, max_answer_len=3)


def test_best_span_matches_brute_force_on_random_logits():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        offsets = [(i, i + 1) if rng.random() < 0.7 else None for i in range(n)]
        pad = int(rng.integers(0, 3))  # batch padding beyond the offsets is ignored
        start, end = rng.normal(size=n + pad), rng.normal(size=n + pad)
        max_answer_len = int(rng.integers(1, 12))
        got, want = best_span(start, end, offsets, max_answer_len=max_answer_len), \
            brute_force(start[:n], end[:n], offsets, max_answer_len)
        if want is None:
            assert got is None
            continue
        assert got[:2] == want[:2] and got[2] == pytest.approx(want[2])
        all_spans = sorted(((s, e, start[s] + end[e]) for s, e in itertools.product(range(n), repeat=2)
                            if offsets[s] is not None and offsets[e] is not None and s <= e < s + max_answer_len),
                           key=lambda t: -t[2])
        top = top_spans(start, end, offsets, max_answer_len=max_answer_len, top_k=5)
        assert [t[:2] for t in top] == [t[:2] for t in all_spans[:5]]
        assert top[0] == got


def test_best_span_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    offsets = [None, (0, 1), (2, 3), (4, 5)]
    start = torch.tensor([0.0, 1.0, 3.0, 0.0], dtype=torch.bfloat16)
    end = torch.tensor([0.0, 0.0, 1.0, 2.0])
    assert best_span(start, end, offsets, max_answer_len=5) == (2, 3, 5.0)


# ---- (e) bad answers -----------------------------------------------------------------------------------

def test_answer_not_in_context_names_the_row(wordpiece):
    with pytest.raises(DataError, match=r"train\.jsonl:12: answer 'Napoleon' does not occur in its context"):
        find_answer(CONTEXT, "Napoleon", where="train.jsonl:12")
    with pytest.raises(DataError, match=r"train\.jsonl:12: .*empty"):
        find_answer(CONTEXT, "", where="train.jsonl:12")


def test_wrong_answer_start(wordpiece):
    real = CONTEXT.index(ANSWER)
    with pytest.raises(DataError, match=rf"dev\.jsonl:3: answer 'Gustave Eiffel' is not at answer_start=5 .*"
                                        rf"occurs at character {real}"):
        find_answer(CONTEXT, ANSWER, 5, where="dev.jsonl:3")
    with pytest.raises(DataError, match=r"dev\.jsonl:3: .*answer_start=999 .*does not occur"):
        find_answer(CONTEXT, "Napoleon", 999, where="dev.jsonl:3")
    with pytest.raises(DataError, match=r"x:1: answer span 0 \(5, 999\)"):
        qa_features(wordpiece, QUESTION, CONTEXT, [(5, 999)], max_len=64, stride=8, where="x:1")
    with pytest.raises(DataError, match=r"x:2: .*covers no context token"):
        qa_features(wordpiece, QUESTION, "a  b", [(1, 3)], max_len=64, stride=8, where="x:2")
    with pytest.raises(DataError, match=r"x:3: the context .* is empty"):
        qa_features(wordpiece, QUESTION, "   ", [], max_len=64, stride=8, where="x:3")


# ---- (f) max_len too small ---------------------------------------------------------------------------

def test_max_len_too_small(wordpiece):
    with pytest.raises(ValueError, match="max_len=4 is too small.*max_len must be >= 5"):
        qa_features(wordpiece, QUESTION, CONTEXT, [], max_len=4, stride=0)
    with pytest.raises(ValueError, match="max_len=16 is too small for stride=8"):
        qa_features(wordpiece, QUESTION, CONTEXT, [], max_len=16, stride=8)
    with pytest.raises(ValueError, match="stride must be >= 0"):
        qa_features(wordpiece, QUESTION, CONTEXT, [], max_len=64, stride=-1)
    with pytest.raises(ValueError, match="unknown layout"):
        qa_features(wordpiece, QUESTION, CONTEXT, [], max_len=64, stride=8, layout="gpt")


def test_long_question_is_truncated(wordpiece):
    question = "Who " + "really " * 100 + "designed it?"
    feats = qa_features(wordpiece, question, CONTEXT, [], max_len=40, stride=4)
    n_q = (40 - 3) // 2
    for f in feats:
        assert list(f["input_ids"][1:1 + n_q]) == wordpiece.encode(question)[:n_q]
        assert f["input_ids"][1 + n_q] == wordpiece.sep_id
        a, b = f["context_tokens"]
        assert b - a <= 40 - 3 - n_q
    feats = qa_features(wordpiece, question, CONTEXT, [], max_len=40, stride=4, max_question_len=5)
    assert feats[0]["input_ids"][6] == wordpiece.sep_id
    assert feats[0]["context_tokens"][1] == 40 - 3 - 5


# ---- (g) windows cover the context, never exceed max_len ----------------------------------------------

@pytest.mark.parametrize("max_len,stride", [(20, 0), (24, 5), (40, 10), (64, 16)])
@pytest.mark.parametrize("layout", ["bert", "roberta"])
def test_windows_cover_context(tok, max_len, stride, layout):
    c_ids = tok.encode(LONG_CONTEXT)
    feats = qa_features(tok, QUESTION, LONG_CONTEXT, [], max_len=max_len, stride=stride, layout=layout)
    covered = np.zeros(len(c_ids), dtype=bool)
    n_special = 3 if layout == "bert" else 4
    n_q = min(len(tok.encode(QUESTION)), (max_len - n_special) // 2)  # the question keeps at most half the room
    n_prefix = 1 + n_q + (1 if layout == "bert" else 2)
    for w, f in enumerate(feats):
        assert f["window"] == w
        assert len(f["input_ids"]) <= max_len
        assert len(f["offsets"]) == len(f["input_ids"])
        a, b = f["context_tokens"]
        assert list(f["input_ids"][1:1 + n_q]) == tok.encode(QUESTION)[:n_q]
        assert list(f["input_ids"][n_prefix:-1]) == c_ids[a:b]
        covered[a:b] = True
        if w:
            prev_a, prev_b = feats[w - 1]["context_tokens"]
            assert prev_b - a == stride  # consecutive windows share exactly `stride` context tokens
        if w < len(feats) - 1:
            assert len(f["input_ids"]) == max_len  # only the last window may be shorter
    assert covered.all()
    assert feats[-1]["context_tokens"][1] == len(c_ids)


def test_pad_to_max_len(wordpiece):
    feats = qa_features(wordpiece, QUESTION, LONG_CONTEXT, [], max_len=48, stride=8, pad_to_max_len=True)
    last = feats[-1]
    assert all(len(f["input_ids"]) == 48 for f in feats)
    n = int(last["attention_mask"].sum())
    assert n < 48
    assert (last["input_ids"][n:] == wordpiece.pad_id).all() and not last["token_type_ids"][n:].any()
    assert all(o is None for o in last["offsets"][n:])
