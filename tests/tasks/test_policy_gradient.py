"""GRPO's pure functions (tasks/policy_gradient.py) against TRL 1.16's GRPOTrainer itself, in fp32 on CPU.

One real GRPOTrainer is built on a random-weight ``transformers`` LlamaForCausalLM (dim 32, 2 layers, SmolLM2's
tokenizer). Advantages and reward statistics: the trainer's own ``_generate_and_score_completions`` (it samples
completions from the tiny model, then a reward function returns preset rewards: ties, zero-std groups, None) for each
``scale_rewards``. Losses: the trainer's ``_compute_loss`` on hand-made completions, with its log-probabilities (its
fused LM head on the model) turned into leaf tensors, so that the loss, the gradient with respect to the
log-probabilities and the metrics it appends are compared with ours on the same values, for each loss type, on one
micro-batch and split in two (gradient accumulation 2); one test backpropagates through the model unchanged."""

from __future__ import annotations

import pytest
import torch

from pretune.tasks.policy_gradient import LOSS_UNITS, group_advantages, reduce_loss, token_losses

pytest.importorskip("trl")

G = 4  # completions per prompt
MAX_NEW = 8  # max_completion_length (dr_grpo's constant), the completions' padded width
PRESET: dict = {}  # the rewards the trainer's reward function returns next


def preset(prompts, completions, **kwargs):
    return list(PRESET["rewards"])


@pytest.fixture(scope="module")
def trl(tmp_path_factory):
    """{"trainer": a GRPOTrainer (loss_type etc. set per test), "model": its policy, "inputs": hand-made rows}."""
    T = pytest.importorskip("transformers")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from pretune import realmodels

    try:
        smol = realmodels.smollm2_dir()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))
    tok = T.AutoTokenizer.from_pretrained(smol)
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id)
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("grpo")), report_to=[], use_cpu=True, bf16=False,
                      per_device_train_batch_size=3 * G, num_generations=G, max_completion_length=MAX_NEW,
                      disable_tqdm=True, save_strategy="no")
    trainer = GRPOTrainer(model=T.LlamaForCausalLM(cfg), reward_funcs=preset, args=args,
                          train_dataset=Dataset.from_list([{"prompt": "unused"}] * G), processing_class=tok)
    trainer.model.train()  # _compute_loss logs under "train" and normalises for accumulation there
    g = torch.Generator().manual_seed(1)
    n, prompt_len, vocab = 2 * G, 5, len(tok)
    prompt_mask = torch.ones(n, prompt_len, dtype=torch.long)
    prompt_mask[1, :2] = prompt_mask[6, :1] = 0  # left padding, as TRL pads prompts
    completion_lens = torch.tensor([8, 5, 3, 6, 1, 8, 4, 7])
    completion_mask = (torch.arange(MAX_NEW) < completion_lens[:, None]).long()  # (N, T)
    inputs = {"prompt_ids": torch.randint(vocab, (n, prompt_len), generator=g) * prompt_mask,
              "prompt_mask": prompt_mask,
              "completion_ids": torch.randint(vocab, (n, MAX_NEW), generator=g) * completion_mask,
              "completion_mask": completion_mask,
              "advantages": torch.randn(n, generator=g)}
    return {"trainer": trainer, "model": trainer.model, "inputs": inputs, "gen": g}


def _trl_logps(trainer, inputs) -> torch.Tensor:
    """TRL's per-token log-probabilities of ``inputs``' completions (its fused LM head), (N, T), detached."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, MAX_NEW)[0]


def _set(trainer, *, loss_type, epsilon_low, epsilon_high, beta, kl_ratio, accumulation):
    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.epsilon_low, trainer.epsilon_high = epsilon_low, epsilon_high
    trainer.args.use_bias_correction_kl = kl_ratio
    trainer.current_gradient_accumulation_steps = accumulation  # what Trainer's training loop sets per step
    trainer.args.steps_per_generation = accumulation  # TRL's default: one generation batch per optimizer step
    trainer._metrics["train"].clear()


def _trl_step(trainer, micro_batches: list[dict]) -> tuple[float, list[torch.Tensor], dict]:
    """TRL's step loss (the sum of its micro-batch losses, as Trainer accumulates them), the gradient of each
    micro-batch's log-probabilities, and its metrics (the mean of the values appended per micro-batch, as logged)."""
    real = type(trainer)._get_per_token_logps_and_entropies
    leaves = []

    def leaf_logps(model, *args, **kwargs):
        logps, entropies, aux = real(trainer, model, *args, **kwargs)
        leaves.append(logps.detach().requires_grad_())
        return leaves[-1], entropies.detach(), aux

    trainer._get_per_token_logps_and_entropies = leaf_logps
    try:
        total = 0.0
        for mb in micro_batches:
            loss = trainer._compute_loss(trainer.model, mb)
            loss.backward()
            total += float(loss.detach())
    finally:
        del trainer._get_per_token_logps_and_entropies
    metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items()}
    return total, [x.grad for x in leaves], metrics


def _our_step(micro_batches: list[dict], logps: list[torch.Tensor], *, loss_type, epsilon_low, epsilon_high, beta,
              kl_ratio) -> tuple[float, list[torch.Tensor], dict]:
    """Ours on the same micro-batches and log-probabilities: numerators over the step's totals of their units."""
    leaves = [x.detach().clone().requires_grad_() for x in logps]
    outs, numerators, unit = [], [], None
    for mb, x in zip(micro_batches, leaves):
        out = token_losses(x, mb.get("old_per_token_logps"), mb["advantages"], mb["completion_mask"],
                           epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
                           ref_logps=mb.get("ref_per_token_logps"), kl_ratio=kl_ratio)
        num, unit = reduce_loss(out["loss"], mb["completion_mask"], loss_type, max_completion_length=MAX_NEW)
        outs.append(out)
        numerators.append(num)
    totals = {"tokens": sum(int(mb["completion_mask"].sum()) for mb in micro_batches),
              "sequences": sum(len(mb["advantages"]) for mb in micro_batches), "micro_batches": len(micro_batches)}
    assert unit == LOSS_UNITS[loss_type]
    loss = sum(numerators) / totals[unit]
    loss.backward()
    metrics: dict[str, list[float]] = {}
    for mb, out in zip(micro_batches, outs):  # per micro-batch, then averaged: TRL's logging
        mask = mb["completion_mask"]
        names = {"clip_ratio/low_mean": "clip_low", "clip_ratio/high_mean": "clip_high",
                 "clip_ratio/region_mean": "clip_region"} | ({"kl": "kl"} if beta else {})
        for name, key in names.items():
            metrics.setdefault(name, []).append(float(out[key].sum() / mask.sum()))
        metrics.setdefault("clip_ratio/low_min", []).append(float((out["clip_low"].sum(-1) / mask.sum(-1)).min()))
        metrics.setdefault("clip_ratio/high_max", []).append(float((out["clip_high"].sum(-1) / mask.sum(-1)).max()))
    return float(loss.detach()), [x.grad for x in leaves], {k: sum(v) / len(v) for k, v in metrics.items()}


def _rows(inputs: dict, rows: slice, total_tokens: int) -> dict:
    return {k: (v[rows] if k != "num_items_in_batch" else v) for k, v in inputs.items()} | {
        "num_items_in_batch": torch.tensor(total_tokens)}


CASES = {  # name -> (epsilon_low, epsilon_high, beta, kl_ratio, old_logps given)
    "on_policy": (0.2, 0.2, 0.0, True, False),  # TRL's defaults, num_iterations=1
    "clip_higher_old_logps": (0.2, 0.28, 0.0, True, True),  # DAPO's epsilons, num_iterations > 1
    "kl_old_logps": (0.2, 0.28, 0.04, True, True),  # beta > 0, the KL weighted by the ratio (TRL's default)
    "kl_on_policy_no_ratio": (0.1, 0.3, 0.04, False, False),  # use_bias_correction_kl=False
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loss_type", list(LOSS_UNITS))
def test_loss_gradient_and_metrics_equal_trl(trl, loss_type, case):
    """TRL's ``_compute_loss`` on 8 completions (lengths 1 to 8, advantages of both signs, old log-probabilities
    spread so that tokens clip on both sides) in one micro-batch, then split in two micro-batches accumulated:
    our loss, gradient w.r.t. the log-probabilities and logged metrics equal TRL's within 1e-5."""
    epsilon_low, epsilon_high, beta, kl_ratio, with_old = CASES[case]
    trainer, inputs = trl["trainer"], dict(trl["inputs"])
    logps = _trl_logps(trainer, inputs)
    g = torch.Generator().manual_seed(2)
    if with_old:
        inputs["old_per_token_logps"] = logps + 0.4 * torch.randn(logps.shape, generator=g)
    if beta:
        inputs["ref_per_token_logps"] = logps + 0.5 * torch.randn(logps.shape, generator=g)
    n, tokens = len(inputs["advantages"]), int(inputs["completion_mask"].sum())
    settings = dict(loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
                    kl_ratio=kl_ratio)
    for split in ([slice(0, n)], [slice(0, n // 2), slice(n // 2, n)]):
        micro_batches = [_rows(inputs, rows, tokens) for rows in split]
        _set(trainer, **settings, accumulation=len(split))
        want, want_grads, want_metrics = _trl_step(trainer, micro_batches)
        got, got_grads, got_metrics = _our_step(micro_batches, [logps[rows] for rows in split], **settings)
        assert got == pytest.approx(want, abs=1e-5), (len(split), want, got)
        for w, o in zip(want_grads, got_grads):
            torch.testing.assert_close(o, w, atol=1e-5, rtol=0)
        for name, value in got_metrics.items():
            assert value == pytest.approx(want_metrics[name], abs=1e-5), name
        assert {"kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"} - set(got_metrics) \
            == ({"kl"} if not beta else set())
    if with_old:  # the case exercises both clips
        assert want_metrics["clip_ratio/low_mean"] > 0 and want_metrics["clip_ratio/high_mean"] > 0


def test_model_gradients_equal_trl(trl):
    """Through the model unchanged (dapo, beta 0.04, old log-probabilities given): TRL's ``_compute_loss`` and ours on
    TRL's own log-probabilities give the same parameter gradients."""
    trainer, model, inputs = trl["trainer"], trl["model"], dict(trl["inputs"])
    logps = _trl_logps(trainer, inputs)
    g = torch.Generator().manual_seed(3)
    inputs["old_per_token_logps"] = logps + 0.4 * torch.randn(logps.shape, generator=g)
    inputs["ref_per_token_logps"] = logps + 0.5 * torch.randn(logps.shape, generator=g)
    mask = inputs["completion_mask"]
    inputs["num_items_in_batch"] = mask.sum()
    _set(trainer, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, beta=0.04, kl_ratio=True, accumulation=1)
    model.zero_grad()
    want = trainer._compute_loss(model, inputs)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attn = torch.cat([inputs["prompt_mask"], mask], dim=1)
    x = trainer._get_per_token_logps_and_entropies(model, ids, attn, MAX_NEW)[0]
    out = token_losses(x, inputs["old_per_token_logps"], inputs["advantages"], mask, epsilon_low=0.2,
                       epsilon_high=0.28, beta=0.04, ref_logps=inputs["ref_per_token_logps"])
    num, unit = reduce_loss(out["loss"], mask, "dapo", max_completion_length=MAX_NEW)
    got = num / mask.sum()
    got.backward()
    assert unit == "tokens" and float(got.detach()) == pytest.approx(float(want.detach()), abs=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], atol=1e-5, rtol=0, msg=n)
    model.zero_grad()


REWARDS = {  # 3 groups of G: ties, a zero-std group; with None: a row no function scored, a group with one reward
    "ties": [0.5, 0.5, 0.5, 0.5, 0.0, 1.0, 1.0, 0.0, 0.3, -1.2, 2.0, 0.3],
    "none": [1.0, None, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, None, 0.7, None, None],
}


@pytest.mark.parametrize("rewards", list(REWARDS))
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl(trl, scale, rewards):
    """TRL's ``_generate_and_score_completions`` (it samples 3 x 4 completions, then the reward function returns
    the preset rewards): its advantages and its logged reward, reward_std and frac_reward_zero_std equal ours."""
    trainer = trl["trainer"]
    trainer.scale_rewards, trainer.beta = scale, 0.0  # beta 0: no reference pass (the trainer was built without one)
    trainer._metrics["train"].clear()
    PRESET["rewards"] = REWARDS[rewards]
    prompts = [{"prompt": p} for p in ("1 + 1 =", "Name a colour:", "Hello") for _ in range(G)]
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(prompts)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    total = torch.tensor([float("nan") if r is None else r for r in REWARDS[rewards]])
    advantages, stats = group_advantages(total, G, scale)
    torch.testing.assert_close(advantages, out["advantages"], atol=1e-6, rtol=0)
    for k in ("reward", "reward_std", "frac_reward_zero_std"):
        assert stats[k] == pytest.approx(logged[k], abs=1e-6, nan_ok=True), k
    assert stats["frac_reward_zero_std"] == pytest.approx({"group": 1 / 3, "none": 1 / 3, "batch": 0.0}[scale])


def test_group_advantages_by_hand():
    """Two groups of 3 worked by hand: group means 2 and 5, group stds 1 and 0, the six rewards' std sqrt(15.5 / 5)
    (Bessel's correction throughout)."""
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv, stats = group_advantages(r, 3, "none")
    assert adv.tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert stats == pytest.approx({"reward": 3.5, "reward_std": (15.5 / 5) ** 0.5, "frac_reward_zero_std": 0.5})
    adv, _ = group_advantages(r, 3, "group")
    torch.testing.assert_close(adv, torch.tensor([-1, 0, 1, 0, 0, 0]) / (1 + 1e-4))
    adv, _ = group_advantages(r, 1, "group")  # one completion per prompt: no signal, as in TRL
    assert adv.tolist() == [0.0] * 6


def test_bad_input_names_the_value():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="scale='std'"):
        group_advantages(torch.zeros(4), 2, "std")
    with pytest.raises(ValueError, match="beta=0.1 needs ref_logps"):
        token_losses(x, None, torch.zeros(2), x, beta=0.1)
    with pytest.raises(ValueError, match="advantages has shape"):
        token_losses(x, None, torch.zeros(3), x)
    with pytest.raises(ValueError, match="loss_type='cispo'"):
        reduce_loss(x, x, "cispo")
    with pytest.raises(ValueError, match="max_completion_length"):
        reduce_loss(x, x, "dr_grpo")
