"""Parity with TRL on the real SmolLM2-135M-Instruct weights (issue 33): test_dpo's, test_kto's and test_reward's
parity checks on a 30-layer model with a 49152-token vocabulary instead of their tiny random Llama. Both sides load
the same folder (the reward model: SmolLM2 with a fresh one-output score head, seeded and saved once); the pairs and
records are the tests' short ones, so that each test takes seconds. The default suite runs the conversational DPO
test; the others are marked slow (all six: 40-60 s on two cores; `make test-slow`).

Tolerances: the tiny model's, everywhere — losses, rewards and log-probs within 1e-5, gradients within rtol 1e-4 /
atol 1e-5. pretune's forward equals transformers' bit for bit here (fp32, CPU); the log-probability of a token was
the one difference: fp32 -cross_entropy, whose CPU log_softmax sums the 49152 exponentials, came out ~9e-6 nats a
token high against fp64 (up to 1.6e-5), where TRL takes logit - logsumexp (~6e-8), and summed over a completion
that broke 1e-5; pretune now takes logit - logsumexp too (LMHead.token_logprobs). LOGPS_REL and GRAD_SCALE are
the looser tolerances _lora_parity accepts, unused (None) since.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import test_kto
import test_reward
import torch
from test_dpo import _LORA, TOKENIZER_FILES, _assert_grads_close, _load, _lora_parity, _without_pad_row, smollm2_folder

LOGPS_REL = None
GRAD_SCALE = None


@pytest.fixture(scope="module")
def smollm2():
    """{"ref": SmolLM2's folder, "hf_ref": transformers' LlamaForCausalLM of it in fp32, "hf_tok": its tokenizer}
    (test_dpo's and test_kto's keys); loaded once per module, copied by each test that trains it."""
    T = pytest.importorskip("transformers")
    smol = smollm2_folder()
    hf = T.AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    return {"ref": smol, "hf_ref": hf, "hf_tok": T.AutoTokenizer.from_pretrained(smol)}


@pytest.fixture(scope="module")
def smollm2_scorer(tmp_path_factory, smollm2):
    """test_reward's scorer for SmolLM2: LlamaForSequenceClassification of its weights with a fresh score head
    (num_labels=1, initialised by transformers under seed 0), saved with the tokenizer so that pretune loads the same
    head."""
    T = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("smollm2") / "scorer"
    torch.manual_seed(0)
    hf = T.AutoModelForSequenceClassification.from_pretrained(smollm2["ref"], num_labels=1, dtype=torch.float32).eval()
    assert hf.config.pad_token_id == smollm2["hf_tok"].pad_token_id  # the score is read before the first pad token
    hf.save_pretrained(d)
    for f in TOKENIZER_FILES:
        shutil.copy(smollm2["ref"] / f, d / f)
    return {"dir": d, "hf": hf, "hf_tok": smollm2["hf_tok"]}


# ------------------------------------------------------------------------------------------------------------ dpo
@pytest.mark.parametrize("form", ["conversational",  # the default suite's SmolLM2 test: 7-11 s
                                  pytest.param("string", marks=pytest.mark.slow)])  # 5-7 s (make test-slow)
def test_dpo_with_lora_equals_trl(form, smollm2, tmp_path):
    """test_dpo's LoRA parity (DPOTrainer with a peft LoRA, the adapter switched off as the reference, against
    pretune's LoRA loaded from peft's files), sigmoid loss: loss and rewards within 1e-5, log-probs within LOGPS_REL,
    every LoRA gradient within GRAD_SCALE."""
    pytest.importorskip("trl")
    _lora_parity(smollm2, form, tmp_path, ("sigmoid",), b_std=0.05, grad_scale=GRAD_SCALE, logps_rel=LOGPS_REL)


# ------------------------------------------------------------------------------------------------------------ kto
@pytest.mark.slow  # 6 s (make test-slow)
def test_kto_with_lora_equals_trl(smollm2, tmp_path):
    """test_kto's LoRA parity (KTOTrainer with a peft LoRA, the adapter switched off as the reference, desirable
    weight 1.3, undesirable 0.7): the loss, rewards, margins and KL z0 within 1e-5 (z0 above 0, so the reference
    point enters the loss unclamped), log-probs within LOGPS_REL, every LoRA gradient within GRAD_SCALE."""
    pytest.importorskip("trl")
    peft_lib = pytest.importorskip("peft")
    from pretune import peft
    from pretune.jobs.finetune.methods import AdapterMethod

    records = test_kto.STRING_RECORDS
    lora = peft_lib.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                               task_type="CAUSAL_LM")
    tr, trl_batch = test_kto._trl_kto(smollm2, records, tmp_path / "trl", model=copy.deepcopy(smollm2["hf_ref"]),
                                      peft_config=lora, desirable_weight=1.3, undesirable_weight=0.7)
    torch.manual_seed(1)
    with torch.no_grad():  # B = 0 at init: move it so that the policy differs from the reference
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    tr.model.save_pretrained(tmp_path / "adapter")
    model, tok = _load(smollm2["ref"])
    peft.load_adapter(model, tmp_path / "adapter", name="default")
    peft.freeze_for(model, "default")
    task = test_kto._kto(model, tok, desirable_weight=1.3, undesirable_weight=0.7)
    task.reference_model = AdapterMethod(peft.PeftConfig(method="lora")).reference(model)
    want, want_stats, hf_grads = test_kto._trl_step(tr, trl_batch)
    got, stats, grads = test_kto._our_step(task, model, test_kto._batch(task, records))
    assert want_stats["kl"] > 1e-3  # the reference point entered the loss unclamped
    assert got == pytest.approx(want, abs=1e-5)
    for k in test_kto.TRL_KEYS:
        rel = LOGPS_REL if k.startswith("logps/") else None
        assert stats[k] == pytest.approx(want_stats[k], abs=1e-5, rel=rel), (k, stats[k], want_stats[k])
    hf = {_LORA.search(n).groups(): g for n, g in hf_grads.items()}
    ours = {_LORA.search(n).groups(): g for n, g in grads.items()}
    assert set(ours) == set(hf) and len(ours) == 30 * 3 * 2
    for k in ours:
        _assert_grads_close(ours[k], hf[k], str(k), GRAD_SCALE)
    assert peft.peft_state(model).active == ["default"]  # the reference pass put the adapter back


# --------------------------------------------------------------------------------------------------------- reward
@pytest.mark.slow  # 7-14 s each, the scorer's folder written once (make test-slow)
@pytest.mark.parametrize("form", ["string", "conversational"])
def test_reward_model_equals_trl(form, smollm2_scorer, tmp_path):
    """test_reward's full-finetuning parity (RewardTrainer.compute_loss, margins on the string pairs, reward
    centring 0.01): the loss and logged accuracy / margin / mean_reward within 1e-5, every parameter's gradient (the
    score head's among them) within rtol 1e-4 / atol 1e-5."""
    pytest.importorskip("trl")
    from pretune.interop import family_of

    pairs = test_reward.FORMATS[form]
    tr, trl_batch = test_reward._trl_reward(smollm2_scorer, pairs, tmp_path, center_rewards_coefficient=0.01)
    tr.model.train()
    tr._metrics["train"].clear()
    want = tr.compute_loss(tr.model, dict(trl_batch))
    want.backward()
    want_stats = {k: v[-1] for k, v in tr._metrics["train"].items()}
    model, tok = _load(smollm2_scorer["dir"])
    task = test_reward._reward(model, tok, center_rewards_coefficient=0.01)
    batch = test_reward._batch(task, pairs)
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"])
    model.train()
    counts = task.counts(batch)
    loss, stats = task.loss(model, batch, {k: float(v) for k, v in counts.items()})
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), abs=1e-5)
    for k in ("accuracy", "margin", "mean_reward"):
        assert stats[f"reward:{k}"] / counts["reward"] == pytest.approx(want_stats[k], abs=1e-5), k
    hf_grads = {n: p.grad for n, p in tr.model.named_parameters() if p.grad is not None}
    mapped = _without_pad_row(family_of("llama").weights_from_hf(hf_grads, model.config), model.config)
    grads = _without_pad_row({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, model.config)
    assert set(mapped) == set(grads) and "head.out.weight" in grads
    for n in grads:
        _assert_grads_close(grads[n], mapped[n], n)


@pytest.mark.slow  # 8 s (make test-slow)
def test_reward_model_with_lora_equals_trl(smollm2_scorer, tmp_path):
    """test_reward's LoRA parity (RewardTrainer with a SEQ_CLS peft LoRA, which trains its own copy of the score
    head, against pretune with the adapter loaded from peft's files), conversational pairs: the loss and metrics
    within 1e-5, the LoRA and head gradients within rtol 1e-4 / atol 1e-5."""
    pytest.importorskip("trl")
    peft_lib = pytest.importorskip("peft")
    from pretune import peft

    pairs = test_reward.FORMATS["conversational"]
    lora = peft_lib.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                               task_type="SEQ_CLS")
    tr, trl_batch = test_reward._trl_lora_adapter(smollm2_scorer, pairs, tmp_path, lora, scale_b=0.05,
                                                  scale_head=0.02)
    model, tok = _load(smollm2_scorer["dir"])
    peft.load_adapter(model, tmp_path / "adapter", name="default")
    peft.freeze_for(model, "default")
    task = test_reward._reward(model, tok, center_rewards_coefficient=0.01)
    theirs, ours = test_reward._lora_step(tr, trl_batch, model, task, pairs)
    assert len(ours) == 30 * 3 * 2 + 1
    for k in ours:
        _assert_grads_close(ours[k], theirs[k], str(k))
