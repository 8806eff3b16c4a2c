"""task.add_tokens / --add-tokens: new special tokens get rows starting at the mean of the others; full finetuning
trains them and the exported model + tokenizer load in transformers with them; under PEFT only those rows change;
bad values are messages."""

import json

import pytest
import torch

from pretune import load
from pretune.config import ConfigError
from pretune.jobs.finetune import finetune, load_finetune_config, prepare

NEW = ["[START]", "[DELIM]", "[EXTRACT]"]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Prompt/completion records whose prompts use the new tokens."""
    d = tmp_path_factory.mktemp("pairs")
    words = ["house", "garden", "letter", "morning", "walk", "sister", "dinner", "evening"]
    rows = [{"prompt": f"[START] the {a} [DELIM] the {b} [EXTRACT]", "completion": " same" if a == b else " other"}
            for a in words for b in words]
    return {"train": _write(d / "train.jsonl", rows[:48]), "dev": _write(d / "dev.jsonl", rows[48:56]),
            "test": _write(d / "test.jsonl", rows[56:])}


def _cfg(tokenizers_by_kind, data, out, *extra, preset="tiny-gpt2"):
    return load_finetune_config(None, [f"model.preset={preset}", f"tokenizer={tokenizers_by_kind['bpe']}",
                                       "task.name=sft", f"data.train={data['train']}", f"data.dev={data['dev']}",
                                       f"data.test={data['test']}", f"train.out={out}", "train.batch_size=8",
                                       "tune.epochs=0", "train.steps=3", "train.lr=1e-2", "train.plot=false",
                                       "task.max_len=32", "task.add_tokens=" + json.dumps(NEW), *extra])


def _quiet(*a, **k):
    pass


def test_new_rows_start_at_the_mean_and_the_tokens_are_never_split(tokenizers_by_kind, pairs, tmp_path):
    job = prepare(_cfg(tokenizers_by_kind, pairs, tmp_path / "run"), show_progress=False, log=_quiet)
    tok, model = job.tokenizer, job.model
    ids = [tok.token_to_id(t) for t in NEW]
    n_old = min(ids)
    assert ids == list(range(n_old, n_old + 3)) and model.config.vocab_size == n_old + 3
    w = model.transformer.embed.weight
    assert model.head.weight is w  # still tied
    torch.testing.assert_close(w[ids], w[:n_old].mean(0).expand(3, -1))
    assert tok.encode("a[DELIM]b").count(ids[1]) == 1 and set(ids) <= tok.special_ids


def test_full_finetuning_trains_the_new_rows_and_exports_to_transformers(tokenizers_by_kind, pairs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from pretune import to_hf

    res = finetune(_cfg(tokenizers_by_kind, pairs, tmp_path / "run"), show_progress=False, log=_quiet)
    ours = load(res.model_dir)
    hf_dir = to_hf(ours, tmp_path / "hf", tokenizer_dir=res.model_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert hf.config.vocab_size == ours.config.vocab_size
    text = "[START] the house [DELIM] the walk [EXTRACT]"
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    from pretune.io.tokenization import load_tokenizer

    tok = load_tokenizer(res.model_dir)
    assert ids == tok.encode(text) and all(hf_tok.convert_tokens_to_ids(t) == tok.token_to_id(t) for t in NEW)
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, ours.eval()(x).logits, atol=1e-5, rtol=1e-5)
    w = ours.transformer.embed.weight
    new = [tok.token_to_id(t) for t in NEW]
    assert not torch.allclose(w[new[0]], w[new[1]])  # trained apart from their common start


def test_bad_values_are_messages(tokenizers_by_kind, pairs, tmp_path, capsys):
    from pretune.cli import main

    with pytest.raises(ConfigError, match=r"task.add_tokens: '' is not a token"):
        load_finetune_config(None, ["task.name=sft", 'task.add_tokens=["[A]",""]'])
    with pytest.raises(ConfigError, match=r"'\[A\]' is given twice"):
        load_finetune_config(None, ["task.name=sft", 'task.add_tokens=["[A]","[A]"]'])
    with pytest.raises(ConfigError, match=r"was read as a list; quote bracketed tokens"):
        load_finetune_config(None, ["task.name=sft", "task.add_tokens=[[A]]"])
    with pytest.raises(ConfigError, match=r"'the' is already in the tokenizer's vocabulary \(id \d+\)"):
        prepare(_cfg(tokenizers_by_kind, pairs, tmp_path / "run", 'task.add_tokens=["[A]","the"]'),
                show_progress=False, log=_quiet)
    with pytest.raises(ConfigError, match=r"tune.freeze_body=true: the new tokens' rows would stay"):
        prepare(_cfg(tokenizers_by_kind, pairs, tmp_path / "run", "tune.freeze_body=true"), show_progress=False,
                log=_quiet)
    # the flag, and a bad value through the CLI: exit code 2 and the message, no traceback
    args = ["finetune", "--preset", "tiny-gpt2", "--tokenizer", str(tokenizers_by_kind["bpe"]), "--task", "sft",
            "--train", str(pairs["train"]), "--out", str(tmp_path / "cli"), "--quiet", "--print-config"]
    assert main([*args, "--add-tokens", "[START]", "[DELIM]"]) == 0
    assert "- '[START]'" in capsys.readouterr().out
    assert main([*args, "--add-tokens", "[START]", " "]) == 2
    assert "task.add_tokens: ' ' is not a token" in capsys.readouterr().err


@pytest.fixture(scope="module")
def base_dir(tokenizers_by_kind, tmp_path_factory):
    """A tiny GPT-2 saved as a pretune checkpoint (an adapter records its base folder)."""
    import pretune
    from pretune.io.tokenization import Tokenizer

    tok = Tokenizer.load(tokenizers_by_kind["bpe"])
    torch.manual_seed(0)
    model = pretune.build_model("tiny-gpt2", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id or 0)
    return pretune.save(model, tmp_path_factory.mktemp("base") / "base", tokenizer=tok.tk)


def test_under_lora_only_the_new_rows_train_and_peft_loads_the_adapter(tokenizers_by_kind, pairs, base_dir,
                                                                       tmp_path):
    transformers = pytest.importorskip("transformers")
    peft_lib = pytest.importorskip("peft")
    import pretune
    from pretune import to_hf
    from pretune.peft import merged_model

    cfg = _cfg(tokenizers_by_kind, pairs, tmp_path / "run", f"model.init={base_dir}", "model.preset=null",
               "peft.method=lora", "train.lr=5e-2")
    res = finetune(cfg, show_progress=False, log=_quiet)
    base = load(base_dir)
    tuned = pretune.load(res.model_dir)  # the base it recorded, grown to the new tokens, the adapter in place
    meta = json.loads((res.model_dir / "adapter_config.json").read_text())
    n_old = base.config.vocab_size
    assert meta["trainable_token_indices"] == [n_old, n_old + 1, n_old + 2]
    # the base table is frozen bit for bit; only the new rows moved from their start (the mean of the others)
    embed = tuned.transformer.embed
    assert torch.equal(embed.base_layer.weight[:n_old], base.transformer.embed.weight)
    start = base.transformer.embed.weight.mean(0)
    rows = embed.trainable_tokens_delta["default"]
    assert all(not torch.allclose(r, start) for r in rows)
    merged = merged_model(tuned)
    w = merged.transformer.embed.weight
    assert torch.equal(w[:n_old], base.transformer.embed.weight) and torch.equal(w[n_old:], rows.detach())

    # peft: the exported base, resized to the adapter's tokenizer, with the adapter: the same logits
    hf_base = to_hf(base, tmp_path / "hf", tokenizer_dir=base_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(res.model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_base)
    hf.resize_token_embeddings(len(hf_tok))
    hf = peft_lib.PeftModel.from_pretrained(hf, res.model_dir).eval()
    ids = hf_tok("[START] the house [DELIM] the walk [EXTRACT]", add_special_tokens=False)["input_ids"]
    assert n_old + 1 in ids
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs, ours = hf(input_ids=x).logits, tuned.eval()(x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged(x).logits, ours, atol=1e-5, rtol=1e-5)


def test_pretunes_adapter_layout_keeps_the_rows_too(tokenizers_by_kind, pairs, base_dir, tmp_path):
    import pretune

    cfg = _cfg(tokenizers_by_kind, pairs, tmp_path / "run", f"model.init={base_dir}", "model.preset=null",
               "peft.method=ia3", "train.steps=2")
    res = finetune(cfg, show_progress=False, log=_quiet)
    meta = json.loads((res.model_dir / "pretune_adapter.json").read_text())
    assert meta["layout"] == "pretune" and len(meta["new_tokens"]) == 3
    tuned, base = pretune.load(res.model_dir), load(base_dir)
    rows = tuned.transformer.embed.trainable_tokens_delta["default"]
    assert not torch.allclose(rows[0], base.transformer.embed.weight.mean(0))  # trained, and read back
    x = torch.tensor([[5, meta["new_tokens"][1], 9]])
    with torch.no_grad():
        plain = pretune.peft.merged_model(tuned)(x).logits
        torch.testing.assert_close(tuned.eval()(x).logits, plain)


def test_deck_001_gpt_pair_classification_reads_the_extract_token(tokenizers_by_kind, tmp_path):
    """Radford et al. 2018 §3.3 on a bundled pair task: [START] a [DELIM] b [EXTRACT], the head on [EXTRACT]."""
    from pretune import bundled
    from pretune.jobs.finetune import evaluate

    files = bundled.task("wordnet_defines")
    cfg = load_finetune_config(None, [
        "model.preset=tiny-gpt2", f"tokenizer={tokenizers_by_kind['bpe']}", "task.name=pair",
        f"data.train={files['train']}", f"data.dev={files['dev']}", f"data.test={files['test']}",
        "data.train_limit=64", f"train.out={tmp_path / 'run'}", "train.batch_size=16", "tune.epochs=0",
        "train.steps=2", "train.plot=false", "task.max_len=48", "task.add_tokens=" + json.dumps(NEW)])
    job = prepare(cfg, show_progress=False, log=_quiet)
    start, delim, extract = (job.tokenizer.token_to_id(t) for t in NEW)
    ids = list(job.features["train"][0]["input_ids"])
    assert ids[0] == start and ids.count(delim) == 1 and ids[-1] == extract
    assert job.model.config.sentence_pooling == "last"  # the head reads the last (unpadded) token: [EXTRACT]
    res = finetune(cfg, show_progress=False, log=_quiet)
    again = evaluate(res.model_dir, files["test"], show_progress=False)  # the saved tokenizer lays it out alike
    assert again["accuracy"] == pytest.approx(res.test["accuracy"])


def test_an_untied_head_grows_its_own_mean_rows_and_peft_refuses_it(tokenizers_by_kind):
    import pretune
    from pretune import peft
    from pretune.io.new_tokens import add_special_tokens
    from pretune.io.tokenization import Tokenizer

    tok = Tokenizer.load(tokenizers_by_kind["bpe"])
    torch.manual_seed(0)
    model = pretune.build_model("tiny-llama", vocab_size=tok.vocab_size, tie_embeddings=False)
    head0, embed0 = model.head.weight.detach().clone(), model.transformer.embed.weight.detach().clone()
    tok2, ids = add_special_tokens(model, tok, ["<|im_start|>", "<|im_end|>"], log=_quiet)
    assert tok.token_to_id("<|im_end|>") is None and tok2.token_to_id("<|im_end|>") == ids[1]  # a new tokenizer
    assert model.head.weight is not model.transformer.embed.weight
    for w, w0 in ((model.head.weight, head0), (model.transformer.embed.weight, embed0)):
        assert torch.equal(w[: len(w0)], w0)
        torch.testing.assert_close(w[ids], w0.mean(0).expand(2, -1))
    assert model(torch.tensor([[3, ids[0], ids[1]]])).logits.shape[-1] == tok2.vocab_size
    peft.inject(model, peft.PeftConfig(method="lora"))
    from pretune.peft.new_tokens import train_new_tokens

    with pytest.raises(ConfigError, match="need the LM head tied to the token embedding"):
        train_new_tokens(model, "default", ids)
    assert type(model.transformer.embed) is torch.nn.Embedding  # left as it was


CHATML = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """Chats (messages) for SFT on a base model that learns ChatML's tokens."""
    d = tmp_path_factory.mktemp("chats")
    words = ["house", "garden", "letter", "morning", "walk", "sister"]
    rows = [{"messages": [{"role": "user", "content": f"the {a} or the {b}?"},
                          {"role": "assistant", "content": "same" if a == b else "other"}]}
            for a in words for b in words]
    return {"train": _write(d / "train.jsonl", rows[:32]), "dev": _write(d / "dev.jsonl", rows[32:])}


def _chat_cfg(tokenizers_by_kind, data, out, *extra):
    return load_finetune_config(None, [f"tokenizer={tokenizers_by_kind['bpe']}", "task.name=sft",
                                       f"data.train={data['train']}", f"data.dev={data['dev']}", f"train.out={out}",
                                       "train.batch_size=8", "tune.epochs=0", "train.steps=3", "train.lr=1e-2",
                                       "train.plot=false", "task.max_len=32", "task.max_target_len=4",
                                       "task.chat_template=chatml", *extra])


def test_sft_on_a_base_model_learns_new_chat_tokens_and_exports_them(tokenizers_by_kind, chats, tmp_path):
    """task.add_tokens=<|im_start|>,<|im_end|> with task.chat_template=chatml: the chats render with each token one
    id, the assistant's <|im_end|> is learnt (never <|im_start|>), generation stops at it, the rows train, and the
    model folder loads in transformers with the tokens and the template: apply_chat_template gives pretune's ids, the
    model pretune's logits."""
    transformers = pytest.importorskip("transformers")
    from pretune import to_hf
    from pretune.io.tokenization import load_tokenizer
    from pretune.model.layout import IGNORE
    from pretune.tasks import TaskConfig, build_task
    from pretune.tasks.base import Record
    from pretune.tasks.sft import CHATML_TEMPLATE

    res = finetune(_chat_cfg(tokenizers_by_kind, chats, tmp_path / "run", "model.preset=tiny-gpt2",
                             "task.add_tokens=" + json.dumps(CHATML)), show_progress=False, log=_quiet)
    ours, tok = load(res.model_dir).eval(), load_tokenizer(res.model_dir)
    assert tok.chat_template == CHATML_TEMPLATE  # kept in the folder (chat_template.jinja)
    start, end = (tok.token_to_id(t) for t in CHATML)
    msgs = json.loads(chats["dev"].read_text().splitlines()[0])["messages"]
    task = build_task(TaskConfig(name="sft", max_len=32), ours.config, tok)
    feat = task.encode(Record("dev:1", {"messages": msgs}))[0]
    ids, labels = list(feat["input_ids"]), list(feat["labels"])
    assert ids.count(start) == 2 and ids.count(end) == 2  # a user and an assistant turn, each marker one id
    learnt = [i for i, lab in zip(ids, labels) if lab != IGNORE]
    assert end in learnt and start not in learnt and learnt[-2] == end  # "...other<|im_end|>\n"
    assert end in task.stop_ids

    hf_dir = to_hf(ours, tmp_path / "hf", tokenizer_dir=res.model_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert hf_tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"] == ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(input_ids=x).logits, ours(x).logits, atol=1e-5, rtol=1e-5)
    w = ours.transformer.embed.weight
    assert not torch.allclose(w[start], w[end])  # trained apart from their common start (the mean of the others)


def test_sft_chat_tokens_under_lora_train_only_their_rows(tokenizers_by_kind, chats, base_dir, tmp_path):
    import pretune

    res = finetune(_chat_cfg(tokenizers_by_kind, chats, tmp_path / "run", f"model.init={base_dir}",
                             "peft.method=lora", "train.lr=5e-2", "task.add_tokens=" + json.dumps(CHATML)),
                   show_progress=False, log=_quiet)
    base, tuned = load(base_dir), pretune.load(res.model_dir)
    n_old = base.config.vocab_size
    embed = tuned.transformer.embed
    assert torch.equal(embed.base_layer.weight[:n_old], base.transformer.embed.weight)  # the table: bit for bit
    start = base.transformer.embed.weight.mean(0)
    assert all(not torch.allclose(r, start) for r in embed.trainable_tokens_delta["default"])  # both rows moved


def test_chatml_without_its_tokens_is_a_message(tokenizers_by_kind, chats, tmp_path):
    with pytest.raises(ConfigError, match=r"task.chat_template=chatml writes <\|im_start\|>, <\|im_end\|>.*"
                                          r"task.add_tokens"):
        prepare(_chat_cfg(tokenizers_by_kind, chats, tmp_path / "run", "model.preset=tiny-gpt2"),
                show_progress=False, log=_quiet)
