"""Supervised finetuning (task sft): record formats, chat templates token-identical to transformers, completion-only
labels, loss parity with transformers on SmolLM2, packing equal to one example at a time, and it learns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_tasks import first_word_records, run, sentences, write_splits  # noqa: F401 (fixture)

from pretune.data.readers import DataError
from pretune.io.tokenization import Tokenizer
from pretune.model import TransformerLM
from pretune.model.layout import IGNORE
from pretune.presets import get_preset
from pretune.tasks import TaskConfig, build_task
from pretune.tasks.base import Record

CHAT = [{"role": "system", "content": "You classify text messages."},
        {"role": "user", "content": "Is this spam? WINNER!! Claim your free prize now, call 0800 123 456"},
        {"role": "assistant", "content": "spam"},
        {"role": "user", "content": "And this one? ok see you at 5 then"},
        {"role": "assistant", "content": "ham, it is a friend's message"}]

# Qwen2.5's template, shortened (no tools): a default system message when none is given
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def smollm2_folder() -> Path:
    from pretune import realmodels

    try:
        return realmodels.smollm2_dir()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smol():
    from pretune.loading import load_pretrained

    loaded = load_pretrained(smollm2_folder())
    return loaded.model.eval(), loaded.tokenizer


def sft(model_cfg, tok, **kw):
    return build_task(TaskConfig(name="sft", max_len=kw.pop("max_len", 256), **kw), model_cfg, tok)


def labelled_text(tok, feat) -> str:
    return tok.decode([i for i, lab in zip(feat["input_ids"], feat["labels"]) if lab != IGNORE])


# ------------------------------------------------------------------------------------------ chat rendering
@pytest.mark.parametrize("template", ["smollm2", "qwen"])
def test_chat_rendering_is_token_identical_to_apply_chat_template(template, smol, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = smollm2_folder()
    if template == "qwen":  # the same vocabulary with a Qwen-style template written here
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(folder / f, tmp_path / f)
        (tmp_path / "chat_template.jinja").write_text(QWEN_TEMPLATE, encoding="utf-8")
        folder = tmp_path
    tok = Tokenizer.load(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    task = sft(smol[0].config, tok)
    for msgs in (CHAT, CHAT[1:], CHAT[1:3]):
        feat = task.encode(Record("c:1", {"messages": msgs}))[0]
        want = hf.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
        assert feat["input_ids"].tolist() == list(want)
        # the prompt is the rendering up to the last assistant turn, with the generation prompt
        head = hf.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True, return_dict=True)
        assert feat["input_ids"][: feat["prompt_len"]].tolist() == list(head["input_ids"])
    if template == "qwen":
        assert "You are Qwen" in tok.decode(task.encode(Record("c:1", {"messages": CHAT[1:3]}))[0]["input_ids"])


def test_loss_falls_on_assistant_turns_only(smol):
    model, tok = smol
    feat = sft(model.config, tok).encode(Record("c:1", {"messages": CHAT}))[0]
    assert labelled_text(tok, feat) == "spam<|im_end|>\nham, it is a friend's message<|im_end|>\n"
    last = sft(model.config, tok, assistant_turns="last").encode(Record("c:1", {"messages": CHAT}))[0]
    assert labelled_text(tok, last) == "ham, it is a friend's message<|im_end|>\n"
    assert last["input_ids"].tolist() == feat["input_ids"].tolist()


def test_prompt_completion_and_text_formats(smol):
    model, tok = smol
    task = sft(model.config, tok)
    rec = Record("p:1", {"prompt": "word for: a large body of salt water\nword:", "completion": " ocean"})
    pc = task.encode(rec)[0]
    assert labelled_text(tok, pc) == " ocean<|im_end|>"  # EOS (SmolLM2-Instruct's is <|im_end|>) is learned too
    assert tok.decode(pc["input_ids"][: pc["prompt_len"]]) == "word for: a large body of salt water\nword:"
    assert task.truncated == 0
    short = sft(model.config, tok, max_len=16, max_target_len=3)
    short.encode(Record("p:2", {"prompt": "a " * 40, "completion": " one two three four"}))
    assert short.truncated == 1
    text = task.encode(Record("t:1", {"text": "The sea is wide."}))[0]
    assert (text["labels"] == text["input_ids"]).all() and text["prompt_len"] == 0
    # conversational prompt/completion (TRL's form) = a chat whose completion turns are learned
    conv = task.encode(Record("v:1", {"prompt": CHAT[:2], "completion": CHAT[2:3]}))[0]
    chat = task.encode(Record("c:1", {"messages": CHAT[:3]}))[0]
    assert conv["input_ids"].tolist() == chat["input_ids"].tolist()
    assert conv["labels"].tolist() == chat["labels"].tolist()
    # task.chat: strings become a user and an assistant turn; task.prompt_template builds the prompt from fields
    tmpl = sft(model.config, tok, chat=True, prompt_template="Is this spam? {text}", completion_field="label")
    f = tmpl.encode(Record("s:1", {"text": "hi there", "label": "ham"}))[0]
    assert labelled_text(tok, f) == "ham<|im_end|>\n"
    assert "<|im_start|>user\nIs this spam? hi there<|im_end|>" in tok.decode(f["input_ids"])
    assert tmpl.reference(Record("s:1", {"text": "hi there", "label": "ham"})) == "ham"
    typed = sft(model.config, tok, prompt_template="Message: {text}\\nAnswer:")  # a "\n" from a command line
    assert typed._prompt_text(Record("s:1", {"text": "hi"})) == "Message: hi\nAnswer:"


def test_bad_records_name_the_row(smol):
    model, tok = smol
    task = sft(model.config, tok)
    with pytest.raises(DataError, match=r"d\.jsonl:3: an SFT record needs 'prompt' and 'completion'.*has: label"):
        task.encode(Record("d.jsonl:3", {"label": "x"}))
    with pytest.raises(DataError, match=r"d\.jsonl:4: message 1 is"):
        task.encode(Record("d.jsonl:4", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}))
    with pytest.raises(DataError, match="no assistant turn"):
        task.encode(Record("d.jsonl:5", {"messages": [{"role": "user", "content": "a"}]}))


def test_default_chat_template_for_a_tokenizer_without_one(tokenizers_by_kind):
    tok = Tokenizer.load(tokenizers_by_kind["bpe"])
    assert tok.chat_template is None
    cfg = get_preset("tiny-llama", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id)
    feat = sft(cfg, tok).encode(Record("c:1", {"messages": CHAT[1:3]}))[0]
    eos = tok.roles["eos"]
    assert labelled_text(tok, feat).replace(" ", "") == f"spam{eos}\n".replace(" ", "")
    assert tok.decode(feat["input_ids"][: feat["prompt_len"]]).replace(" ", "").endswith("Assistant:")


# --------------------------------------------------------------------------------------------- loss parity
def test_sft_loss_equals_transformers_on_smollm2(smol):
    transformers = pytest.importorskip("transformers")
    model, tok = smol
    task = sft(model.config, tok)
    recs = [Record("c:1", {"messages": CHAT}),
            Record("p:1", {"prompt": "word for: a large body of salt water\nword:", "completion": " ocean"}),
            Record("p:2", {"prompt": "Translate to French: cat\nFrench:", "completion": " chat"})]
    batch = task.collate([task.encode(r)[0] for r in recs])
    counts = task.counts(batch)
    with torch.no_grad():
        loss, _ = task.loss(model, batch, {k: float(v) for k, v in counts.items()})
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    assert float(loss) == pytest.approx(float(ref), abs=1e-4)


# ------------------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_packed_rows_give_the_losses_and_gradients_of_single_examples(preset, tokenizers_by_kind):
    tok = Tokenizer.load(tokenizers_by_kind["bpe"])
    cfg = get_preset(preset, vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, dropout=0.0, attn_dropout=0.0)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    task = sft(cfg, tok, max_len=64)
    recs = [Record("p:1", {"prompt": "Emma was", "completion": " very happy with the visit."}),
            Record("p:2", {"text": "Mr. Knightley said nothing."}),
            Record("c:1", {"messages": CHAT[1:3]}),
            Record("p:3", {"prompt": "Yes", "completion": " indeed"})]
    feats = [task.encode(r)[0] for r in recs]
    packed = task.pack(feats, 64)
    assert len(packed) < len(feats) and all(len(p["input_ids"]) <= 64 for p in packed)

    def loss_and_grads(batches):
        model.zero_grad()
        total = 0.0
        for b in batches:
            s, _ = task.loss(model, b, {"lm": 1.0})  # the summed loss of every completion token
            s.backward()
            total += float(s)
        return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    single, g1 = loss_and_grads([task.collate([f]) for f in feats])
    both, g2 = loss_and_grads([task.collate(packed)])  # packed rows, padded to one batch
    assert sum(task.counts(task.collate([f]))["lm"] for f in feats) == task.counts(task.collate(packed))["lm"]
    assert both == pytest.approx(single, rel=1e-5)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-5, atol=1e-5)


def test_packing_is_refused_where_it_cannot_work(tmp_path, tokenizers_by_kind):
    from pretune.config import ConfigError
    from pretune.jobs.finetune import load_finetune_config, prepare

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"sentence {i}", "label": "a" if i % 2 else "b"}) + "\n"
                            for i in range(20)))
    base = ["model.preset=tiny-gpt2", f"tokenizer={tokenizers_by_kind['bpe']}", f"data.train={data}",
            f"train.out={tmp_path / 'r'}", "data.packing=true"]
    with pytest.raises(ConfigError, match="packs training examples of task sft"):
        prepare(load_finetune_config(None, [*base, "task.name=classification"]), show_progress=False, log=print)
    from pretune.io.checkpoint import save

    tok = Tokenizer.load(tokenizers_by_kind["bpe"])
    init = save(TransformerLM(get_preset("tiny-gpt2", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id)),
                tmp_path / "init", tokenizer=tok)
    base[0] = f"model.init={init}"
    with pytest.raises(ConfigError, match="cannot be used with --peft prompt"):
        prepare(load_finetune_config(None, [*base, "task.name=sft", "peft.method=prompt"]), show_progress=False,
                log=print)


# ----------------------------------------------------------------------------------------------- it learns
def instruction_records(sentences, chat: bool) -> list[dict]:  # noqa: F811
    out = []
    for r in first_word_records(sentences):
        if chat:
            out.append({"messages": [{"role": "user", "content": f"First word of: {r['source']}"},
                                     {"role": "assistant", "content": r["target"]}]})
        else:
            out.append({"prompt": f"{r['source']}\nFirst word:", "completion": f" {r['target']}"})
    return out


@pytest.mark.parametrize("form", ["prompt", "chat+packing"])
def test_sft_trains(form, tmp_path, sentences, tokenizers_by_kind):  # noqa: F811
    records = instruction_records(sentences, chat=form != "prompt")
    files = write_splits(tmp_path, records, 600, 100, 200)
    # about 2.7 examples per packed row: a batch of 6 rows holds the tokens of 16 examples
    extra = ("data.packing=true", "task.max_len=128", "train.batch_size=6") if "packing" in form else ()
    result, preds = run(tmp_path, "sft", "tiny-gpt2", tokenizers_by_kind["bpe"], files, "tune.epochs=8",
                        "train.lr=5e-3", "task.max_target_len=8", "train.eval_every=125", *extra)
    # the k most frequent first words are label words: accuracy and macro-F1 are reported with the text metrics
    assert {"exact_match_text", "rouge_l", "bleu", "perplexity", "accuracy", "macro_f1"} <= set(result.test)
    assert result.test["exact_match_text"] >= 0.6, result.test
    assert result.test["accuracy"] == result.test["exact_match_text"]
    assert all(p["prediction"] == p["prediction"].strip() for p in preds)
    if form == "prompt":
        assert all(p["prompt"] == r["prompt"] for p, r in zip(preds, records[700:900]))


def test_a_finetuned_chat_model_keeps_its_template_and_end_of_turn(tmp_path, smol):
    model, tok = smol
    from pretune.io.checkpoint import save

    save(model, tmp_path / "m", tokenizer=tok)
    again = Tokenizer.load(tmp_path / "m")
    assert again.chat_template == tok.chat_template and again.eos_id == tok.eos_id == tok.token_to_id("<|im_end|>")
    assert (tmp_path / "m" / "chat_template.jinja").is_file()


def test_generation_stops_at_end_of_turn_and_matches_greedy(smol):
    model, tok = smol
    task = sft(model.config, tok, max_target_len=12)
    recs = [Record("c:1", {"messages": [{"role": "user", "content": "What is the capital of France?"},
                                        {"role": "assistant", "content": "Paris"}]}),
            Record("c:2", {"messages": [{"role": "user", "content": "Say hello."},
                                        {"role": "assistant", "content": "Hello"}]})]
    feats = [task.encode(r, labelled=False)[0] for r in recs]
    outs = task.outputs(model, task.collate(feats))
    for f, out in zip(feats, outs):  # batched, left-padded, cached = greedy one at a time without a cache
        ids = f["input_ids"].tolist()
        want = []
        with torch.no_grad():
            for _ in range(12):
                nxt = int(model(torch.tensor([ids + want])).logits[0, -1].argmax())
                if nxt in task.stop_ids:
                    break
                want.append(nxt)
        assert out == want
    assert "Paris" in task.predict(recs, feats, outs)[0]
    assert np.all([t not in task.stop_ids for out in outs for t in out])
