"""Preference tuning on unpaired feedback (task kto): TRL's tokenization and mismatched KL rows, loss, rewards, KL and
gradients equal to TRL's KTOTrainer on a tiny random-weight Llama (full finetuning and LoRA), bad records named by
file, line and field, and a run through ``pretune finetune``.

The model and tokenizer are test_dpo's (a transformers LlamaForCausalLM, dim 32, 2 layers, SmolLM2's tokenizer and
chat template)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import test_dpo
import torch
from test_dpo import _LORA, _frozen, _load, _without_pad_row

from pretune.data.readers import DataError
from pretune.tasks import TaskConfig, build_task
from pretune.tasks.base import Record

STRING_RECORDS = [{"prompt": "The capital of France is", "completion": " Paris.", "label": True},
                  {"prompt": "2 + 2 =", "completion": " 5, or maybe 22", "label": False},
                  {"prompt": "Name a colour:", "completion": " blue", "label": True},
                  {"prompt": "The sky at noon is", "completion": " made of cheese, I think.", "label": False}]
CHAT_RECORDS = [{"prompt": [{"role": "user", "content": "What is the capital of France?"}],
                 "completion": [{"role": "assistant", "content": "Paris."}], "label": True},
                {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2 + 2?"}],
                 "completion": [{"role": "assistant", "content": "5, or maybe 22"}], "label": False},
                {"prompt": [{"role": "user", "content": "Name a colour."}],
                 "completion": [{"role": "assistant", "content": "Seven."}], "label": False}]
FORMATS = {"string": STRING_RECORDS, "conversational": CHAT_RECORDS}
tiny = test_dpo.tiny  # the shared fixture: the tiny Llama folders and transformers models, built once per module
TRL_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


def _kto(model, tok, **kw):
    return build_task(TaskConfig(name="kto", max_len=kw.pop("max_len", 96), **kw), model.config, tok)


def _batch(task, records):
    return task.collate([task.encode(Record(f"feedback.jsonl:{i + 1}", r))[0] for i, r in enumerate(records)])


def _trl_kto(tiny, records, tmp, *, model, ref_model=None, peft_config=None, **kw):
    """TRL's KTOTrainer over ``records`` in one batch (fp32: TRL's configs default to bf16 autocast)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=str(tmp), report_to=[], beta=0.1, max_length=96,
                     per_device_train_batch_size=len(records), use_cpu=True, bf16=False, dataset_num_proc=None,
                     disable_tqdm=True, **kw)
    tr = KTOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(records),
                    processing_class=tiny["hf_tok"], peft_config=peft_config)
    batch = tr.data_collator([tr.train_dataset[i] for i in range(len(records))])
    return tr, batch


def _trl_step(tr, batch) -> tuple[float, dict, dict]:
    tr._metrics["train"].clear()
    tr.model.train()
    tr.model.zero_grad()
    loss = tr.compute_loss(tr.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    return float(loss.detach()), {k: v[-1] for k, v in tr._metrics["train"].items()}, grads


def _our_step(task, model, batch) -> tuple[float, dict, dict]:
    """One loss and backward as the training loop runs it, the logged means as the loop computes them."""
    model.train()
    model.zero_grad()
    counts = task.counts(batch)
    totals = {k: max(float(v), 1.0) for k, v in counts.items()}
    loss, stats = task.loss(model, batch, totals)
    loss.backward()
    means = {k.partition(":")[2]: v / totals[k.partition(":")[0]] for k, v in stats.items() if ":" in k}
    return float(loss.detach()), means, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_stats(ours: dict, trl: dict):
    for k in TRL_KEYS:
        assert ours[k] == pytest.approx(trl[k], abs=1e-5), (k, ours[k], trl[k])


# ----------------------------------------------------------------------------------------------- data formats
@pytest.mark.parametrize("form", sorted(FORMATS))
def test_records_and_mismatched_rows_tokenize_as_trl_does(form, tiny, tmp_path):
    """Each record's prompt and completion ids equal TRL's dataset's, and the batch (the records' rows, then the
    mismatched KL rows: prompt i with completion i-1) equals TRL's collated input_ids / KL_input_ids."""
    pytest.importorskip("trl")
    model, tok = _load(tiny["ref"])
    task = _kto(model, tok)
    recs = FORMATS[form]
    tr, trl_batch = _trl_kto(tiny, recs, tmp_path, model=copy.deepcopy(tiny["hf_policy"]),
                             ref_model=copy.deepcopy(tiny["hf_ref"]))
    for i, r in enumerate(recs):
        want = tr.train_dataset[i]
        assert task.completion_ids(Record(f"f:{i + 1}", r)) == (want["prompt_ids"], want["completion_ids"])
    batch = _batch(task, recs)
    n = len(recs)
    for ours, theirs, mask in (("input_ids", "input_ids", "attention_mask"),
                               ("input_ids", "KL_input_ids", "KL_attention_mask")):
        rows = batch[ours][:n] if theirs == "input_ids" else batch[ours][n:]
        ours_mask = batch["attention_mask"][:n] if theirs == "input_ids" else batch["attention_mask"][n:]
        assert torch.equal(rows[ours_mask == 1], trl_batch[theirs][trl_batch[mask] == 1]), theirs
    assert batch["label"].tolist() == [r["label"] for r in recs]


@pytest.mark.parametrize("record, culprits", [
    ({"prompt": "a", "completion": " b"}, ["feedback.jsonl:3", "'label'"]),
    ({"prompt": "a", "label": True}, ["feedback.jsonl:3", "'completion'"]),
    ({"prompt": "a", "completion": "  ", "label": True}, ["feedback.jsonl:3", "'completion'", "empty"]),
    ({"prompt": "a", "completion": " b", "label": 1}, ["feedback.jsonl:3", "'label'", "bool"]),
    ({"prompt": "a", "completion": " b", "label": "yes"}, ["feedback.jsonl:3", "'label'", "boolean"]),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "b"}], "label": True},
     ["feedback.jsonl:3", "'completion'", "message 0"]),
    ({"prompt": "word " * 200, "completion": " b", "label": False},
     ["feedback.jsonl:3", "'prompt'", "task.max_len=96"]),
])
def test_bad_records_name_file_line_and_field(record, culprits, tiny):
    model, tok = _load(tiny["ref"])
    with pytest.raises(DataError) as e:
        _kto(model, tok).encode(Record("feedback.jsonl:3", record))
    for c in culprits:
        assert c in str(e.value), (c, str(e.value))


def test_a_csv_cell_may_say_true_or_false(tiny):
    model, tok = _load(tiny["ref"])
    task = _kto(model, tok)
    assert task.label_of(Record("f.csv:2", {"label": "True"})) is True
    assert task.label_of(Record("f.csv:3", {"label": "false"})) is False


# ----------------------------------------------------------------------------------------- parity with TRL
@pytest.mark.parametrize("form", sorted(FORMATS))
def test_loss_rewards_kl_and_gradients_equal_trl_full_finetuning(form, tiny, tmp_path):
    """KTOTrainer itself (a frozen reference model, fp32, desirable_weight 1.3, undesirable_weight 0.7) against
    pretune's task: the loss, the logged rewards / log-probs / margins / KL and every parameter's gradient. Run with
    the two models each way round: the KL estimate of one order is minus the other's, so one of them is above 0 and
    not clamped."""
    pytest.importorskip("trl")
    from pretune.interop import family_of

    kls = []
    for policy_name, ref_name in (("policy", "ref"), ("ref", "policy")):
        tr, trl_batch = _trl_kto(tiny, FORMATS[form], tmp_path / policy_name,
                                 model=copy.deepcopy(tiny[f"hf_{policy_name}"]),
                                 ref_model=copy.deepcopy(tiny[f"hf_{ref_name}"]), desirable_weight=1.3,
                                 undesirable_weight=0.7)
        policy, tok = _load(tiny[policy_name])
        ref, _ = _load(tiny[ref_name])
        task = _kto(policy, tok, desirable_weight=1.3, undesirable_weight=0.7)
        task.reference_model = _frozen(ref)
        want, want_stats, hf_grads = _trl_step(tr, trl_batch)
        got, stats, grads = _our_step(task, policy, _batch(task, FORMATS[form]))
        kls.append(want_stats["kl"])
        assert got == pytest.approx(want, abs=1e-6)
        _check_stats(stats, want_stats)
        mapped = _without_pad_row(family_of("llama").weights_from_hf(hf_grads, policy.config), policy.config)
        grads = _without_pad_row(grads, policy.config)
        assert set(mapped) == set(grads)
        for n in grads:
            torch.testing.assert_close(grads[n], mapped[n], rtol=1e-4, atol=1e-5, msg=lambda m, k=n: f"{k}: {m}")
    assert max(kls) > 1e-3  # the reference point entered one of the two losses unclamped


def test_loss_rewards_kl_and_gradients_equal_trl_with_lora(tiny, tmp_path):
    """KTOTrainer with a peft LoRA and no reference model (the adapter switched off is the reference) against
    pretune's LoRA (the same adapter, loaded from peft's files) with the reference of ``pretune finetune --peft``."""
    pytest.importorskip("trl")
    peft_lib = pytest.importorskip("peft")
    from pretune import peft
    from pretune.jobs.finetune.methods import AdapterMethod

    lora = peft_lib.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                               task_type="CAUSAL_LM")
    tr, trl_batch = _trl_kto(tiny, STRING_RECORDS, tmp_path / "trl", model=copy.deepcopy(tiny["hf_ref"]),
                             peft_config=lora)
    torch.manual_seed(1)
    with torch.no_grad():  # B = 0 at init: move it so that the policy differs from the reference
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    tr.model.save_pretrained(tmp_path / "adapter")
    model, tok = _load(tiny["ref"])
    peft.load_adapter(model, tmp_path / "adapter", name="default")
    peft.freeze_for(model, "default")
    task = _kto(model, tok)
    task.reference_model = AdapterMethod(peft.PeftConfig(method="lora")).reference(model)
    want, want_stats, hf_grads = _trl_step(tr, trl_batch)
    got, stats, grads = _our_step(task, model, _batch(task, STRING_RECORDS))
    assert got == pytest.approx(want, abs=1e-6)
    _check_stats(stats, want_stats)
    hf = {_LORA.search(n).groups(): g for n, g in hf_grads.items()}
    ours = {_LORA.search(n).groups(): g for n, g in grads.items()}
    assert set(ours) == set(hf) and len(ours) == 12
    for k in ours:
        torch.testing.assert_close(ours[k], hf[k], rtol=1e-4, atol=1e-5, msg=str(k))
    assert peft.peft_state(model).active == ["default"]  # the reference pass put the adapter back


def test_the_kl_reference_point_is_clamped_at_zero_and_carries_no_gradient():
    from pretune.tasks.kto import kto_losses

    logps = torch.tensor([-3.0, -5.0], requires_grad=True)
    kl = torch.tensor(0.7)
    losses, rewards = kto_losses(beta=0.1, desirable_weight=2.0, undesirable_weight=0.5, logps=logps,
                                 ref_logps=torch.tensor([-4.0, -4.0]), desirable=torch.tensor([True, False]), kl=kl)
    want = torch.stack([2.0 * (1 - torch.sigmoid(0.1 * (1.0 - kl))), 0.5 * (1 - torch.sigmoid(0.1 * (kl + 1.0)))])
    torch.testing.assert_close(losses, want)
    torch.testing.assert_close(rewards, torch.tensor([0.1, -0.1]))


def test_under_torchrun_z0_is_the_mean_over_the_processes_and_each_logs_the_sides_any_holds(tiny, monkeypatch):
    """What a training micro-batch hands the process group (tests/train/test_parallel.py runs two processes for
    real): one detached mean over the processes of (its z0 estimate, desirable records, undesirable records); the mean
    z0, clamped after averaging as TRL's gather().mean().clamp(), is the loss's; a side that another process's
    micro-batch holds is logged by this one too (0: the processes sum one vector of statistics). Evaluation reduces
    nothing (its batches differ between processes)."""
    from pretune.tasks import kto as kto_module
    from pretune.tasks.kto import kto_losses

    policy, tok = _load(tiny["policy"])
    ref, _ = _load(tiny["ref"])
    task = _kto(policy, tok)
    task.reference_model = _frozen(ref)
    batch = _batch(task, [r for r in STRING_RECORDS if not r["label"]])  # 2 undesirable records
    totals = {"kto": 2.0, "desirable": 1.0, "undesirable": 2.0}
    seen, reduced = [], {}

    def mean_over_processes(value, dist):  # another process holds a desirable record
        seen.append(value)
        return reduced["value"]

    monkeypatch.setattr(kto_module, "mean_over_processes", mean_over_processes)
    with torch.no_grad():
        lp = task.record_logps(policy, batch)
    for z0, want in ((0.3, 0.3), (-0.2, 0.0)):
        reduced["value"] = torch.tensor([z0, 0.5, 1.5])
        policy.train()
        loss, stats = task.loss(policy, batch, totals)
        local = seen.pop()
        assert not local.requires_grad
        torch.testing.assert_close(local, torch.stack([(lp["kl_logps"] - lp["ref_kl_logps"]).mean(),
                                                       torch.tensor(0.0), torch.tensor(2.0)]))
        assert stats["kto:kl"] == pytest.approx(2 * want)
        losses, _ = kto_losses(beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, logps=lp["logps"],
                               ref_logps=lp["ref_logps"], desirable=torch.tensor([False, False]),
                               kl=torch.tensor(want))
        assert float(loss.detach()) == pytest.approx(float(losses.sum()) / 2, abs=1e-6)
        assert stats["desirable:rewards/chosen"] == 0.0 and stats["desirable:logps/chosen"] == 0.0
    policy.eval()
    _, stats = task.loss(policy, batch, totals)
    assert not seen and "desirable:rewards/chosen" not in stats  # one process's view: no desirable record


# ------------------------------------------------------------------------------------------- a whole run
def _write_feedback(path, n: int):
    words = ["ocean", "river", "forest", "mountain", "desert", "valley", "island", "meadow"]
    rows = [{"prompt": f"A word for a place: {words[i % 8]}? Answer:",
             "completion": f" {words[(i + 3 * (i % 2)) % 8]}", "label": i % 2 == 0} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("peft_method", ["lora", ""])
def test_a_run_starts_at_policy_equals_reference_and_logs_and_scores_like_trl(peft_method, tiny, tmp_path):
    """`pretune finetune --task kto`: the first step's rewards and KL are 0 (policy = reference), so its loss is
    1 - sigmoid(0) = 0.5 for every record; the train rows carry TRL's keys, results.json the dev/test metrics."""
    from pretune.cli import main

    train = _write_feedback(tmp_path / "train.jsonl", 16)
    dev = _write_feedback(tmp_path / "dev.jsonl", 6)
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(tiny["ref"]), "--task", "kto", "--train", str(train), "--dev", str(dev),
            "--test", str(dev), "--out", str(out), "--batch-size", "4", "--quiet", "--lr", "1e-3",
            "train.plot=false", "train.tensorboard=false", "train.log_every=1", "tune.epochs=0", "train.steps=3",
            "task.max_len=48"]
    assert main(argv + (["--peft", peft_method] if peft_method else [])) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first = [r for r in rows if r["split"] == "train"][0]
    assert first["loss"] == pytest.approx(0.5, abs=1e-6)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    for k in TRL_KEYS + ("kto_loss",):
        assert k in first, k
    results = json.loads((out / "results.json").read_text())
    assert results["metric"] == "reward_accuracy"
    assert set(results["test"]) == {"loss", "kl", "reward_accuracy", "margin"}
    assert results["test"]["loss"] != pytest.approx(0.5, abs=1e-7)  # the policy moved from its reference
    pred = json.loads((out / "test_predictions.jsonl").read_text().splitlines()[0])
    assert pred["gold"] == "desirable" and pred["judged"] in ("desirable", "undesirable", "tie")
    assert not math.isnan(pred["reward"])


def test_scoring_without_a_reference_model_is_a_message_not_a_traceback(tiny):
    from pretune.config import ConfigError

    model, tok = _load(tiny["ref"])
    task = _kto(model, tok)
    with pytest.raises(ConfigError, match="reference model"):
        task.outputs(model, _batch(task, STRING_RECORDS))
