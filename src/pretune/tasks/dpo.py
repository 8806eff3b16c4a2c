"""Preference tuning of decoder-only language models on pairs (DPO and its variants), as TRL's trainers compute it.

A record is TRL's paired preference format (field names are settings):

    {"prompt": "...", "chosen": "...", "rejected": "..."}          strings, used as written: the prompt tokenized
                                                                     alone, then with each completion and EOS; the
                                                                     completion starts where the two part (TRL's
                                                                     ``common_prefix_length``). ``task.chat=true``:
                                                                     a user and an assistant turn of the chat template
    {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}
                                                                     rendered with the checkpoint's chat template as
                                                                     SFT renders it (tasks/sft.py), tokenized whole

Each pair is one feature; a batch is laid out as TRL lays it: the B chosen sequences, then the B rejected ones, in
one forward pass. A completion's log-probability is the sum of its tokens' (SimPO and ORPO: the mean, as TRL's CPO
and ORPO trainers take it). With ``r = beta * (log pi(y|x) - log pi_ref(y|x))`` (the implicit reward) and
``d = r_chosen - r_rejected``, per pair (``task.loss``):

    sigmoid  -(1 - eps) log sigmoid(d) - eps log sigmoid(-d)          DPO (Rafailov et al. 2023); eps: label_smoothing
    hinge    relu(1 - d)                                               SLiC (Zhao et al. 2023)
    ipo      (d_avg / beta - 1 / (2 beta))^2, log-ratios per token     IPO (Azar et al. 2023), TRL's normalisation
    simpo    -log sigmoid(beta (avg logp_c - avg logp_r) - gamma)      SimPO (Meng et al. 2024), no reference
    orpo     NLL(chosen) - beta log sigmoid(log odds_c - log odds_r)   ORPO (Hong et al. 2024), no reference

The reference model is given by the job (:attr:`DPO.reference_model`): the base with the adapter switched off when an
adapter trains, a frozen copy of the starting weights under full finetuning. Evaluation scores each pair (the
policy's and the reference's log-probabilities) and reports the mean per-pair ``loss``, ``pref_accuracy`` (the
chosen reward above the rejected one; a tie is wrong, as in TRL) and ``margin``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..data.readers import DataError
from ..generation.prompt import PromptError, apply_chat_template
from ..generation.scoring import lead_ids
from ..model.layout import IGNORE, layout_of
from .base import Record, Task, TaskConfig, get_field
from .sft import chat_template

REFERENCE_FREE = ("simpo", "orpo")  # losses that need no reference model
MEAN_LOGPS = ("simpo", "orpo")  # losses on the mean token log-probability of a completion (TRL's CPO, ORPO)


@dataclass
class DPOSettings(TaskConfig):
    """dpo: the record's fields, how the pair is rendered, and the preference loss."""

    prompt_field: str = "prompt"  # the prompt (a string, or a list of messages)
    chosen_field: str = "chosen"  # the preferred completion (a string, or a list of assistant messages)
    rejected_field: str = "rejected"  # the dispreferred completion (same form as chosen)
    chat: bool = False  # prompt/completion strings become a user and an assistant turn of the chat template
    system: str = ""  # a system message put before each conversation that has none
    loss: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"] = "sigmoid"  # the preference loss (module docstring);
    # simpo and orpo need no reference model (half the forward passes), the others keep the policy near it
    beta: float = 0.1  # sigmoid/hinge/ipo: the KL strength (higher: stay nearer the reference); simpo: reward
    # scale; orpo: the weight of the odds-ratio term (lambda). TRL's default
    label_smoothing: float = 0.0  # sigmoid/simpo: the assumed probability that a pair's preference is flipped
    # (conservative DPO, Mitchell 2023); 0: trust every label
    simpo_gamma: float = 0.5  # simpo: the target reward margin gamma (TRL's CPO default)
    precompute_reference: bool = False  # the reference's log-probabilities of the training pairs computed once
    # before training and kept in the run folder (reference_logps.safetensors): no reference pass per step

    def validate(self) -> None:
        super().validate()
        if not self.beta > 0:
            raise ConfigError(f"task.beta={self.beta} must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"task.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.label_smoothing and self.loss not in ("sigmoid", "simpo"):
            raise ConfigError(f"task.label_smoothing={self.label_smoothing} applies to task.loss=sigmoid or simpo; "
                              f"task.loss={self.loss} has none")
        if self.simpo_gamma != 0.5 and self.loss != "simpo":
            raise ConfigError(f"task.simpo_gamma={self.simpo_gamma} applies to task.loss=simpo, not {self.loss}")
        if self.precompute_reference and self.loss in REFERENCE_FREE:
            raise ConfigError(f"task.precompute_reference=true: task.loss={self.loss} uses no reference model")


Reference = Callable[[torch.nn.Module], AbstractContextManager[torch.nn.Module]]  # policy -> reference


def pair_losses(loss: str, *, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                ref_rejected: torch.Tensor | None, n_chosen: torch.Tensor, n_rejected: torch.Tensor) -> dict:
    """Per-pair preference losses and implicit rewards, as TRL computes them.

    Args:
        loss: a ``task.loss`` value; beta, label_smoothing, simpo_gamma: its settings.
        chosen, rejected: (B,) summed log-probabilities of each completion under the policy.
        ref_chosen, ref_rejected: (B,) the same under the reference (None for simpo and orpo).
        n_chosen, n_rejected: (B,) completion tokens (EOS included).
    Returns:
        {"loss": (B,) the preference term, "chosen_reward", "rejected_reward": (B,), "logp_chosen",
        "logp_rejected": (B,) the log-probabilities the loss reads (means for simpo and orpo), and for orpo
        "log_odds", "ratio" (log sigmoid of the log odds ratio)}.
    """
    out: dict = {}
    if loss in MEAN_LOGPS:
        chosen, rejected = chosen / n_chosen, rejected / n_rejected  # TRL: average_log_prob=True
        out["chosen_reward"], out["rejected_reward"] = beta * chosen.detach(), beta * rejected.detach()
        if loss == "simpo":  # TRL's CPOTrainer.cpo_loss, loss_type="simpo"
            z = beta * (chosen - rejected) - simpo_gamma
            out["loss"] = -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing
        else:  # TRL's ORPOTrainer.odds_ratio_loss: log odds = log p - log(1 - p), p the mean token probability
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            out["ratio"], out["log_odds"] = F.logsigmoid(log_odds), log_odds
            out["loss"] = -beta * out["ratio"]
    else:
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected  # log pi / pi_ref
        out["chosen_reward"], out["rejected_reward"] = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
        delta = chosen_ratio - rejected_ratio
        if loss == "sigmoid":
            z = beta * delta
            out["loss"] = -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing
        elif loss == "hinge":
            out["loss"] = torch.relu(1 - beta * delta)
        elif loss == "ipo":  # TRL: the log-ratios per completion token (confirmed with the IPO authors)
            d = chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1)
            out["loss"] = (d - 1 / (2 * beta)) ** 2
        else:
            raise ConfigError(f"task.loss={loss!r} is not a preference loss")
    out["logp_chosen"], out["logp_rejected"] = chosen, rejected
    return out


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012; TRL's log1mexp)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


class ChatPrompts:
    """A prompt rendered with the task's chat template (``self.template``), as SFT renders it: what the tasks whose
    records carry a prompt as a string or as messages share (dpo, kto, reward, grpo; their settings have
    ``prompt_field`` and ``system``)."""

    def _prompt_messages(self, rec: Record, prompt) -> list[dict]:
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if self.cfg.system and not (msgs and isinstance(msgs[0], dict) and msgs[0].get("role") == "system"):
            msgs = [{"role": "system", "content": self.cfg.system}] + msgs
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{rec.where}: field {self.cfg.prompt_field!r}, message {i} is {m!r:.80}; expected "
                                "{'role': str, 'content': str}")
        return msgs

    def _render_ids(self, rec: Record, msgs: list[dict], *, add_generation_prompt: bool) -> list[int]:
        try:
            text = apply_chat_template(self.template, msgs, add_generation_prompt=add_generation_prompt)
        except PromptError as e:
            raise DataError(f"{rec.where}: {e}") from None
        return list(self.tok.tk.encode(text, add_special_tokens=False).ids)  # as a whole, as SFT and TRL do


class DPO(ChatPrompts, Task):
    Settings = DPOSettings
    name = "dpo"
    model_head = "lm"
    archs = ("decoder",)
    why = "preference tuning compares the log-probabilities a decoder-only language model gives two completions;"
    term = "pref"  # the loss term in logs: pref_loss, pref_acc (the preference accuracy of the implicit reward)
    metrics = ("loss", "pref_accuracy", "margin")
    default_metric = "pref_accuracy"

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        tok = tokenizer
        self.eos = tok.eos_id if tok.eos_id is not None else tok.sep_id
        if self.eos is None:
            raise ConfigError("task dpo needs an EOS token to end each completion; the tokenizer has none")
        self.eos_text = tok.id_to_token(self.eos)
        self.layout = layout_of(model_cfg, "causal")
        self.lead = lead_ids(tok)
        self.template = chat_template(tok)
        self.truncated = 0  # pairs whose completions were cut at task.max_len (their end): reported by prepare
        self.reference_model: Reference | None = None  # set by the job when the loss needs a reference

    @property
    def needs_reference(self) -> bool:
        return self.cfg.loss not in REFERENCE_FREE

    def records(self) -> dict:
        return {"decoder_layout": "causal"}

    # -- records -> token ids ---------------------------------------------------------------------------------
    def _completion(self, rec: Record, name: str, conversation: bool) -> str | list[dict]:
        value = get_field(rec, name, (str, list), what="a completion: a string, or a list of assistant messages")
        if isinstance(value, str):
            if not value.strip():
                raise DataError(f"{rec.where}: field {name!r} is an empty completion; a pair needs text on both sides")
            return [{"role": "assistant", "content": value}] if conversation else value
        if not conversation:
            raise DataError(f"{rec.where}: field {name!r} is a list of messages but the prompt is a string; give "
                            "both as strings, or the prompt as a list of messages")
        if not value:
            raise DataError(f"{rec.where}: field {name!r} is an empty list; expected the assistant's message(s)")
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("content"), str)):
                raise DataError(f"{rec.where}: field {name!r}, message {i} is {m!r:.80}; expected {{'role': "
                                "'assistant', 'content': str}")
        if not any(m["content"].strip() for m in value):
            raise DataError(f"{rec.where}: field {name!r} is an empty completion; a pair needs text on both sides")
        return value

    def pair_ids(self, rec: Record) -> tuple[list[int], list[int], list[int]]:
        """(prompt, chosen, rejected) token ids of a record, untruncated: TRL's tokenization (the prompt alone,
        then prompt + completion; the completion starts where they part)."""
        c = self.cfg
        prompt = get_field(rec, c.prompt_field, (str, list), what="a string, or a list of messages")
        conversation = isinstance(prompt, list) or c.chat
        chosen = self._completion(rec, c.chosen_field, conversation)
        rejected = self._completion(rec, c.rejected_field, conversation)
        if chosen == rejected:
            raise DataError(f"{rec.where}: fields {c.chosen_field!r} and {c.rejected_field!r} are identical; a pair "
                            "must prefer one completion to a different one")
        if conversation:
            msgs = self._prompt_messages(rec, prompt)
            p = self._render_ids(rec, msgs, add_generation_prompt=True)
            full = [self._render_ids(rec, msgs + y, add_generation_prompt=False) for y in (chosen, rejected)]
        else:
            if not prompt.strip():
                raise DataError(f"{rec.where}: field {c.prompt_field!r} is empty")
            p = self.lead + self.tok.encode(prompt)
            # TRL appends the EOS text when the completion does not end with it (it tokenizes to the EOS id)
            full = [self.lead + self.tok.encode(prompt + y) + ([] if y.endswith(self.eos_text) else [self.eos])
                    for y in (chosen, rejected)]
        n = min(_common_prefix(p, full[0]), _common_prefix(p, full[1]))
        return p[:n], full[0][n:], full[1][n:]

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        prompt, chosen, rejected = self.pair_ids(rec)
        if len(prompt) >= self.max_len:
            raise DataError(f"{rec.where}: field {self.cfg.prompt_field!r} takes {len(prompt)} tokens, the whole "
                            f"context of task.max_len={self.max_len}: no room is left for the completions. Raise "
                            f"task.max_len (the model reads up to {self.model_cfg.max_positions} tokens) or shorten "
                            "the prompt")
        cut = len(prompt) + max(len(chosen), len(rejected)) > self.max_len
        self.truncated += cut  # TRL's truncation_mode="keep_start": the completions lose their end
        ids = [np.asarray((prompt + y)[: self.max_len], dtype=np.int64) for y in (chosen, rejected)]
        return [{"input_ids": ids[0], "rejected_ids": ids[1], "prompt_len": np.int64(len(prompt))}]

    def collate(self, examples):
        """B pairs -> 2B rows (the chosen sequences, then the rejected ones; TRL's layout), right-padded:
        input_ids, attention_mask and labels (-100 on the prompt and the padding), each (2B, T)."""
        rows = [e["input_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
        out = completion_rows(rows, [int(e["prompt_len"]) for e in examples] * 2, self.pad_id)
        if "ref_logps" in examples[0]:  # task.precompute_reference: (B, 2), the reference's chosen and rejected
            out["ref_logps"] = torch.from_numpy(np.stack([e["ref_logps"] for e in examples]))
        return out

    # -- model side -------------------------------------------------------------------------------------------
    def counts(self, batch):
        pairs = batch["input_ids"].shape[0] // 2
        out = {self.term: pairs}
        if self.cfg.loss == "orpo":  # ORPO's NLL: the mean over the batch's chosen completion tokens (TRL)
            out["nll"] = int((batch["labels"][:pairs, 1:] != IGNORE).sum())
        return out

    def sequence_logps(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed log-probability of each row's labelled tokens, their number): two (2B,) tensors, fp32. Only the
        labelled positions go through the LM head."""
        h, targets = self.layout.lm_inputs(model, batch)  # (2B * (T-1), dim), (2B * (T-1),)
        rows = torch.arange(batch["input_ids"].shape[0], device=targets.device)
        rows = rows.repeat_interleave(batch["input_ids"].shape[1] - 1)  # the row of each position
        keep = targets != IGNORE
        logp = model.head.token_logprobs(h[keep], targets[keep])  # (n labelled,), in row chunks (fast head)
        zeros = torch.zeros(batch["input_ids"].shape[0], device=logp.device)
        sums = zeros.index_add(0, rows[keep], logp)
        counts = zeros.index_add(0, rows[keep], torch.ones_like(logp))
        return sums, counts

    def reference_logps(self, model, batch) -> torch.Tensor | None:
        """(2B,) summed log-probabilities under the reference model (None for a reference-free loss)."""
        if not self.needs_reference:
            return None
        if "ref_logps" in batch:  # task.precompute_reference: computed before training (jobs/finetune/reference.py)
            return torch.cat([batch["ref_logps"][:, 0], batch["ref_logps"][:, 1]]).float()
        if self.reference_model is None:
            raise ConfigError(f"task.loss={self.cfg.loss} compares the policy with a reference model and none was "
                              "given (pretune finetune gives one); use a reference-free loss (task.loss=simpo or "
                              "orpo) or score the pairs through `pretune finetune`")
        with torch.no_grad(), self.reference_model(model) as ref:
            sums, _ = self.sequence_logps(ref, batch)
        return sums

    def pair_terms(self, model, batch) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """(the per-pair losses and rewards of :func:`pair_losses`, the policy's summed log-probabilities and the
        token counts of the 2B rows)."""
        sums, counts = self.sequence_logps(model, batch)
        ref = self.reference_logps(model, batch)
        B = sums.shape[0] // 2
        c = self.cfg
        terms = pair_losses(c.loss, beta=c.beta, label_smoothing=c.label_smoothing, simpo_gamma=c.simpo_gamma,
                            chosen=sums[:B], rejected=sums[B:], ref_chosen=None if ref is None else ref[:B],
                            ref_rejected=None if ref is None else ref[B:], n_chosen=counts[:B], n_rejected=counts[B:])
        terms["ref"] = ref
        return terms, sums, counts

    def loss(self, model, batch, totals):
        terms, sums, counts = self.pair_terms(model, batch)
        B = sums.shape[0] // 2
        pref = terms["loss"].sum()
        loss = pref / totals[self.term]
        margins = terms["chosen_reward"] - terms["rejected_reward"]
        t = self.term
        stats = {f"{t}_loss": float(pref.detach()), f"{t}_correct": float((margins > 0).sum()),
                 # "{term}:{name}": a sum over the term's pairs, logged as the mean under name (TRL's names)
                 f"{t}:rewards/chosen": float(terms["chosen_reward"].sum()),
                 f"{t}:rewards/rejected": float(terms["rejected_reward"].sum()),
                 f"{t}:rewards/margins": float(margins.sum()),
                 f"{t}:rewards/accuracies": float((margins > 0).sum()),
                 f"{t}:logps/chosen": float(terms["logp_chosen"].detach().sum()),
                 f"{t}:logps/rejected": float(terms["logp_rejected"].detach().sum())}
        if self.cfg.loss == "orpo":  # + the chosen completions' NLL, a mean over their tokens (TRL's ORPOTrainer)
            nll = -sums[:B].sum()
            loss = loss + nll / totals["nll"]
            stats["nll_loss"] = float(nll.detach())
            stats[f"{t}:log_odds_ratio"] = float(terms["ratio"].detach().sum())
            stats[f"{t}:log_odds_chosen"] = float(terms["log_odds"].detach().sum())
        return loss, stats

    # -- evaluation -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def outputs(self, model, batch):
        """Per pair: (policy log p chosen, rejected, reference log p chosen, rejected (nan without a reference),
        chosen tokens, rejected tokens), summed log-probabilities in fp32."""
        sums, counts = self.sequence_logps(model, batch)
        ref = self.reference_logps(model, batch)
        ref = torch.full_like(sums, float("nan")) if ref is None else ref
        B = sums.shape[0] // 2
        cols = torch.stack([sums[:B], sums[B:], ref[:B], ref[B:], counts[:B], counts[B:]], dim=1)  # (B, 6)
        return list(cols.double().cpu().numpy())

    def predict(self, records, features, outputs):
        out = np.stack(outputs)  # (pairs, 6)
        t = torch.from_numpy(out)
        c = self.cfg
        terms = pair_losses(c.loss, beta=c.beta, label_smoothing=c.label_smoothing, simpo_gamma=c.simpo_gamma,
                            chosen=t[:, 0], rejected=t[:, 1], ref_chosen=t[:, 2], ref_rejected=t[:, 3],
                            n_chosen=t[:, 4], n_rejected=t[:, 5])
        loss = terms["loss"] + (-t[:, 0] / t[:, 4] if c.loss == "orpo" else 0)  # ORPO: + the chosen's mean NLL
        preds = []
        for i in range(len(out)):
            rc, rr = float(terms["chosen_reward"][i]), float(terms["rejected_reward"][i])
            preds.append({"preferred": "chosen" if rc > rr else "rejected", "reward_chosen": rc, "reward_rejected": rr,
                          "margin": rc - rr, "loss": float(loss[i]), "logp_chosen": float(out[i, 0]),
                          "logp_rejected": float(out[i, 1])})
        return preds

    def reference(self, rec: Record):
        return "chosen"  # the record says which completion is preferred

    def score(self, predictions, references):
        if not predictions:
            return {}
        return {"loss": float(np.mean([p["loss"] for p in predictions])),
                "pref_accuracy": float(np.mean([p["preferred"] == r for p, r in zip(predictions, references)])),
                "margin": float(np.mean([p["margin"] for p in predictions]))}

    def prediction_json(self, rec, pred):
        return dict(pred)


def completion_rows(rows, prompt_lens, pad_id: int) -> dict[str, torch.Tensor]:
    """Token rows right-padded into input_ids, attention_mask and labels (-100 on each row's first ``prompt_lens[i]``
    tokens, its prompt, and on the padding), each (len(rows), longest row): the batch dpo, kto and reward train on."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    labels = np.full_like(ids, IGNORE)
    for i, (r, n) in enumerate(zip(rows, prompt_lens)):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
        labels[i, n: len(r)] = r[n:]
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
            "labels": torch.from_numpy(labels)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
