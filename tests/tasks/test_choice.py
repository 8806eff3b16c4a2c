"""The choice task (T-Few): choice scores and the three losses equal a direct computation from the
model's log-probabilities; it trains; it works with (IA)3."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import pretune
from conftest import corpus_paragraphs
from pretune.config import ConfigError
from pretune.io.tokenization import Tokenizer
from pretune.jobs.finetune import evaluate, finetune, load_finetune_config
from pretune.tasks import TaskConfig, build_task
from pretune.tasks.base import Record

RECORDS = [Record("r:1", {"text": "the film was a delight", "label": "pos"}),
           Record("r:2", {"text": "dull and far too long", "label": "neg"}),
           Record("r:3", {"text": "a fine cast", "label": "pos"})]


def _setup(tokenizers_by_kind, arch, layout="auto"):
    kind, preset = ("bpe", "tiny-gpt2") if arch == "decoder" else ("unigram", "tiny-t5-small")
    tok = Tokenizer.load(tokenizers_by_kind[kind])
    torch.manual_seed(0)
    model = pretune.build_model(preset, vocab_size=tok.vocab_size, head="lm", dropout=0.0, attn_dropout=0.0,
                                pad_token_id=tok.pad_id or 0).eval()
    cfg = TaskConfig(name="choice", labels=["neg", "pos"], choices=["terrible movie", "great"], layout=layout)
    return model, tok, build_task(cfg, model.config, tok)


def _direct_logprobs(model, task, source: list[int], choice: list[int]) -> torch.Tensor:
    """log p(choice_t | source, choice_<t) from one plain forward pass per (input, choice); a decoder reads the
    source causally, or (prefix LM) bidirectionally."""
    if model.config.arch == "decoder":
        ids = torch.tensor([source + choice])
        prefix = torch.tensor([len(source)]) if task.layout.name == "prefix_lm" else None
        logits = model(ids, prefix_lengths=prefix).logits[0]
        steps = logits[len(source) - 1: len(source) - 1 + len(choice)]
    else:
        dec = torch.tensor([[model.config.decoder_start_token_id] + choice[:-1]])
        steps = model(torch.tensor([source]), decoder_input_ids=dec).logits[0]
    return steps.log_softmax(-1)[torch.arange(len(choice)), torch.tensor(choice)]


@pytest.mark.parametrize("arch,layout", [("decoder", "causal"), ("decoder", "prefix_lm"), ("encoder-decoder", "auto")])
def test_scores_and_tfew_losses_equal_a_direct_computation(tokenizers_by_kind, arch, layout):
    model, tok, task = _setup(tokenizers_by_kind, arch, layout)
    feats = [f for r in RECORDS for f in task.encode(r)]
    batch = task.collate(feats)
    lm = ul = ln = 0.0
    scores = []
    with torch.no_grad():
        for f in feats:
            src = f["input_ids"].tolist()
            per = [_direct_logprobs(model, task, src, [t for t in row.tolist() if t != -100])
                   for row in task.choice_ids]
            beta = torch.stack([lp.mean() for lp in per])  # length-normalised log-likelihood of each choice
            scores.append(beta)
            y = int(f["labels"])
            lm += -beta[y]
            wrong = [lp for c, lp in enumerate(per) if c != y]
            ul += -sum(torch.log1p(-lp.exp()).sum() for lp in wrong) / sum(len(lp) for lp in wrong)
            ln += -beta.log_softmax(0)[y]
        loss, stats = task.loss(model, batch, {"task": len(feats)})
        out = task.outputs(model, batch)
    assert torch.allclose(torch.from_numpy(np.stack(out)), torch.stack(scores), atol=1e-5)
    assert stats["task_lm_loss"] == pytest.approx(float(lm), abs=1e-4)
    assert stats["task_ul_loss"] == pytest.approx(float(ul), abs=1e-4)
    assert stats["task_ln_loss"] == pytest.approx(float(ln), abs=1e-4)
    assert float(loss) == pytest.approx(float(lm + ul + ln) / len(feats), abs=1e-5)


def test_bad_choice_settings(tokenizers_by_kind):
    model, tok, _ = _setup(tokenizers_by_kind, "decoder")
    with pytest.raises(ConfigError, match="give one answer text per label"):
        build_task(TaskConfig(name="choice", labels=["a", "b"], choices=["x"]), model.config, tok)
    with pytest.raises(ConfigError, match="choice_loss='both'"):
        build_task(TaskConfig(name="choice", labels=["a", "b"], choice_loss="both"), model.config, tok)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_choice_task_trains_with_ia3_on_a_pretrained_decoder(tokenizers_by_kind, tmp_path):
    """(IA)3 + T-Few losses on a decoder first trained (fully) on the same rule: the run saves an adapter
    whose evaluation reproduces the run's test score; the label set lives in task.json."""
    sents = []
    for p in corpus_paragraphs("austen.txt.gz", 150):
        sents += [s.strip() + "." for s in p.replace("\n", " ").split(".") if len(s.split()) >= 4]
    rows = [{"text": s, "label": "long" if len(s.split()) > 14 else "short"} for s in sents[:200]]
    tr, dv, te = (_write(tmp_path / f"{n}.jsonl", r) for n, r in
                  (("train", rows[:140]), ("dev", rows[140:170]), ("test", rows[170:200])))
    common = ["task.name=choice", f"data.train={tr}", f"data.dev={dv}", f"data.test={te}", "train.batch_size=16",
              "train.plot=false", "train.keep_last=0", "task.max_len=64"]
    full = finetune(load_finetune_config(None, common + [
        "model.preset=tiny-gpt2", f"tokenizer={tokenizers_by_kind['bpe']}", f"train.out={tmp_path / 'full'}",
        "train.lr=3e-3", "tune.epochs=3"]), show_progress=False, log=lambda *a: None)
    task = json.loads((full.model_dir / "task.json").read_text())
    assert task["labels"] == ["long", "short"]
    assert full.test["accuracy"] >= 0.6
    ia3 = finetune(load_finetune_config(None, common + [
        f"model.init={full.model_dir}", f"train.out={tmp_path / 'ia3'}", "train.lr=1e-2", "tune.epochs=1",
        "peft.method=ia3"]), show_progress=False, log=lambda *a: None)
    assert json.loads((ia3.run_dir / "results.json").read_text())["peft"]["trainable"] < 2000
    again = evaluate(ia3.model_dir, te, show_progress=False)
    assert again["accuracy"] == pytest.approx(ia3.test["accuracy"])


def test_head_lr_is_refused_for_the_lm_head_of_the_choice_task(tokenizers_by_kind, tmp_path):
    rows = [{"text": f"sentence number {i} here", "label": "long" if i % 2 else "short"} for i in range(12)]
    tr = _write(tmp_path / "train.jsonl", rows)
    cfg = load_finetune_config(None, ["task.name=choice", f"data.train={tr}", "model.preset=tiny-gpt2",
                                      f"tokenizer={tokenizers_by_kind['bpe']}", f"train.out={tmp_path / 'run'}",
                                      "tune.head_lr=1e-2", "train.plot=false"])
    with pytest.raises(ConfigError, match="tune.head_lr applies to a task head.*'lm' head"):
        finetune(cfg, show_progress=False, log=lambda *a: None)
