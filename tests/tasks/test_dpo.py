"""Preference tuning (task dpo): TRL's tokenization of string and conversational pairs, loss, rewards and gradients
equal to TRL's on a tiny random-weight Llama (full finetuning and LoRA), the first loss of a run ln 2, bad records
named by file, line and field, and a run through ``pretune finetune`` that logs and scores like TRL.

The model is a ``transformers`` LlamaForCausalLM (dim 32, 2 layers) with SmolLM2's tokenizer and chat template, so
the conversational pairs are rendered by a real template; pretune loads the same folder."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from pretune.data.readers import DataError
from pretune.tasks import TaskConfig, build_task
from pretune.tasks.base import Record

STRING_PAIRS = [{"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon, I think."},
                {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5, or maybe 22"},
                {"prompt": "Name a colour:", "chosen": " blue", "rejected": " seven"}]
CHAT_PAIRS = [{"prompt": [{"role": "user", "content": "What is the capital of France?"}],
               "chosen": [{"role": "assistant", "content": "Paris."}],
               "rejected": [{"role": "assistant", "content": "Lyon, I think."}]},
              {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2 + 2?"}],
               "chosen": [{"role": "assistant", "content": "4"}],
               "rejected": [{"role": "assistant", "content": "5, or maybe 22"}]},
              {"prompt": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."},
                          {"role": "user", "content": "Another one?"}],
               "chosen": [{"role": "assistant", "content": "Blue."}],
               "rejected": [{"role": "assistant", "content": "Seven."}]}]
FORMATS = {"string": STRING_PAIRS, "conversational": CHAT_PAIRS}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def smollm2_folder() -> Path:
    from pretune import realmodels

    try:
        return realmodels.smollm2_dir()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"ref": folder of a random tiny Llama, "policy": the same weights perturbed, "hf_ref", "hf_policy": the
    transformers models, "hf_tok": the tokenizer}."""
    T = pytest.importorskip("transformers")
    smol = smollm2_folder()
    d = tmp_path_factory.mktemp("dpo")
    hf_tok = T.AutoTokenizer.from_pretrained(smol)
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        tie_word_embeddings=True, pad_token_id=hf_tok.pad_token_id, bos_token_id=hf_tok.bos_token_id,
                        eos_token_id=hf_tok.eos_token_id)
    hf_ref = T.LlamaForCausalLM(cfg).eval()
    hf_policy = copy.deepcopy(hf_ref)
    with torch.no_grad():
        for p in hf_policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # a policy that has moved away from its reference
    for name, m in (("ref", hf_ref), ("policy", hf_policy)):
        m.save_pretrained(d / name)
        for f in TOKENIZER_FILES:
            shutil.copy(smol / f, d / name / f)
    return {"ref": d / "ref", "policy": d / "policy", "hf_ref": hf_ref, "hf_policy": hf_policy, "hf_tok": hf_tok,
            "dir": d}


def _load(folder):
    from pretune.loading import load_pretrained

    loaded = load_pretrained(folder)
    return loaded.model, loaded.tokenizer


def _dpo(model, tok, **kw):
    return build_task(TaskConfig(name="dpo", max_len=kw.pop("max_len", 96), **kw), model.config, tok)


def _batch(task, pairs):
    return task.collate([task.encode(Record(f"pairs.jsonl:{i + 1}", p))[0] for i, p in enumerate(pairs)])


def _frozen(model):
    @contextlib.contextmanager
    def use(policy):
        yield model.eval()
    return use


def _trl_dpo(tiny, pairs, tmp, *, model, ref_model=None, peft_config=None):
    """TRL's DPOTrainer over ``pairs`` (fp32: TRL's configs default to bf16 autocast)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp), report_to=[], beta=0.1, max_length=96, per_device_train_batch_size=len(pairs),
                     use_cpu=True, bf16=False, dataset_num_proc=None, disable_tqdm=True)
    tr = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(pairs),
                    processing_class=tiny["hf_tok"], peft_config=peft_config)
    batch = tr.data_collator([tr.train_dataset[i] for i in range(len(pairs))])
    return tr, batch


def _trl_step(tr, batch, loss_type: str) -> tuple[float, dict, dict]:
    """(loss, TRL's logged metrics, gradients by name) of one DPOTrainer loss on ``batch``."""
    tr.loss_types, tr.loss_weights = [loss_type], [1.0]
    tr._metrics["train"].clear()
    tr.model.train()
    tr.model.zero_grad()
    loss = tr.compute_loss(tr.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    return float(loss.detach()), {k: v[-1] for k, v in tr._metrics["train"].items()}, grads


def _our_step(task, model, batch) -> tuple[float, dict, dict]:
    model.train()
    model.zero_grad()
    counts = task.counts(batch)
    loss, stats = task.loss(model, batch, {k: float(v) for k, v in counts.items()})
    loss.backward()
    means = {k.partition(":")[2]: v / counts["pref"] for k, v in stats.items() if ":" in k}
    return float(loss.detach()), means, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _without_pad_row(grads: dict, cfg) -> dict:
    """The gradients with the pad token's embedding row zeroed: transformers' Llama embeds with ``padding_idx``, so
    the input side of that row never gets a gradient there, and SmolLM2's pad is ``<|im_end|>``, a real token of every
    chat; pretune trains it (the tied output side agrees either way)."""
    out = dict(grads)
    out["transformer.embed.weight"] = grads["transformer.embed.weight"].clone()
    out["transformer.embed.weight"][cfg.pad_token_id] = 0
    return out


def _check_rewards(ours: dict, trl: dict, *, logps_rel: float | None = None):
    """TRL's logged rewards, accuracies and log-probs within 1e-5; the log-probs (sums over a completion's tokens)
    within ``logps_rel`` of their size instead where given (test_smollm2_parity's LOGPS_REL)."""
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours[k] == pytest.approx(trl[k], abs=1e-5), k
    for k in ("logps/chosen", "logps/rejected"):
        assert ours[k] == pytest.approx(trl[k], abs=1e-5, rel=logps_rel), k


def _assert_grads_close(ours: torch.Tensor, theirs: torch.Tensor, msg: str, scale: float | None = None):
    """rtol 1e-4, atol 1e-5 (the tiny model), or with ``scale`` an atol of ``scale`` times the tensor's largest |entry|
    (test_smollm2_parity's GRAD_SCALE)."""
    atol = 1e-5 if scale is None else scale * float(theirs.abs().max())
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=atol, msg=msg)


# ----------------------------------------------------------------------------------------------- data formats
@pytest.mark.parametrize("form", sorted(FORMATS))
def test_pairs_tokenize_as_trl_does(form, tiny, tmp_path):
    """The prompt, chosen and rejected ids of every pair equal those of TRL's DPOTrainer dataset (string pairs: EOS
    appended; conversational: SmolLM2's chat template, the completion ending at its end-of-turn)."""
    pytest.importorskip("trl")
    model, tok = _load(tiny["ref"])
    task = _dpo(model, tok)
    tr, _ = _trl_dpo(tiny, FORMATS[form], tmp_path, model=copy.deepcopy(tiny["hf_policy"]),
                     ref_model=copy.deepcopy(tiny["hf_ref"]))
    for i, pair in enumerate(FORMATS[form]):
        prompt, chosen, rejected = task.pair_ids(Record(f"p:{i + 1}", pair))
        want = tr.train_dataset[i]
        assert (prompt, chosen, rejected) == (want["prompt_ids"], want["chosen_ids"], want["rejected_ids"])
    if form == "conversational":
        assert tok.decode(chosen) == "Blue.<|im_end|>\n"


def test_chat_true_renders_string_pairs_as_a_conversation(tiny):
    model, tok = _load(tiny["ref"])
    as_chat = _dpo(model, tok, chat=True, system="Be kind.")
    p, c, _ = as_chat.pair_ids(Record("p:1", STRING_PAIRS[0]))
    conv = {"prompt": [{"role": "system", "content": "Be kind."},
                       {"role": "user", "content": STRING_PAIRS[0]["prompt"]}],
            "chosen": [{"role": "assistant", "content": " Paris."}],
            "rejected": [{"role": "assistant", "content": " Lyon, I think."}]}
    assert (p, c) == _dpo(model, tok).pair_ids(Record("p:1", conv))[:2]
    assert "<|im_start|>user" in tok.decode(p)


@pytest.mark.parametrize("record, culprits", [
    ({"prompt": "a", "chosen": " b"}, ["pairs.jsonl:3", "'rejected'"]),
    ({"prompt": "a", "chosen": "  ", "rejected": " c"}, ["pairs.jsonl:3", "'chosen'", "empty"]),
    ({"prompt": "a", "chosen": " b", "rejected": " b"}, ["pairs.jsonl:3", "'chosen'", "'rejected'", "identical"]),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [], "rejected": [{"role": "assistant", "content": "c"}]},
     ["pairs.jsonl:3", "'chosen'", "empty list"]),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]}, ["pairs.jsonl:3", "'chosen'", "message 0"]),
    ({"prompt": "word " * 200, "chosen": " b", "rejected": " c"}, ["pairs.jsonl:3", "'prompt'", "task.max_len=96"]),
])
def test_bad_records_name_file_line_and_field(record, culprits, tiny):
    model, tok = _load(tiny["ref"])
    with pytest.raises(DataError) as e:
        _dpo(model, tok).encode(Record("pairs.jsonl:3", record))
    for c in culprits:
        assert c in str(e.value), (c, str(e.value))


# ----------------------------------------------------------------------------------------- parity with TRL
@pytest.mark.parametrize("form", sorted(FORMATS))
def test_loss_rewards_and_gradients_equal_trl_full_finetuning(form, tiny, tmp_path):
    """DPOTrainer itself (a frozen reference model, fp32) against pretune's task for sigmoid, hinge and ipo: the loss,
    the logged rewards / accuracies / log-probs and every parameter's gradient within 1e-5."""
    pytest.importorskip("trl")
    from pretune.interop import family_of

    tr, trl_batch = _trl_dpo(tiny, FORMATS[form], tmp_path, model=copy.deepcopy(tiny["hf_policy"]),
                             ref_model=copy.deepcopy(tiny["hf_ref"]))
    policy, tok = _load(tiny["policy"])
    ref, _ = _load(tiny["ref"])
    for loss_type in ("sigmoid", "hinge", "ipo"):
        task = _dpo(policy, tok, loss=loss_type)
        task.reference_model = _frozen(ref)
        batch = _batch(task, FORMATS[form])
        assert torch.equal(batch["input_ids"][batch["attention_mask"] == 1],
                           trl_batch["input_ids"][trl_batch["attention_mask"] == 1])
        want, want_stats, hf_grads = _trl_step(tr, trl_batch, loss_type)
        got, stats, grads = _our_step(task, policy, batch)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-5), loss_type  # ipo: ~25, fp32 rounding
        _check_rewards(stats, want_stats)
        mapped = _without_pad_row(family_of("llama").weights_from_hf(hf_grads, policy.config), policy.config)
        grads = _without_pad_row(grads, policy.config)
        assert set(mapped) == set(grads)
        for n in grads:
            torch.testing.assert_close(grads[n], mapped[n], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=f"{loss_type}: {n}": f"{k}: {m}")


_LORA = re.compile(r"layers\.(\d+)\.\w+\.(\w+_proj)\.lora_([AB])\.")


def _lora_parity(models, form, tmp_path, loss_types, *, b_std: float, grad_scale: float | None = None,
                 logps_rel: float | None = None) -> None:
    """DPOTrainer with a peft LoRA on ``models["hf_ref"]`` (q, v and down projections, r 4; no reference model: the
    adapter switched off is the reference; B moved off 0, N(0, b_std), so that the policy differs from the reference)
    against pretune's LoRA (the same adapter loaded from peft's files) with the reference of ``pretune finetune
    --peft``: per loss type the loss and rewards within 1e-5 and every LoRA gradient (tolerances: _check_rewards,
    _assert_grads_close)."""
    peft_lib = pytest.importorskip("peft")
    from pretune import peft
    from pretune.jobs.finetune.methods import AdapterMethod

    lora = peft_lib.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                               task_type="CAUSAL_LM")
    tr, trl_batch = _trl_dpo(models, FORMATS[form], tmp_path / "trl", model=copy.deepcopy(models["hf_ref"]),
                             peft_config=lora)
    torch.manual_seed(1)
    with torch.no_grad():  # B = 0 at init: move it so that the policy differs from the reference
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, b_std)
    tr.model.save_pretrained(tmp_path / "adapter")
    model, tok = _load(models["ref"])
    peft.load_adapter(model, tmp_path / "adapter", name="default")
    peft.freeze_for(model, "default")
    method = AdapterMethod(peft.PeftConfig(method="lora"))
    for loss_type in loss_types:
        task = _dpo(model, tok, loss=loss_type)
        task.reference_model = method.reference(model)
        want, want_stats, hf_grads = _trl_step(tr, trl_batch, loss_type)
        got, stats, grads = _our_step(task, model, _batch(task, FORMATS[form]))
        assert got == pytest.approx(want, rel=1e-6, abs=1e-5), loss_type  # ipo: ~25, fp32 rounding
        _check_rewards(stats, want_stats, logps_rel=logps_rel)
        hf = {_LORA.search(n).groups(): g for n, g in hf_grads.items()}
        ours = {_LORA.search(n).groups(): g for n, g in grads.items()}
        assert set(ours) == set(hf) and len(ours) == model.config.n_layers * 3 * 2  # q, v, down; A and B
        for k in ours:
            _assert_grads_close(ours[k], hf[k], f"{loss_type}: {k}", grad_scale)
    assert peft.peft_state(model).active == ["default"]  # the reference pass put the adapter back


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_loss_rewards_and_gradients_equal_trl_with_lora(form, tiny, tmp_path):
    """DPOTrainer with a peft LoRA and no reference model (the adapter switched off is the reference) against
    pretune's LoRA (the same adapter, loaded from peft's files) with the reference of ``pretune finetune --peft``."""
    pytest.importorskip("trl")
    _lora_parity(tiny, form, tmp_path, ("sigmoid", "ipo"), b_std=0.05)


def _hf_batch_logps(hf_model, batch, *, average: bool):
    """TRL's CPO/ORPO ``get_batch_logps`` on transformers' logits of pretune's batch (2B rows)."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    logits = hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits, ORPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=average)


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_simpo_and_orpo_equal_trls_cpo_and_orpo_losses(form, tiny):
    """TRL's CPOTrainer.cpo_loss (loss_type="simpo", cpo_alpha=0: SimPO) and ORPOTrainer.odds_ratio_loss (+ its NLL
    of the chosen completions), called on log-probabilities that transformers computes with the same weights on
    pretune's batch (their trainers tokenize pairs their own way): loss, rewards and gradients within 1e-5."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    from pretune.interop import family_of

    policy, tok = _load(tiny["policy"])
    hf = copy.deepcopy(tiny["hf_policy"]).train()
    for loss_type in ("simpo", "orpo"):
        extra = {"simpo_gamma": 0.3, "label_smoothing": 0.1} if loss_type == "simpo" else {}
        task = _dpo(policy, tok, loss=loss_type, beta=0.2, **extra)
        batch = _batch(task, FORMATS[form])
        B = batch["input_ids"].shape[0] // 2
        hf.zero_grad()
        logits, logps = _hf_batch_logps(hf, batch, average=True)
        me = SimpleNamespace(beta=0.2, alpha=0.0, loss_type="simpo", simpo_gamma=0.3, label_smoothing=0.1,
                             accelerator=SimpleNamespace(device="cpu"))
        if loss_type == "simpo":
            losses, chosen_r, rejected_r = CPOTrainer.cpo_loss(me, logps[:B], logps[B:])
            want = losses.mean()
        else:
            losses, chosen_r, rejected_r, _, _ = ORPOTrainer.odds_ratio_loss(me, logps[:B], logps[B:])
            labels = batch["labels"][:B, 1:]
            nll = torch.nn.functional.cross_entropy(logits[:B, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))
            want = nll - losses.mean()  # ORPOTrainer.get_batch_loss_metrics
        want.backward()
        got, stats, grads = _our_step(task, policy, batch)
        assert got == pytest.approx(float(want), abs=1e-5), loss_type
        assert stats["rewards/chosen"] == pytest.approx(float(chosen_r.mean()), abs=1e-5)
        assert stats["rewards/rejected"] == pytest.approx(float(rejected_r.mean()), abs=1e-5)
        mapped = _without_pad_row(family_of("llama").weights_from_hf({n: p.grad for n, p in hf.named_parameters()},
                                                                      policy.config), policy.config)
        grads = _without_pad_row(grads, policy.config)
        for n in grads:
            torch.testing.assert_close(grads[n], mapped[n], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=f"{loss_type}: {n}": f"{k}: {m}")


def test_label_smoothing_is_conservative_dpo(tiny):
    """sigmoid with label_smoothing eps: -(1 - eps) log sigmoid(d) - eps log sigmoid(-d) (cDPO; TRL's CPO formula;
    TRL 1.16's DPOTrainer reads label_smoothing only for its robust and exo_pair losses)."""
    from pretune.tasks.dpo import pair_losses

    c, r, rc, rr, n = (torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.5, 2.0))
    d = 0.1 * ((c - rc) - (r - rr))
    got = pair_losses("sigmoid", beta=0.1, label_smoothing=0.2, chosen=c, rejected=r, ref_chosen=rc, ref_rejected=rr,
                      n_chosen=n, n_rejected=n)["loss"]
    want = -0.8 * torch.nn.functional.logsigmoid(d) - 0.2 * torch.nn.functional.logsigmoid(-d)
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------------- a whole run
def _write_pairs(path: Path, n: int) -> Path:
    words = ["ocean", "river", "forest", "mountain", "desert", "valley", "island", "meadow"]
    rows = [{"prompt": f"A word for a place: {words[i % 8]}? Answer:", "chosen": f" {words[i % 8]}",
             "rejected": f" {words[(i + 3) % 8]} or so"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("peft_method", ["lora", ""])
def test_a_run_starts_at_ln2_and_logs_and_scores_like_trl(peft_method, tiny, tmp_path):
    """`pretune finetune --task dpo`: the first train loss is ln 2 (policy = reference: LoRA's B is 0, full finetuning
    copies the starting weights), the train rows carry TRL's reward keys, results.json the dev/test means, keep-best
    reads pref_accuracy."""
    from pretune.cli import main

    train = _write_pairs(tmp_path / "train.jsonl", 16)
    dev = _write_pairs(tmp_path / "dev.jsonl", 6)
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(tiny["ref"]), "--task", "dpo", "--train", str(train), "--dev", str(dev),
            "--test", str(dev), "--out", str(out), "--batch-size", "4", "--quiet", "--lr", "1e-3",
            "train.plot=false", "train.tensorboard=false", "train.log_every=1", "tune.epochs=0", "train.steps=3",
            "task.max_len=48"]
    assert main(argv + (["--peft", peft_method] if peft_method else [])) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert train_rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert train_rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected",
              "pref_loss", "pref_acc"):
        assert k in train_rows[0], k
    results = json.loads((out / "results.json").read_text())
    assert results["metric"] == "pref_accuracy"
    assert set(results["test"]) == {"loss", "pref_accuracy", "margin"}
    assert results["test"]["loss"] != pytest.approx(math.log(2), abs=1e-7)  # the policy moved from its reference
    pred = json.loads((out / "test_predictions.jsonl").read_text().splitlines()[0])
    assert pred["gold"] == "chosen" and pred["preferred"] in ("chosen", "rejected")


# ------------------------------------------------------------------------------ a quantised base (QLoRA, issue 36)
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_dpo_on_a_quantised_base_has_the_base_with_adapters_off_as_reference(fmt, tiny):
    """peft.base_dtype=nf4 | int8: the reference is the quantised base with the adapter switched off — the policy's
    own start, so the first loss is ln 2 — and stays that base, bit for bit, while the adapter trains. (The tiny
    Llama's 32 x 37 down projection is not a whole number of NF4 blocks: padded.)"""
    if fmt == "nf4":
        pytest.importorskip("torchao")
    from pretune import peft
    from pretune.jobs.finetune.methods import AdapterMethod
    from pretune.model import QuantizedLinear

    model, tok = _load(tiny["ref"])
    cfg = peft.PeftConfig(method="lora", r=4, alpha=8, targets=["all-linear"], base_dtype=fmt)
    peft.inject(model, cfg, seed=0)
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == 14
    task = _dpo(model, tok)
    task.reference_model = AdapterMethod(cfg).reference(model)
    batch = _batch(task, STRING_PAIRS)
    ref = task.reference_logps(model, batch)
    loss, stats, _ = _our_step(task, model, batch)
    assert loss == pytest.approx(math.log(2), abs=1e-6)
    assert stats["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        opt.step()
        loss, stats, _ = _our_step(task, model, batch)
    assert loss < math.log(2) - 1e-3 and stats["rewards/margins"] > 0  # the policy moved away from its reference
    assert torch.equal(task.reference_logps(model, batch), ref)  # ... which did not move
    assert model.training and peft.peft_state(model).active == ["default"]  # the switch gave the adapter back


@pytest.mark.parametrize("fmt", ["nf4", pytest.param("int8", marks=pytest.mark.slow)])  # int8: ~5 s more
def test_dpo_run_on_a_quantised_base(fmt, tiny, tmp_path):
    """`pretune finetune --task dpo --peft lora peft.base_dtype=nf4` (and int8): starts at ln 2, trains, records the
    base's storage, and saves an adapter that loads on the unquantised base it recorded."""
    if fmt == "nf4":
        pytest.importorskip("torchao")
    import pretune
    from pretune.cli import main
    from pretune.model import QuantizedLinear

    train = _write_pairs(tmp_path / "train.jsonl", 8)
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(tiny["ref"]), "--task", "dpo", "--train", str(train), "--out", str(out),
            "--batch-size", "4", "--quiet", "--lr", "1e-2", "--peft", "lora", f"peft.base_dtype={fmt}",
            "train.plot=false", "train.tensorboard=false", "train.log_every=1", "tune.epochs=0", "train.steps=3",
            "task.max_len=48"]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert train_rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert train_rows[-1]["loss"] < math.log(2)
    results = json.loads((out / "results.json").read_text())
    assert results["peft"]["base_dtype"] == fmt
    plain = pretune.load(out / "model")  # the adapter on the fp32 base it recorded
    assert not any(isinstance(m, QuantizedLinear) for m in plain.modules())
