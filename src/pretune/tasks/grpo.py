"""Reinforcement learning from verifiable rewards: GRPO (Shao et al. 2024), as TRL's ``GRPOTrainer`` computes it.

A record is a prompt and whatever fields its reward functions read (TRL's format):

    {"prompt": "What is 12 + 30? Answer after ####.", "answer": "42"}     a string, used as written (no chat
                                                                            template unless ``task.chat=true``)
    {"prompt": [{"role": "user", "content": "..."}], "answer": "42"}       messages, rendered with the checkpoint's
                                                                            chat template and its generation prompt

Each optimizer step is one *rollout* and one update. The rollout (:meth:`GRPO.rollout`, which the trainer calls on
the step's prompts before the loss) samples ``G = task.group_size`` completions of every prompt with the model as it
is (pretune's batched generator: KV cache, the fast decoding path, the adapter unmerged; temperature / top-p), scores
each with the reward functions (tasks/rewards.py: the weighted sum of ``task.rewards``), and turns the scores into
group-normalised advantages ``A = (r - mean_group(r)) / (std_group(r) + 1e-4)`` (``task.scale_rewards``: ``batch``
takes the std over the whole step, ``none`` does not divide: Dr. GRPO). The update maximises the clipped surrogate
per completion token (tasks/policy_gradient.py)

    min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) - beta KL(pi || pi_ref),   rho = pi(t) / pi_old(t)

normalised by ``task.loss_type``: ``dapo`` (TRL's default) over every completion token of the step, ``grpo`` per
completion then over completions, ``dr_grpo`` over completions x ``task.max_new_tokens``. With one update per rollout
pi_old is the policy itself (rho = 1, its gradient that of A log pi); ``task.num_iterations`` = mu > 1 trains mu
optimizer steps on each rollout (TRL's ``num_iterations``), pi_old the policy that sampled it, its log-probabilities
kept with the rollout (the trainer keeps the rollout in its checkpoints, so a resumed run continues bitwise).
``task.kl_beta > 0`` (TRL's ``beta``) adds
TRL's k3 estimate of the KL (times rho, TRL's ``use_bias_correction_kl``) to the reference (the adapter switched
off, or a frozen copy of the starting weights) and a reference pass per step; 0 (TRL's default) needs none.
Log-probabilities are taken at the sampling temperature (logits / T), as TRL takes them.

Sampling is seeded by (train.seed, step, process, micro-batch), so a run samples the same completions every time
and a resumed run continues exactly where it stopped. Dev and test decode greedily (one completion per prompt) and
report the mean of each reward and their weighted total (``reward``, the dev metric).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from ..config import ConfigError
from ..data.readers import DataError
from ..generation.decode import generate
from ..generation.scoring import lead_ids
from ..model.layout import IGNORE, layout_of
from .base import Record, Task, TaskConfig, get_field
from .dpo import ChatPrompts, completion_rows
from .policy_gradient import group_advantages, reduce_loss, token_losses
from .rewards import build_rewards, check_records, compute_rewards
from .sft import chat_template, stop_ids


@dataclass
class GRPOSettings(TaskConfig):
    """grpo: the prompt, the reward functions and their settings, sampling, and the policy-gradient loss."""

    prompt_field: str = "prompt"  # the prompt (a string, or a list of messages); other fields go to the rewards
    chat: bool = False  # a prompt string becomes a user turn of the chat template
    system: str = ""  # a system message put before each conversation that has none
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])  # reward functions (--reward NAME,
    # repeatable): exact_match, format, length, or module:function (TRL's signature, imported from your code)
    reward_weights: list[float] = field(default_factory=list)  # one weight per reward, in order; empty: all 1
    answer_field: str = "answer"  # exact_match: the record's gold answer
    answer_regex: str = ""  # exact_match: where the answer is in a completion (group 1 of the last match, e.g.
    # "####\s*(-?[0-9.,]+)"); empty: `pretune prompt`'s extraction (after "the answer is", else the last number)
    format_regex: str = ""  # format: the pattern a completion must match
    length_limit: int = 0  # length: completion tokens before the penalty starts; 0: half of task.max_new_tokens
    group_size: int = 8  # G: completions sampled per prompt (their rewards are compared with each other)
    max_new_tokens: int = 64  # completion tokens at most (TRL's max_completion_length)
    temperature: float = 1.0  # sampling temperature (the log-probabilities are taken at it too)
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens reaching this probability
    kl_beta: float = 0.0  # the weight of the KL penalty to the reference model (TRL's GRPOConfig.beta; named apart
    # from dpo's beta, whose default differs); 0 (TRL's default): no reference pass
    epsilon: float = 0.2  # the clipping range below 1 of the probability ratio
    epsilon_high: float = 0.0  # ... and above 1 (DAPO: 0.28); 0: the same as epsilon
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"  # normalisation: over the step's completion
    # tokens (TRL's default), per completion then over completions, over completions x max_new_tokens (Dr. GRPO), or
    # each micro-batch over its own tokens (TRL's bnpo)
    scale_rewards: Literal["group", "batch", "none"] = "group"  # divide advantages by the std of the group, of the
    # step's rewards, or not at all (Dr. GRPO)
    num_iterations: int = 1  # optimizer steps per rollout (TRL's num_iterations, the paper's mu): the steps after the
    # first train on the same completions, the ratio taken to the log-probabilities they were sampled with

    def validate(self) -> None:
        super().validate()
        if self.group_size < 2:
            raise ConfigError(f"task.group_size={self.group_size}: GRPO compares the completions of a prompt with "
                              "each other, so it needs at least 2")
        if self.max_new_tokens < 1:
            raise ConfigError(f"task.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.temperature > 0:
            raise ConfigError(f"task.temperature={self.temperature} must be > 0 (GRPO samples)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"task.top_p={self.top_p} must be in (0, 1]")
        if self.kl_beta < 0 or self.epsilon <= 0 or self.epsilon_high < 0:
            raise ConfigError(f"task.kl_beta={self.kl_beta}, task.epsilon={self.epsilon}, task.epsilon_high="
                              f"{self.epsilon_high}: expected kl_beta >= 0, epsilon > 0, epsilon_high >= 0")
        if self.num_iterations < 1:
            raise ConfigError(f"task.num_iterations={self.num_iterations} must be >= 1 (optimizer steps per rollout)")
        if not self.rewards:
            raise ConfigError("task.rewards is empty: give at least one reward function (--reward NAME)")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ConfigError(f"task.reward_weights has {len(self.reward_weights)} weights for "
                              f"{len(self.rewards)} rewards ({', '.join(self.rewards)}): give one per reward")


def _seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions, unlike hash())."""
    digest = hashlib.sha256(",".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class GRPO(ChatPrompts, Task):
    Settings = GRPOSettings
    name = "grpo"
    model_head = "lm"
    archs = ("decoder",)
    why = "GRPO samples completions from a decoder-only language model;"
    term = "sequences"  # the loss's units: sequences (grpo, dr_grpo), tokens (dapo) or micro_batches (bnpo)
    metrics = ("reward",)  # + the mean of each reward function (rewards/<name>) and exact_match's accuracy
    default_metric = "reward"
    DEFAULT_PROMPTS = 4  # train.batch_size left to choose: prompts a step (x group_size completions)
    DEFAULT_STEPS = 60  # train.steps left to choose

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        tok = tokenizer
        self.eos = tok.eos_id if tok.eos_id is not None else tok.sep_id
        if self.eos is None:
            raise ConfigError("task grpo needs an EOS token to end a completion; the tokenizer has none")
        self.layout = layout_of(model_cfg, "causal")
        self.lead = lead_ids(tok)
        self.template = chat_template(tok)
        self.stop_ids = stop_ids(tok, self.eos)
        c = cfg
        self.rewards = build_rewards(c.rewards, answer_field=c.answer_field, answer_regex=c.answer_regex,
                                     format_regex=c.format_regex,
                                     max_completion_tokens=c.length_limit or max(1, c.max_new_tokens // 2))
        self.weights = list(c.reward_weights) or [1.0] * len(self.rewards)
        self.names = [r.name.rpartition(":")[2] for r in self.rewards]  # as TRL names them: the function's name
        self.seen: list[Record] = []  # every encoded record; a feature carries its index ("rec")
        self.reference_model = None  # set by the job when beta > 0

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_beta > 0

    @property
    def iterations(self) -> int:
        """Optimizer steps per rollout: the trainer rolls out at every this-many-th step and trains the steps
        between on the same batches (kept in its checkpoints)."""
        return self.cfg.num_iterations

    def records(self) -> dict:
        return {"decoder_layout": "causal"}

    # -- records -> prompts ---------------------------------------------------------------------------------
    def prompt(self, rec: Record):
        """The prompt as the reward functions see it: the record's string, or its messages (TRL's forms)."""
        return get_field(rec, self.cfg.prompt_field, (str, list), what="a string, or a list of messages")

    def prompt_ids(self, rec: Record) -> list[int]:
        c = self.cfg
        prompt = self.prompt(rec)
        if isinstance(prompt, list) or c.chat:
            return self._render_ids(rec, self._prompt_messages(rec, prompt), add_generation_prompt=True)
        if not prompt.strip():
            raise DataError(f"{rec.where}: field {c.prompt_field!r} is empty")
        return self.lead + self.tok.encode(prompt)

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        ids = self.prompt_ids(rec)
        if len(ids) > self.max_len:
            raise DataError(f"{rec.where}: field {self.cfg.prompt_field!r} takes {len(ids)} tokens, more than "
                            f"task.max_len={self.max_len} (the longest prompt): raise task.max_len or shorten it")
        if len(ids) + self.cfg.max_new_tokens > self.model_cfg.max_positions:
            raise DataError(f"{rec.where}: the prompt's {len(ids)} tokens and task.max_new_tokens="
                            f"{self.cfg.max_new_tokens} exceed the model's {self.model_cfg.max_positions} positions")
        if labelled:
            check_records(self.rewards, [rec], prompt_field=self.cfg.prompt_field)
        self.seen.append(rec)
        return [{"input_ids": np.asarray(ids, dtype=np.int64), "rec": np.int64(len(self.seen) - 1)}]

    def example(self, block, rng, random_block):
        return dict(block)

    def collate(self, examples):
        """Prompts left-padded (as the generator reads them): input_ids, attention_mask (B, P); rec (B,)."""
        width = max(len(e["input_ids"]) for e in examples)
        ids = np.full((len(examples), width), self.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[i, width - n:], mask[i, width - n:] = e["input_ids"], 1
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                "rec": torch.tensor([int(e["rec"]) for e in examples])}

    def tokens_in(self, batch):
        return int(batch["attention_mask"].sum())

    # -- sampling and scoring ---------------------------------------------------------------------------------
    def _complete(self, model, batch, *, n: int, sample: bool, seed: int | None) -> list[list[int]]:
        """``n`` completions of each prompt (rows grouped by prompt), each cut after its first stop token (kept, as
        TRL keeps the EOS in the completion mask)."""
        c = self.cfg
        out = generate(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=c.max_new_tokens,
                       do_sample=sample, temperature=c.temperature, top_p=c.top_p if c.top_p < 1 else None,
                       num_return_sequences=n, eos_token_id=self.stop_ids, pad_token_id=self.pad_id, seed=seed)
        stops = set(self.stop_ids)
        rows = []
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            end = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            rows.append(row[:end])
        return rows

    def _text(self, ids: list[int]) -> str:
        """A completion as the rewards read it: decoded without special tokens (TRL's batch_decode(...,
        skip_special_tokens=True))."""
        return self.tok.decode(ids, skip_special_tokens=True)

    def score_completions(self, recs: list[Record], completions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(each reward of each completion (N, F), NaN where a function said None; the weighted total (N,)):
        ``recs[i]`` is the record completion i answers."""
        prompts = [self.prompt(r) for r in recs]
        texts = [self._text(ids) for ids in completions]
        shown = [[{"role": "assistant", "content": t}] if isinstance(p, list) or self.cfg.chat else t
                 for p, t in zip(prompts, texts)]
        return compute_rewards(self.rewards, self.weights, prompts, shown, recs, completions,
                               prompt_field=self.cfg.prompt_field)

    def token_logps(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probability of each labelled token at the sampling temperature, its mask): two (N, T-1) tensors;
        only the labelled positions go through the LM head."""
        h, targets = self.layout.lm_inputs(model, batch)
        keep = targets != IGNORE
        logp = model.head.token_logprobs(h[keep], targets[keep], self.cfg.temperature)  # (fast head: in row chunks)
        n, t = batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1
        out = torch.zeros(n * t, device=logp.device, dtype=logp.dtype)
        out[keep] = logp
        return out.view(n, t), keep.view(n, t)

    @torch.no_grad()
    def rollout(self, model, batches: list[dict], *, step: int, seed: int, rank: int = 0,
                world: int = 1) -> tuple[list[dict], dict]:
        """The step's prompts (micro-batches of this process) -> the batches the loss trains on, and the step's
        rollout metrics (TRL's names and order, over every process's completions)."""
        G = self.cfg.group_size
        made = []
        for j, b in enumerate(batches):
            rows = self._complete(model, b, n=G, sample=True, seed=_seed(seed, step, rank, j))
            recs = [self.seen[int(i)] for i in b["rec"].tolist() for _ in range(G)]
            made.append((b, rows, recs))
        per_func, total = self.score_completions([r for _, _, rs in made for r in rs],
                                                 [x for _, rows, _ in made for x in rows])
        lengths = torch.tensor([len(x) for _, rows, _ in made for x in rows], dtype=torch.float32)
        clipped = torch.tensor([float(x[-1] not in self.stop_ids) for _, rows, _ in made for x in rows])
        local = torch.cat([per_func, total[:, None], lengths[:, None], clipped[:, None]], dim=1)
        # (all completions of the step, F + 3), in process order: groups never span processes
        every = torch.cat(self.dist.all_gather(local)) if world > 1 else local
        adv_all, stats = group_advantages(every[:, -3], G, self.cfg.scale_rewards)
        n_local = local.shape[0]
        mine = rank if world > 1 else 0  # this process's rows of the gathered ones
        advantages = adv_all[mine * n_local:(mine + 1) * n_local]
        out = []
        start = 0
        for b, rows, _ in made:
            prompts = [b["input_ids"][i][b["attention_mask"][i] == 1].tolist() for i in range(len(b["rec"]))]
            seqs = [prompts[i // G] + rows[i] for i in range(len(rows))]
            batch = completion_rows([np.asarray(s) for s in seqs], [len(prompts[i // G]) for i in range(len(rows))],
                                    self.pad_id)
            batch["advantages"] = advantages[start:start + len(rows)].float()
            start += len(rows)
            if self.needs_reference:
                with self.reference_model(model) as ref:
                    batch["ref_logps"], _ = self.token_logps(ref, batch)
            if self.cfg.num_iterations > 1:  # later steps take the ratio to the policy that sampled (TRL's old logps)
                was_training = model.training
                model.train()  # as the loss will see it
                batch["old_logps"], _ = self.token_logps(model, batch)
                model.train(was_training)
            out.append(batch)
        metrics = {"reward": stats["reward"], "reward_std": stats["reward_std"]}
        for k, name in enumerate(self.names):
            col = every[:, k]
            metrics[f"rewards/{name}/mean"] = float(torch.nanmean(col))
            metrics[f"rewards/{name}/std"] = _nanstd(col)
        metrics["frac_reward_zero_std"] = stats["frac_reward_zero_std"]
        metrics["completions/mean_length"] = float(every[:, -2].mean())
        metrics["completions/max_length"] = float(every[:, -2].max())
        metrics["completions/clipped_ratio"] = float(every[:, -1].mean())
        return out, metrics

    # -- the loss ---------------------------------------------------------------------------------------------
    def counts(self, batch):
        if "advantages" not in batch:  # prompts not yet rolled out: the trainer calls rollout first
            raise ConfigError("task grpo trains on completions it samples itself: its batches go through "
                              "GRPO.rollout before the loss (pretune finetune's trainer does this)")
        mask = batch["labels"][:, 1:] != IGNORE  # policy_gradient.LOSS_UNITS
        return {"sequences": int(mask.shape[0]), "tokens": int(mask.sum()), "micro_batches": 1}

    def loss(self, model, batch, totals):
        c = self.cfg
        logps, mask = self.token_logps(model, batch)
        terms = token_losses(logps, batch.get("old_logps"), batch["advantages"], mask, epsilon_low=c.epsilon,
                             epsilon_high=c.epsilon_high or c.epsilon, beta=c.kl_beta, ref_logps=batch.get("ref_logps"))
        numerator, unit = reduce_loss(terms["loss"], mask, c.loss_type, max_completion_length=c.max_new_tokens)
        # "{unit}:{name}": a sum the trainer divides by the step's total of that unit (TRL's token means)
        stats = {"tokens:clip_ratio/low_mean": float(terms["clip_low"].sum()),
                 "tokens:clip_ratio/high_mean": float(terms["clip_high"].sum()),
                 "tokens:clip_ratio/region_mean": float(terms["clip_region"].sum())}
        if c.kl_beta > 0:
            stats = {"tokens:kl": float(terms["kl"].sum()), **stats}
        return numerator / totals[unit], stats

    # -- evaluation -------------------------------------------------------------------------------------------
    def outputs(self, model, batch):
        return self._complete(model, batch, n=1, sample=False, seed=None)

    def predict(self, records, features, outputs):
        first: dict[int, list[int]] = {}
        for f, o in zip(features, outputs):
            first.setdefault(f["_record"], o)
        ids = [first[i] for i in range(len(records))]
        per_func, total = self.score_completions(list(records), ids)
        preds = []
        for i, row in enumerate(ids):
            rewards = {name: (None if torch.isnan(per_func[i, k]) else float(per_func[i, k]))
                       for k, name in enumerate(self.names)}
            preds.append({"completion": self._text(row), "reward": float(total[i]), "rewards": rewards})
        return preds

    def reference(self, rec: Record):
        return None  # the rewards judge a completion; predict has scored it

    def score(self, predictions, references):
        if not predictions:
            return {}
        out = {"reward": float(np.mean([p["reward"] for p in predictions]))}
        for r, name in zip(self.rewards, self.names):
            vals = [p["rewards"][name] for p in predictions if p["rewards"][name] is not None]
            if vals:
                out[f"rewards/{name}"] = float(np.mean(vals))
            if r.name == "exact_match" and vals:
                out["accuracy"] = float(np.mean([v == 1.0 for v in vals]))
        return out

    def prediction_json(self, rec, pred):
        return dict(pred)


def _nanstd(col: torch.Tensor) -> float:
    """TRL's nanstd: the unbiased std over the values that are not NaN."""
    vals = col[~torch.isnan(col)]
    return float(vals.std()) if len(vals) > 1 else float("nan")
