"""Prompting without training: templates, verbalizers, shots, label-word scoring, context window, chat templates,
chain-of-thought answer extraction and self-consistency (generation.prompt, generation.scoring, pretune prompt)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pretune
from pretune.cli import main
from pretune.data.readers import DataError
from pretune.generation import scoring
from pretune.generation.prompt import (
    ChatTemplate,
    FewShotPrompt,
    PromptError,
    PromptTemplate,
    Verbalizer,
    apply_chat_template,
    extract_answer,
    load_chat_template,
    majority_vote,
    normalize_answer,
    random_labels,
    select_shots,
    self_consistency,
)
from pretune.generation.scoring import chain_of_thought, classify, lead_ids
from pretune.tasks.base import Record

SPAM = ["WINNER!! claim your free prize now, call 0800", "Free entry: win cash, text WIN to 80086",
        "URGENT: your mobile won a bonus, call now"]
HAM = ["see you at lunch", "are you coming home tonight?", "ok lor, i will call you later", "Sorry, running late"]


@pytest.fixture(scope="module")
def tok():
    texts = [f"Message: {t}\nIs it spam? Answer: {a}" for t in SPAM + HAM for a in ("yes", "no", "not spam")]
    return pretune.train_tokenizer(texts=texts * 20, kind="bpe", vocab_size=320, show_progress=False)


def _model(preset: str, tok, **kw):
    torch.manual_seed(0)
    return pretune.build_model(pretune.get_preset(preset, vocab_size=tok.vocab_size, **kw)).eval()


def _records(texts, labels, name="data.jsonl"):
    return [Record(f"{name}:{i + 1}", {"text": t, "label": lab}) for i, (t, lab) in enumerate(zip(texts, labels))]


POOL = _records(SPAM + HAM, ["spam"] * 3 + ["ham"] * 4, "train.jsonl")
TEST = _records(["win a free prize", "lunch at noon?", "call me later ok"], ["spam", "ham", "ham"], "test.jsonl")
TEMPLATE = "Message: {text}\nIs it spam? Answer: {label}"


# ------------------------------------------------------------------------------ templates, verbalizers
def test_template_context_gap_and_appended_slot():
    t = PromptTemplate(TEMPLATE)
    assert t.fields == ["text"]
    assert t.context(TEST[0]) == ("Message: win a free prize\nIs it spam? Answer:", " ")
    assert t.render(TEST[0], "yes").endswith("Answer: yes")
    t2 = PromptTemplate("Message: {text}\nIs it spam? Answer:")  # no slot: " {label}" appended
    assert t2.text == "Message: {text}\nIs it spam? Answer: {label}"
    assert PromptTemplate("{{literal}} {text}").context(TEST[0]) == ("{literal} win a free prize", " ")


@pytest.mark.parametrize("text, match", [
    ("Answer: {label}", r"no input placeholder"),
    ("just text", r"no input placeholder"),
    ("{text!r} {label}", r"placeholder \{text!r\}"),
    ("{} {label}", r"placeholder \{\}"),
    ("{text} {label} {label}", r"slot \{label\} 2 times"),
    ("{text} {label", r"not a valid template"),
    ("", r"empty"),
])
def test_template_errors_name_the_template(text, match):
    with pytest.raises(PromptError, match=match):
        PromptTemplate(text, name="--template")


def test_template_unknown_field_names_record_template_and_field():
    t = PromptTemplate("Review: {review}\nAnswer:", name="--template")
    with pytest.raises(DataError, match=r"test.jsonl:1: the --template .* uses the placeholder \{review\}, but the "
                       r"record has no field 'review' \(it has: label, text\)"):
        t.context(TEST[0])


def test_verbalizer_parse_load_and_errors(tmp_path):
    v = Verbalizer.parse("ham=not spam, spam=spam")
    assert v.words == {"ham": "not spam", "spam": "spam"} and v.labels == ["ham", "spam"]
    assert Verbalizer.parse("positive,negative").words == {"positive": "positive", "negative": "negative"}
    (tmp_path / "v.json").write_text(json.dumps({"0": "bad", "1": "good"}))
    assert Verbalizer.load(tmp_path / "v.json").words == {"0": "bad", "1": "good"}
    (tmp_path / "v.txt").write_text("# sentiment\nneg\tNo\npos=Yes\n")
    assert Verbalizer.load(tmp_path / "v.txt").words == {"neg": "No", "pos": "Yes"}
    for spec, match in (("", "label set is empty"), ("a=x,b=x", "stands for several labels"),
                        ("a=x", "one label"), ("a=x,a=y", "twice"), ("a=,b=y", "non-empty")):
        with pytest.raises(PromptError, match=match):
            Verbalizer.parse(spec)
    with pytest.raises(DataError, match=r"test.jsonl:1: label 'spam' is not in .*\['neg', 'pos'\]"):
        Verbalizer.parse("neg=No,pos=Yes").label_of(TEST[0])


# ------------------------------------------------------------------------------------------- shots
def test_shot_selection_is_seeded_and_orders_are_explicit():
    a = select_shots(POOL, 4, seed=3)
    assert [r.where for r in a] == [r.where for r in select_shots(POOL, 4, seed=3)]
    assert len({tuple(sorted(r.where for r in select_shots(POOL, 4, seed=s))) for s in range(6)}) > 1
    # the order seed changes the order, never the examples
    o1 = select_shots(POOL, 4, seed=3, order_seed=1)
    o2 = select_shots(POOL, 4, seed=3, order_seed=2)
    assert sorted(r.where for r in o1) == sorted(r.where for r in o2) == sorted(r.where for r in a)
    orders = {tuple(r.where for r in select_shots(POOL, 4, seed=3, order_seed=s)) for s in range(6)}
    assert len(orders) > 1
    f = select_shots(POOL, 4, seed=3, order="file")
    assert [r.where for r in f] == sorted((r.where for r in a), key=lambda w: int(w.split(":")[1]))


def test_balanced_interleaved_and_exact_shots():
    b = select_shots(POOL, 4, seed=0, balanced=True, labels=["ham", "spam"], order="interleave")
    assert [r.data["label"] for r in b] == ["ham", "spam", "ham", "spam"]
    b3 = select_shots(POOL, 5, seed=0, balanced=True, labels=["ham", "spam"])
    counts = sorted([sum(r.data["label"] == x for r in b3) for x in ("ham", "spam")])
    assert counts == [2, 3]
    assert [r.where for r in select_shots(POOL, 0, ids=[6, 0, 3])] == ["train.jsonl:7", "train.jsonl:1",
                                                                        "train.jsonl:4"]
    assert select_shots(POOL, 0) == []
    with pytest.raises(PromptError, match="only 7 usable examples"):
        select_shots(POOL, 8)
    with pytest.raises(PromptError, match="need 3 examples of 'spam', train.jsonl has 2"):
        select_shots(POOL[1:], 6, balanced=True, labels=["ham", "spam"])
    with pytest.raises(PromptError, match=r"shot ids \[9\]"):
        select_shots(POOL, 0, ids=[9])


def test_random_labels_are_seeded_uniform_draws_from_the_label_set():
    """Min et al. 2022's random labels: each demonstration's label drawn uniformly, with replacement, from the set."""
    a = random_labels(6, ["ham", "spam"], seed=3)
    assert a == random_labels(6, ["ham", "spam"], seed=3) and set(a) <= {"ham", "spam"}
    assert len({tuple(random_labels(6, ["ham", "spam"], seed=s)) for s in range(8)}) > 1
    draws = random_labels(4000, ["a", "b", "c", "d"], seed=0)
    assert all(900 < draws.count(x) < 1100 for x in "abcd")  # 1000 expected each; binomial std ~27
    assert random_labels(0, ["a", "b"]) == []
    with pytest.raises(PromptError, match="label set"):
        random_labels(2, [])


def test_prompt_prefix_and_drop_first_shots():
    t = PromptTemplate(TEMPLATE)
    shots = POOL[:2]
    p = FewShotPrompt(t, shots=shots, targets=["yes", "no"], instruction="Spot spam.")
    one = "Message: Free entry: win cash, text WIN to 80086\nIs it spam? Answer: no\n\n"
    assert p.prefix(1) == "Spot spam.\n\n" + one  # the shot nearest the query stays
    assert p.prefix() == "Spot spam.\n\n" + f"Message: {SPAM[0]}\nIs it spam? Answer: yes\n\n" + one
    assert p.prefix(0) == "Spot spam.\n\n"
    assert p.text(TEST[0], "yes", n_shots=0) == "Spot spam.\n\nMessage: win a free prize\nIs it spam? Answer: yes"


# ----------------------------------------------------------------------------------- label scoring
def _direct(model, ids: list[int], n_word: int) -> float:
    """log p(last n_word tokens | the rest): one full forward pass, log_softmax by hand."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return float(sum(lp[len(ids) - n_word - 1 + j, ids[len(ids) - n_word + j]] for j in range(n_word)))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("strategy", ["cache", "rows"])
def test_label_scores_equal_direct_log_likelihood(tok, preset, strategy):
    model = _model(preset, tok)
    v = Verbalizer.parse("ham=not spam at all,spam=yes")  # words of different token lengths
    t = PromptTemplate(TEMPLATE)
    p = FewShotPrompt(t, shots=POOL[:2], targets=["yes", "not spam at all"])
    res = classify(model, tok, p, v, TEST, batch_size=2, strategy=strategy)
    lead = lead_ids(tok)
    assert lead == [tok.bos_id]  # the byte-level BPE's post-processor puts <s> first
    for i, rec in enumerate(TEST):
        ctx, gap = t.context(rec)
        for j, word in enumerate(v.words.values()):
            cont = tok.encode(gap + word)
            ids = lead + tok.encode(p.prefix()) + tok.encode(ctx) + cont
            assert res.scores[i, j].item() == pytest.approx(_direct(model, ids, len(cont)), abs=2e-5)
    assert len(tok.encode(" not spam at all")) > 1 and len(tok.encode(" yes")) == 1
    mean = classify(model, tok, p, v, TEST, length_norm="mean")
    n = torch.tensor([len(tok.encode(" " + w)) for w in v.words.values()], dtype=torch.float64)
    torch.testing.assert_close(mean.scores, res.scores / n, atol=2e-5, rtol=0)
    assert res.predictions == [v.labels[k] for k in res.scores.argmax(1).tolist()]


def test_contextual_calibration_divides_by_the_content_free_probabilities(tok):
    model = _model("tiny-llama", tok)
    v = Verbalizer.parse("ham=not spam at all,spam=yes")
    p = FewShotPrompt(PromptTemplate(TEMPLATE), shots=POOL[:2], targets=["yes", "not spam at all"])
    res = classify(model, tok, p, v, TEST, content_free="N/A")
    free = classify(model, tok, p, v, [Record("cf", {"text": "N/A"})]).scores  # the same prompt around "N/A"
    p_x, p_cf = F.softmax(res.scores, -1), F.softmax(free, -1)  # both renormalised over the label set
    want = torch.log((p_x / p_cf) / (p_x / p_cf).sum(-1, keepdim=True))  # W = diag(p_cf)^-1, b = 0, renormalised
    torch.testing.assert_close(res.calibrated, want)
    assert res.predictions == [v.labels[i] for i in want.argmax(1).tolist()]
    assert res.raw_predictions == classify(model, tok, p, v, TEST).predictions
    with pytest.raises(PromptError, match="no content-free baseline"):
        _ = classify(model, tok, p, v, TEST).calibrated


def test_calibration_averages_the_probabilities_of_zhao_et_als_three_content_free_inputs(tok):
    from pretune.generation.scoring import CONTENT_FREE

    assert CONTENT_FREE == ("N/A", "", "[MASK]")
    model = _model("tiny-llama", tok)
    v = Verbalizer.parse("ham=no,spam=yes")
    p = FewShotPrompt(PromptTemplate(TEMPLATE), shots=POOL[:2], targets=["yes", "no"])
    res = classify(model, tok, p, v, TEST, content_free=CONTENT_FREE)
    each = [F.softmax(classify(model, tok, p, v, [Record("cf", {"text": t})]).scores[0], -1) for t in CONTENT_FREE]
    p_cf = torch.stack(each).mean(0)  # the mean of the three label distributions, not of their logs
    p_x = F.softmax(res.scores, -1)
    want = (p_x / p_cf) / (p_x / p_cf).sum(-1, keepdim=True)
    torch.testing.assert_close(res.calibrated.exp(), want)
    assert not torch.allclose(res.baseline[0], torch.log(each[0]))  # really more than "N/A"


def test_encoder_decoder_scores_the_word_as_decoder_target(tok):
    model = _model("tiny-t5-small", tok)
    v = Verbalizer.parse("ham=no,spam=not spam at all")
    p = FewShotPrompt(PromptTemplate(TEMPLATE))
    res = classify(model, tok, p, v, TEST[:2], batch_size=1)
    for i, rec in enumerate(TEST[:2]):
        enc = tok.tk.encode(p.text(rec), add_special_tokens=True).ids
        for j, word in enumerate(v.words.values()):
            tgt = tok.tk.encode(word, add_special_tokens=True).ids
            dec = [model.config.decoder_start_token_id] + tgt[:-1]
            logits = model(torch.tensor([enc]), decoder_input_ids=torch.tensor([dec])).logits[0].double()
            want = F.log_softmax(logits, -1)[torch.arange(len(tgt)), torch.tensor(tgt)].sum().item()
            assert res.scores[i, j].item() == pytest.approx(want, abs=2e-5)


def test_encoder_models_are_refused(tok):
    with pytest.raises(PromptError, match="decoder or encoder-decoder with an LM head"):
        classify(_model("tiny-bert-base", tok), tok, FewShotPrompt(PromptTemplate(TEMPLATE)),
                 Verbalizer.parse("ham=no,spam=yes"), TEST)


SMOL_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def test_chat_mode_scores_the_reply(tok):
    model = _model("tiny-llama", tok, max_seq_len=512)  # the chat markup is spelled in bytes by this tokenizer
    chat = ChatTemplate(SMOL_TEMPLATE)
    v = Verbalizer.parse("ham=no,spam=yes")
    p = FewShotPrompt(PromptTemplate(TEMPLATE), shots=POOL[:1], targets=["yes"])
    res = classify(model, tok, p, v, TEST, chat=chat, system="Be brief.", batch_size=3)
    for i, rec in enumerate(TEST):
        text = apply_chat_template(chat, [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": p.text(rec)}])
        assert text.endswith("Is it spam? Answer:<|im_end|>\n<|im_start|>assistant\n")
        for j, word in enumerate(v.words.values()):
            cont = tok.encode(word)  # the reply starts with the word: no gap
            ids = tok.encode(text) + cont  # no BOS: the chat template is the whole prompt
            want = _direct(model, ids, len(cont))
            # the prompt is encoded in two pieces (shared head, query + tail): same ids here
            assert res.scores[i, j].item() == pytest.approx(want, abs=2e-5)


# --------------------------------------------------------------------------------- context window
def test_context_window_error_and_drop_shots(tok):
    model = _model("tiny-llama", tok)
    v = Verbalizer.parse("ham=no,spam=yes")
    p = FewShotPrompt(PromptTemplate(TEMPLATE), shots=POOL[:3], targets=["yes"] * 3)
    lead, q = lead_ids(tok), tok.encode(PromptTemplate(TEMPLATE).context(TEST[0])[0])
    one_shot = len(lead) + len(tok.encode(p.prefix(1))) + len(q) + 1
    with pytest.raises(DataError, match=rf"test.jsonl:1: the prompt with 3 shots needs \d+ tokens \(1 of them for "
                       rf"the answer\), more than the context window of {one_shot} \(max_len={one_shot}\); "
                       r".*--fit drop-shots"):
        classify(model, tok, p, v, TEST[:1], max_len=one_shot)
    res = classify(model, tok, p, v, TEST[:1], max_len=one_shot, fit="drop_shots")
    assert res.n_shots == [1]
    kept = FewShotPrompt(PromptTemplate(TEMPLATE), shots=POOL[2:3], targets=["yes"])  # the last shot stays
    torch.testing.assert_close(res.scores, classify(model, tok, kept, v, TEST[:1]).scores)
    with pytest.raises(DataError, match="even without shots needs .* the context window of 5.*shorten the input"):
        classify(model, tok, p, v, TEST[:1], max_len=5, fit="drop_shots")
    # the model's own window applies without max_len
    small = _model("tiny-llama", tok, max_seq_len=12)
    with pytest.raises(DataError, match=r"context window of 12 \(the model's max_seq_len=12\)"):
        classify(small, tok, p, v, TEST[:1])


# ---------------------------------------------------------------------------------- chat templates
def test_chat_template_matches_transformers_without_a_model(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
                "[{{ m['role'] | upper }}] {{ m['content'] | trim }}{% if not loop.last %}\n{% endif %}"
                "{% endfor %}{% if messages[-1]['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                "{% if add_generation_prompt %}\n[ASSISTANT] {% endif %}{{ {'é': 1} | tojson }}")
    folder = tmp_path / "tok"
    tok.save(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": [{"name": "default", "template": template}]}))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<s>",
                                              eos_token="</s>")
    hf.chat_template = template
    msgs = [{"role": "system", "content": "hidden"}, {"role": "user", "content": " héllo <b> "},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "2+2?"}]
    for gen in (True, False):
        want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert apply_chat_template(folder, msgs, add_generation_prompt=gen) == want
        assert apply_chat_template(folder / "tokenizer.json", msgs, add_generation_prompt=gen) == want
    with pytest.raises(PromptError, match="no tools"):
        apply_chat_template(folder, [{"role": "tool", "content": "x"}])
    with pytest.raises(PromptError, match="has no chat template"):
        load_chat_template(tmp_path)
    with pytest.raises(PromptError, match=r"no chat template named 'x'; it has \['default'\]"):
        load_chat_template(folder, "x")


def _smollm2_folder() -> Path:
    root = Path(os.environ.get("PRETUNE_CACHE", Path.home() / ".cache" / "pretune")).expanduser()
    folder = root / "smollm2-135m-instruct"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"{folder} not converted yet (pretune.realmodels.smollm2_dir())")
    return folder


def test_chat_template_equals_transformers_for_smollm2():
    transformers = pytest.importorskip("transformers")
    folder = _smollm2_folder()
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    chats = [[{"role": "user", "content": "What is 2+2?"}],
             [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Spam?\nYes or no"}],
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "Tell me a joke. 😀"}]]
    for msgs in chats:
        for gen in (True, False):
            want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert apply_chat_template(folder, msgs, add_generation_prompt=gen) == want
    # tokenizing the text with the pretune tokenizer gives transformers' tokenize=True ids
    tok = pretune.load_tokenizer(folder)
    ids = hf.apply_chat_template(chats[1], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.encode(apply_chat_template(folder, chats[1])) == list(ids)
    assert apply_chat_template(hf, chats[0]) == hf.apply_chat_template(chats[0], tokenize=False,
                                                                       add_generation_prompt=True)


# ---------------------------------------------------------------------- chain of thought, voting
def test_extract_answer():
    assert extract_answer("5 + 6 = 11. The answer is 11.") == "11"
    assert extract_answer("The answer is 3. Wait, 23 - 20 = 3, +6 = 9. The answer is: $9") == "9"
    assert extract_answer("They had 23 - 20 = 3 apples, then 3 + 6 = 9 apples") == "9"  # no phrase: last number
    assert extract_answer("so 1,000.0 in all") == "1000"
    assert extract_answer("I do not know") is None
    assert extract_answer("Answer: (B) because", r"\(([A-E])\)") == "b"
    assert extract_answer("final: 42", r"final: \d+") == "final: 42"
    assert normalize_answer("-3.50") == "-3.5" and normalize_answer(" 7. ") == "7" and normalize_answer(None) is None


def test_majority_vote_distribution_and_tie_rule():
    v = majority_vote(["9", "8", None, "9", "8", "7"])
    assert v.answer == "9" and v.counts == {"9": 2, "8": 2, "7": 1}  # 9 and 8 tie: 9 appeared first
    assert v.n_paths == 6 and v.n_unanswered == 1 and v.agreement == pytest.approx(2 / 6)
    assert majority_vote(["8", "9", "9", "8"]).answer == "8"  # tie again: the earliest path's answer
    assert majority_vote(["1", "2", "2"]).answer == "2"
    none = majority_vote([None, None])
    assert none.answer is None and none.counts == {} and none.agreement == 0.0


def test_self_consistency_with_a_stub_generator():
    paths = ["23 - 20 = 3, 3 + 6 = 9. The answer is 9.", "The answer is 27.", "So 9 apples.",
             "23 + 6 = 29. The answer is 29.", "I am not sure."]
    asked = []

    def sample(k):
        asked.append(k)
        return paths[:k]

    sc = self_consistency(sample, 5)
    assert asked == [5] and sc.paths == paths
    assert sc.answers == ["9", "27", "9", "29", None]
    assert sc.vote.answer == "9" and sc.vote.counts == {"9": 2, "27": 1, "29": 1} and sc.vote.n_unanswered == 1
    assert self_consistency(sample, 1).vote.answer == "9"  # k=1: plain chain-of-thought
    with pytest.raises(PromptError, match="returned 2 paths for k=3"):
        self_consistency(lambda k: paths[:2], 3)


def test_chain_of_thought_prompts_seeds_and_votes(tok, monkeypatch):
    model = _model("tiny-llama", tok)
    calls = []

    def fake_sample_paths(model, tok, prompt_ids, *, n, do_sample, seed, stop, max_new_tokens, **kw):
        calls.append(dict(ids=list(prompt_ids), n=n, do_sample=do_sample, seed=seed, stop=stop))
        return [f"The answer is {a}." for a in ([4, 5, 4] if seed == 10 else [7, 8, 8])[:n]]

    monkeypatch.setattr(scoring, "sample_paths", fake_sample_paths)
    recs = [Record(f"p.jsonl:{i}", {"question": q, "answer": a}) for i, (q, a) in enumerate([("2+2?", 4),
                                                                                          ("4+4?", 8)], 1)]
    shot = Record("w.jsonl:1", {"question": "1+1?", "solution": "1 + 1 = 2. The answer is 2."})
    p = FewShotPrompt(PromptTemplate("Q: {question}\nA: {solution}", slot="solution"), shots=[shot],
                      targets=[shot.data["solution"]])
    out = chain_of_thought(model, tok, p, recs, k=3, seed=10, max_new_tokens=16)
    assert [o.result.vote.answer for o in out] == ["4", "8"]
    assert out[0].result.vote.counts == {"4": 2, "5": 1}
    assert [c["seed"] for c in calls] == [10, 11] and all(c["do_sample"] and c["n"] == 3 for c in calls)
    assert calls[0]["stop"] == ["\n\n"]
    want = lead_ids(tok) + tok.encode("Q: 1+1?\nA: 1 + 1 = 2. The answer is 2.\n\n") + tok.encode("Q: 2+2?\nA:")
    assert calls[0]["ids"] == want
    calls.clear()
    greedy = chain_of_thought(model, tok, p, recs[:1], k=1, max_new_tokens=16)
    assert not calls[0]["do_sample"] and greedy[0].result.vote.answer == "7"


# ------------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def cli_files(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("prompt")
    tok_file = tok.save(d / "tok.json")
    pretune.save(_model("tiny-llama", tok), d / "model", tokenizer=tok_file)
    for name, recs in (("train.jsonl", POOL), ("test.jsonl", TEST)):
        (d / name).write_text("".join(json.dumps(r.data) + "\n" for r in recs))
    return d


def test_cli_label_words_smoke(cli_files, capsys):
    d = cli_files
    out = d / "pred.jsonl"
    rc = main(["prompt", str(d / "model"), "--data", str(d / "test.jsonl"), "--template", r"Message: {text}\nSpam?",
               "--labels", "ham=no,spam=yes", "--shots", "2", "--shots-from", str(d / "train.jsonl"), "--balanced",
               "--order-seed", "1", "--calibrate", "--out", str(out), "--json", str(d / "m.json"), "--show-prompt",
               "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "test.jsonl: 3 records, label words, 2 shots (seed 0, order shuffle (order seed 1), balanced)" in text
    assert "accuracy" in text and "macro_f1" in text and "Message: lunch" not in text
    assert "--- prompt of test.jsonl:1 ---\nMessage:" in text and "\nSpam? " in text  # \n became a newline
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == ["spam", "ham", "ham"] and all(r["n_shots"] == 2 for r in rows)
    assert set(rows[0]["scores"]) == set(rows[0]["calibrated"]) == {"ham", "spam"}
    assert "(calibrated, content-free 'N/A', '', '[MASK]')" in text and "(uncalibrated)" in text
    metrics = json.loads((d / "m.json").read_text())["metrics"]
    assert metrics["accuracy"] == sum(r["correct"] for r in rows) / 3
    from sklearn.metrics import roc_auc_score

    margin = [r["scores"]["spam"] - r["scores"]["ham"] for r in rows]
    assert metrics["auc"] == pytest.approx(roc_auc_score([r["label"] == "spam" for r in rows], margin))
    assert "ROC AUC of log p('yes') - log p('no') for 'spam'" in text


def test_cli_random_labels_keep_the_examples_and_show_seeded_random_words(cli_files, capsys):
    d = cli_files
    base = ["prompt", str(d / "model"), "--data", str(d / "test.jsonl"), "--template", r"Message: {text}\nSpam?",
            "--labels", "ham=no,spam=yes", "--shots", "3", "--shots-from", str(d / "train.jsonl"), "--balanced",
            "--seed", "1", "--show-prompt", "--quiet", "--overwrite"]
    assert main([*base, "--json", str(d / "gold.json")]) == 0
    gold = json.loads((d / "gold.json").read_text())["demonstrations"]
    assert all(x["shown"] == x["label"] for x in gold) and len(gold) == 3
    capsys.readouterr()
    assert main([*base, "--random-labels", "--label-seed", "5", "--json", str(d / "random.json")]) == 0
    text = capsys.readouterr().out
    data = json.loads((d / "random.json").read_text())
    demos = data["demonstrations"]
    assert [x["row"] for x in demos] == [x["row"] for x in gold]  # the same examples in the same order
    assert [x["label"] for x in demos] == [x["label"] for x in gold]
    assert [x["shown"] for x in demos] == random_labels(3, ["ham", "spam"], seed=5)
    assert data["settings"]["random_labels"] and data["settings"]["label_seed"] == 5
    right = sum(x["shown"] == x["label"] for x in demos)
    assert f"random labels (label seed 5): shown {', '.join(x['shown'] for x in demos)}" in text
    assert f"({right} of 3 right by chance)" in text
    # the prompt shows the drawn words: each demonstration ends in the word of its shown label
    prompt = text.split("--- end of prompt ---")[0]
    words = {"ham": "no", "spam": "yes"}
    assert [b.rsplit(" ", 1)[-1] for b in prompt.split("\n\n")[:3]] == [words[x["shown"]] for x in demos]
    # without --label-seed the labels are drawn with --seed
    assert main([*base, "--random-labels", "--json", str(d / "random1.json")]) == 0
    shown = [x["shown"] for x in json.loads((d / "random1.json").read_text())["demonstrations"]]
    assert shown == random_labels(3, ["ham", "spam"], seed=1)
    capsys.readouterr()
    for extra, match in ((["--random-labels", "--shots", "0"], "needs label-word mode"),
                         (["--label-seed", "2"], "--label-seed seeds --random-labels")):
        assert main([*base, *extra]) == 2
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["prompt", "--help"])
    help_text = capsys.readouterr().out
    assert "--random-labels" in help_text and "--label-seed" in help_text


def test_cli_errors_and_help(cli_files, capsys):
    d = cli_files
    base = ["prompt", str(d / "model"), "--data", str(d / "test.jsonl"), "--quiet"]
    assert main([*base, "--template", "Answer: {label}", "--labels", "ham=no,spam=yes"]) == 2
    assert "the --template 'Answer: {label}' has no input placeholder" in capsys.readouterr().err
    assert main([*base, "--template", "{review}", "--labels", "ham=no,spam=yes"]) == 2
    assert "uses the placeholder {review}, but the record has no field 'review'" in capsys.readouterr().err
    assert main([*base, "--template", "{text}", "--labels", ""]) == 2
    assert main([*base, "--template", "{text}", "--labels", "a=b,c=d", "--shots", "2"]) == 2
    assert "need --shots-from" in capsys.readouterr().err
    assert main([*base, "--template", "{text}", "--labels", "ham=no,spam=yes", "--max-len", "4"]) == 2
    assert "more than the context window of 4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["prompt", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for opt in ("--template", "--labels", "--verbalizer", "--shots", "--shots-from", "--seed", "--order",
                "--order-seed", "--balanced", "--shot-ids", "--limit", "--out", "--cot", "--self-consistency",
                "--answer-regex", "--chat", "--fit", "--max-len", "--length-norm", "--strategy"):
        assert opt in help_text


def test_cli_cot_self_consistency_with_stub(cli_files, tmp_path, monkeypatch, capsys):
    def fake(model, tok, prompt_ids, *, n, seed, **kw):
        return ["The answer is 4.", "so 5", "The answer is 4."][:n] if seed == 0 else ["The answer is 7."] * n

    monkeypatch.setattr(scoring, "sample_paths", fake)
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n" + json.dumps({"question": "3+3?",
                                                                                          "answer": 6}) + "\n")
    out = tmp_path / "cot.jsonl"
    rc = main(["prompt", str(cli_files / "model"), "--data", str(data), "--cot", "--template", r"Q: {question}\nA:",
               "--self-consistency", "3", "--max-new-tokens", "16", "--out", str(out), "--quiet"])
    assert rc == 0
    assert "accuracy 0.5000" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["votes"] == {"4": 2, "5": 1} and rows[0]["correct"] and not rows[1]["correct"]


# --------------------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_smollm2_cache_equals_rows_and_direct():
    """SmolLM2-135M-Instruct: shared-prefix KV-cache scoring equals full prompt+word rows (and a direct pass)."""
    loaded = pretune.load_pretrained(_smollm2_folder())
    model, tok = loaded.model, loaded.tokenizer
    model.eval()
    v = Verbalizer.parse("ham=not spam,spam=spam")
    p = FewShotPrompt(PromptTemplate("Message: {text}\nSpam or not spam? Answer:"), shots=POOL[:2],
                      targets=["spam", "spam"])
    a = classify(model, tok, p, v, TEST, batch_size=2)
    b = classify(model, tok, p, v, TEST, strategy="rows")
    torch.testing.assert_close(a.scores, b.scores, atol=1e-3, rtol=0)


def test_sample_paths_with_the_decoder(tok):
    """Real decoding (generation.decode) on a tiny model: seeded samples repeat; text is cut at a stop string."""
    model = _model("tiny-llama", tok)
    ids = tok.encode("Q: 2+2?\nA:")
    greedy = scoring.sample_paths(model, tok, ids, max_new_tokens=12)
    assert len(greedy) == 1 and greedy == scoring.sample_paths(model, tok, ids, max_new_tokens=12)
    stop = greedy[0][3:5]
    assert len(stop) == 2
    assert scoring.sample_paths(model, tok, ids, max_new_tokens=12, stop=[stop]) == [greedy[0][:greedy[0].find(stop)]]
    a = scoring.sample_paths(model, tok, ids, n=4, do_sample=True, temperature=1.5, seed=3, max_new_tokens=8)
    assert len(a) == 4 and a == scoring.sample_paths(model, tok, ids, n=4, do_sample=True, temperature=1.5, seed=3,
                                                     max_new_tokens=8)
    assert len(set(a)) > 1  # a random tiny model at temperature 1.5: the samples differ
    with pytest.raises(PromptError, match="temperature"):
        scoring.sample_paths(model, tok, ids, n=2, do_sample=True, temperature=0.0)
