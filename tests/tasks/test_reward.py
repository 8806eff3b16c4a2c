"""Reward models (task reward): TRL's tokenization of pairs, the Bradley-Terry loss (with margins and reward
centring), its logged metrics and gradients equal to TRL's RewardTrainer on a tiny random-weight
LlamaForSequenceClassification (full finetuning, and a peft LoRA with its trained copy of the score head), bad records
named by file, line and field, and a run whose model `pretune convert --to-hf` exports to a transformers model that
scores as pretune does, and whose `pretune predict` writes scores.

The tokenizer and chat template are SmolLM2's (test_dpo's), whose pad token is its EOS: the score is read at the
last token that is not the pad token, as transformers reads it."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from test_dpo import _LORA, CHAT_PAIRS, STRING_PAIRS, TOKENIZER_FILES, _load, _without_pad_row, smollm2_folder

from pretune.data.readers import DataError
from pretune.tasks import TaskConfig, build_task
from pretune.tasks.base import Record

MARGINS = [0.5, 0.0, 1.5]
FORMATS = {"string": [dict(p, margin=m) for p, m in zip(STRING_PAIRS, MARGINS)],
           "conversational": CHAT_PAIRS,
           "no prompt": [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]}
                         for p in STRING_PAIRS]}


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    """{"dir": a random tiny LlamaForSequenceClassification (num_labels=1) with SmolLM2's tokenizer, "hf": the
    transformers model, "hf_tok": the tokenizer}."""
    T = pytest.importorskip("transformers")
    smol = smollm2_folder()
    d = tmp_path_factory.mktemp("reward") / "scorer"
    hf_tok = T.AutoTokenizer.from_pretrained(smol)
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        tie_word_embeddings=True, pad_token_id=hf_tok.pad_token_id, bos_token_id=hf_tok.bos_token_id,
                        eos_token_id=hf_tok.eos_token_id, num_labels=1)
    hf = T.LlamaForSequenceClassification(cfg).eval()
    hf.save_pretrained(d)
    for f in TOKENIZER_FILES:
        shutil.copy(smol / f, d / f)
    return {"dir": d, "hf": hf, "hf_tok": hf_tok}


def _reward(model, tok, **kw):
    return build_task(TaskConfig(name="reward", max_len=kw.pop("max_len", 96), **kw), model.config, tok)


def _batch(task, pairs):
    return task.collate([task.encode(Record(f"pairs.jsonl:{i + 1}", p))[0] for i, p in enumerate(pairs)])


def _trl_reward(scorer, pairs, tmp, *, peft_config=None, **kw):
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(tmp), report_to=[], max_length=96, per_device_train_batch_size=len(pairs),
                        use_cpu=True, bf16=False, dataset_num_proc=None, disable_tqdm=True, **kw)
    tr = RewardTrainer(model=copy.deepcopy(scorer["hf"]), args=args, train_dataset=Dataset.from_list(pairs),
                       processing_class=scorer["hf_tok"], peft_config=peft_config)
    return tr, tr.data_collator([tr.train_dataset[i] for i in range(len(pairs))])


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_pairs_tokenize_as_trl_does(form, scorer, tmp_path):
    pytest.importorskip("trl")
    model, tok = _load(scorer["dir"])
    task = _reward(model, tok)
    tr, _ = _trl_reward(scorer, FORMATS[form], tmp_path)
    for i, pair in enumerate(FORMATS[form]):
        feat = task.encode(Record(f"p:{i + 1}", pair))[0]
        want = tr.train_dataset[i]
        assert (feat["input_ids"].tolist(), feat["rejected_ids"].tolist()) == (want["chosen_ids"], want["rejected_ids"])


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_loss_metrics_and_gradients_equal_trl(form, scorer, tmp_path):
    """RewardTrainer.compute_loss (fp32; margins on the string pairs; reward centring 0.01) against pretune's task:
    the loss, the logged accuracy / margin / mean_reward and every parameter's gradient within 1e-5."""
    pytest.importorskip("trl")
    from pretune.interop import family_of

    tr, trl_batch = _trl_reward(scorer, FORMATS[form], tmp_path, center_rewards_coefficient=0.01)
    tr.model.train()
    tr._metrics["train"].clear()
    want = tr.compute_loss(tr.model, dict(trl_batch))
    want.backward()
    want_stats = {k: v[-1] for k, v in tr._metrics["train"].items()}
    model, tok = _load(scorer["dir"])
    task = _reward(model, tok, center_rewards_coefficient=0.01)
    batch = _batch(task, FORMATS[form])
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"])
    model.train()
    counts = task.counts(batch)
    loss, stats = task.loss(model, batch, {k: float(v) for k, v in counts.items()})
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(want), abs=1e-6)
    for k in ("accuracy", "margin", "mean_reward"):
        assert stats[f"reward:{k}"] / counts["reward"] == pytest.approx(want_stats[k], abs=1e-5), k
    hf_grads = {n: p.grad for n, p in tr.model.named_parameters() if p.grad is not None}
    mapped = _without_pad_row(family_of("llama").weights_from_hf(hf_grads, model.config), model.config)
    grads = _without_pad_row({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, model.config)
    assert set(mapped) == set(grads) and "head.out.weight" in grads
    for n in grads:
        torch.testing.assert_close(grads[n], mapped[n], rtol=1e-4, atol=1e-5, msg=lambda m, k=n: f"{k}: {m}")


def _lora_step(tr, trl_batch, model, task, pairs) -> tuple[dict, dict]:
    """One loss and backward on each side (TRL's trainer, pretune's LoRA model): checks the loss and the logged
    metrics within 1e-5 and returns TRL's and pretune's gradients of the LoRA matrices (keyed (layer, module,
    "A"/"B")) and of the score head ("head")."""
    tr.model.train()
    tr.model.zero_grad()
    tr._metrics["train"].clear()
    want = tr.compute_loss(tr.model, dict(trl_batch))
    want.backward()
    want_stats = {k: v[-1] for k, v in tr._metrics["train"].items()}
    batch = _batch(task, pairs)
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"])
    model.train()
    model.zero_grad()
    counts = task.counts(batch)
    loss, stats = task.loss(model, batch, {k: float(v) for k, v in counts.items()})
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), abs=1e-5)
    for k in ("accuracy", "margin", "mean_reward"):
        assert stats[f"reward:{k}"] / counts["reward"] == pytest.approx(want_stats[k], abs=1e-5), k

    def key(name):
        m = _LORA.search(name)
        return m.groups() if m else "head"

    theirs = {key(n): p.grad for n, p in tr.model.named_parameters() if p.grad is not None}
    ours = {key(n): p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(ours) == set(theirs) and "head" in ours
    return theirs, ours


def _trl_lora_adapter(scorer, pairs, tmp, lora, *, scale_b: float, scale_head: float):
    """RewardTrainer with ``lora`` (task_type SEQ_CLS: peft trains a copy of the score head, modules_to_save), its
    LoRA B moved off 0 and its head copy off the base head, the adapter saved under tmp/adapter."""
    tr, trl_batch = _trl_reward(scorer, pairs, tmp / "trl", peft_config=lora, center_rewards_coefficient=0.01)
    assert "score" in tr.model.peft_config["default"].modules_to_save  # peft adds the SEQ_CLS head's names
    torch.manual_seed(1)
    with torch.no_grad():  # B = 0 at init: move it, and the trained copy of the score head away from the base's
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, scale_b)
            elif "modules_to_save" in n:
                p.add_(torch.randn_like(p) * scale_head)
    tr.model.save_pretrained(tmp / "adapter")
    return tr, trl_batch


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_loss_metrics_and_gradients_equal_trl_with_lora(form, scorer, tmp_path):
    """RewardTrainer with a peft LoRA (task_type SEQ_CLS, so peft trains its own copy of the score head) against
    pretune's reward task with that adapter loaded from peft's files (adapter_model.safetensors holds the head copy
    as score.modules_to_save.default.weight; pretune routes its rows through the adapter's own head): the loss, the
    logged metrics and the gradients of every LoRA matrix and of the head within 1e-5."""
    pytest.importorskip("trl")
    peft_lib = pytest.importorskip("peft")
    from pretune import peft

    lora = peft_lib.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                               task_type="SEQ_CLS")
    tr, trl_batch = _trl_lora_adapter(scorer, FORMATS[form], tmp_path, lora, scale_b=0.05, scale_head=0.2)
    model, tok = _load(scorer["dir"])
    peft.load_adapter(model, tmp_path / "adapter", name="default")
    peft.freeze_for(model, "default")
    torch.testing.assert_close(model.head.adapter_heads["default"].out.weight,
                               tr.model.base_model.model.score.modules_to_save["default"].weight)
    task = _reward(model, tok, center_rewards_coefficient=0.01)
    theirs, ours = _lora_step(tr, trl_batch, model, task, FORMATS[form])
    assert len(ours) == 13  # 2 layers x 3 modules x (A, B) + the head
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-5, msg=str(k))


@pytest.mark.parametrize("record, culprits", [
    ({"prompt": "a", "chosen": " b"}, ["pairs.jsonl:3", "'rejected'"]),
    ({"prompt": "a", "chosen": " ", "rejected": " c"}, ["pairs.jsonl:3", "'chosen'", "empty"]),
    ({"prompt": "a", "chosen": " b", "rejected": " b"}, ["pairs.jsonl:3", "identical"]),
    ({"prompt": "a", "chosen": " b", "rejected": " c", "margin": "big"}, ["pairs.jsonl:3", "'margin'"]),
    ({"prompt": "a", "chosen": " b", "rejected": " c", "margin": float("inf")}, ["pairs.jsonl:3", "'margin'"]),
])
def test_bad_records_name_file_line_and_field(record, culprits, scorer):
    model, tok = _load(scorer["dir"])
    with pytest.raises(DataError) as e:
        _reward(model, tok).encode(Record("pairs.jsonl:3", record))
    for c in culprits:
        assert c in str(e.value), (c, str(e.value))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_run_exports_a_transformers_model_that_scores_as_pretune_and_predicts_scores(scorer, tmp_path):
    """`pretune finetune --task reward` from the tiny LM (the head starts fresh), then `pretune convert --to-hf`:
    transformers' LlamaForSequenceClassification scores every sequence as pretune's task does; `pretune predict`
    writes both scores of a pair and the score of a text or of a prompt + completion."""
    T = pytest.importorskip("transformers")
    from pretune.cli import main

    words = ["ocean", "river", "forest", "mountain", "desert", "valley", "island", "meadow"]
    rows = [{"prompt": f"A word for a place: {words[i % 8]}? Answer:", "chosen": f" {words[i % 8]}",
             "rejected": f" {words[(i + 3) % 8]} or so"} for i in range(16)]
    train, dev = _write(tmp_path / "train.jsonl", rows), _write(tmp_path / "dev.jsonl", rows[:6])
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(scorer["dir"]), "--task", "reward", "--train", str(train), "--dev",
                 str(dev), "--test", str(dev), "--out", str(out), "--batch-size", "4", "--quiet", "--lr", "1e-3",
                 "train.plot=false", "train.tensorboard=false", "train.log_every=1", "tune.epochs=0", "train.steps=3",
                 "task.max_len=48"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["metric"] == "accuracy" and set(results["test"]) == {"loss", "accuracy", "margin"}
    first = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][0]
    for k in ("accuracy", "margin", "mean_reward", "reward_loss", "reward_acc"):
        assert k in first, k
    assert main(["convert", "--to-hf", str(out / "model"), "--out", str(tmp_path / "hf")]) == 0
    hf = T.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    model, tok = _load(out / "model")
    task = _reward(model.eval(), tok)
    batch = _batch(task, rows[:6] + [dict(CHAT_PAIRS[0])])
    with torch.no_grad():
        ours = task.scores(model, batch)
        theirs = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    data = _write(tmp_path / "score.jsonl", [rows[0], {"text": "An ocean."}, {"prompt": "Say:", "completion": " hi"}])
    assert main(["predict", str(out / "model"), str(data), "--out", str(tmp_path / "p.jsonl"), "--quiet"]) == 0
    preds = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert {"score_chosen", "score_rejected", "preferred"} <= set(preds[0]) and set(preds[1]) >= {"score"}
    single = task.collate([task.encode(Record("s:2", {"text": "An ocean."}), labelled=False)[0]])
    with torch.no_grad():
        assert preds[1]["score"] == pytest.approx(float(task.scores(model, single)[0]), abs=1e-5)
    assert "score" in preds[2]

