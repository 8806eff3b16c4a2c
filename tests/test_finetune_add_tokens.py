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
    # the flag, and a bad value through the CLI: exit code 2 and the message, no traceback
    args = ["finetune", "--preset", "tiny-gpt2", "--tokenizer", str(tokenizers_by_kind["bpe"]), "--task", "sft",
            "--train", str(pairs["train"]), "--out", str(tmp_path / "cli"), "--quiet", "--print-config"]
    assert main([*args, "--add-tokens", "[START]", "[DELIM]"]) == 0
    assert "- '[START]'" in capsys.readouterr().out
    assert main([*args, "--add-tokens", "[START]", " "]) == 2
    assert "task.add_tokens: ' ' is not a token" in capsys.readouterr().err
