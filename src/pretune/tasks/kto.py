"""Preference tuning of decoder-only language models on unpaired feedback (KTO), as TRL's KTOTrainer computes it.

A record is TRL's unpaired preference format (field names are settings):

    {"prompt": "...", "completion": "...", "label": true}          strings, used as written (as dpo's pairs: the
                                                                    prompt tokenized alone, then with the completion
                                                                    and EOS; ``task.chat=true``: a user and an
                                                                    assistant turn of the chat template)
    {"prompt": [messages], "completion": [assistant messages], "label": false}
                                                                    rendered with the checkpoint's chat template

``label`` is a JSON boolean (true: a desirable completion; a CSV cell may say true / false). A completion's
log-probability is the sum of its tokens'. With ``r = log pi(y|x) - log pi_ref(y|x)`` and the reference point
``z0 = max(0, mean over the batch of log pi(y'|x) - log pi_ref(y'|x))``, where ``y'`` is a mismatched completion
(TRL's: the completions rotated by one within the batch, ``(x_i, y_{i-1})``; no gradient flows through z0):

    desirable    w_d (1 - sigmoid(beta (r - z0)))                   KTO (Ethayarajh et al. 2024, eq. 7);
    undesirable  w_u (1 - sigmoid(beta (z0 - r)))                   w_d, w_u: task.desirable_weight / undesirable_weight

and the loss is the mean over the batch's records. The reference model is given by the job, as for dpo (the base with
the adapter switched off, or a frozen copy of the starting weights). z0 is estimated on each micro-batch, so a
micro-batch needs at least two records; under torchrun, as TRL's KTOTrainer does (``gather_for_metrics(kl).mean()``),
the processes' estimates of their micro-batches (all of one size) are averaged by a detached all-reduce, and the mean
is clamped at 0. With one micro-batch per process (``train.grad_accum=1``) z0 thus averages over the global batch's
records as one process does, though each process rotates the mismatched rows within its own records
(``task.precompute_reference=true`` fixes them by data order, which makes two processes train as one); with more,
it averages the j-th micro-batch of every process, records that one process spreads over other micro-batches.
Evaluation estimates z0 once over the whole file (the mismatched completions rotated within each evaluation batch;
under torchrun each process batches its share of the file, so z0 and what depends on it differ with the number of
processes, the rewards and the margin do not) and reports the mean per-record ``loss``, ``kl`` (z0), ``margin``
(the mean reward ``beta * r`` of the desirable completions less that of the undesirable ones, TRL's rewards/margins)
and ``reward_accuracy`` (a desirable completion's reward above ``beta * z0``, an undesirable one's below it: the side
of the reference point the loss pushes it to; a tie is wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import ConfigError
from ..data.readers import DataError
from .base import Record, TaskConfig, get_field
from .dpo import DPO, _common_prefix, completion_rows

LABEL_WORDS = {"true": True, "false": False}  # what a CSV cell may say for a boolean label


@dataclass
class KTOSettings(TaskConfig):
    """kto: the record's fields, how the prompt and completion are rendered, and the KTO loss's knobs."""

    prompt_field: str = "prompt"  # the prompt (a string, or a list of messages)
    completion_field: str = "completion"  # the completion (a string, or a list of assistant messages)
    label_field: str = "label"  # true: a desirable completion, false: an undesirable one
    chat: bool = False  # prompt/completion strings become a user and an assistant turn of the chat template
    system: str = ""  # a system message put before each conversation that has none
    beta: float = 0.1  # the KL strength (higher: stay nearer the reference); TRL's default
    desirable_weight: float = 1.0  # the weight of a desirable record's loss (KTO paper eq. 8: with fewer
    # desirable than undesirable records, raise it so that w_d n_d / (w_u n_u) lies in [1, 4/3])
    undesirable_weight: float = 1.0  # the weight of an undesirable record's loss
    precompute_reference: bool = False  # the reference's log-probabilities of the training records computed once
    # before training and kept in the run folder; each record's mismatched row is then fixed (the previous record's
    # completion, TRL's rotation over the data set) instead of drawn from its batch

    def validate(self) -> None:
        super().validate()
        if not self.beta > 0:
            raise ConfigError(f"task.beta={self.beta} must be > 0")
        for key in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"task.{key}={getattr(self, key)} must be > 0")


def mean_over_processes(value: torch.Tensor, dist) -> torch.Tensor:
    """The mean of ``value`` over the processes of a torchrun run, detached: ``dist`` is the job's
    ``train.dist.DistInfo`` (its ``all_gather``, handed down as to ``tasks.run.evaluate_task``; tasks import nothing
    of ``train``); ``value`` itself for one process (``dist`` None or of one process). Every process must call it,
    as often and in the same order."""
    if dist is None or not dist.enabled:
        return value
    return torch.stack(dist.all_gather(value.detach().cpu())).mean(0).to(value.device)


def kto_losses(*, beta: float, desirable_weight: float, undesirable_weight: float, logps: torch.Tensor,
               ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-record KTO losses and implicit rewards, as TRL's KTOTrainer computes them.

    Args:
        beta, desirable_weight, undesirable_weight: the task's settings.
        logps, ref_logps: (N,) summed log-probabilities of each completion under the policy and the reference.
        desirable: (N,) bool, the records' labels.
        kl: () the reference point z0 (detached, >= 0).
    Returns:
        ((N,) weighted losses, (N,) rewards ``beta * (logps - ref_logps)``, detached).
    """
    ratio = logps - ref_logps  # log pi / pi_ref
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    return losses, beta * ratio.detach()


class KTO(DPO):
    """Differs from dpo: one completion per record with a desirable/undesirable label, scored against a batch KL
    estimate instead of a paired completion (the rendering, the log-probabilities and the reference are dpo's)."""

    Settings = KTOSettings
    name = "kto"
    term = "kto"  # the loss term in logs: kto_loss
    metrics = ("loss", "kl", "reward_accuracy", "margin")
    default_metric = "reward_accuracy"

    @property
    def needs_reference(self) -> bool:
        return True

    # -- records -> token ids ---------------------------------------------------------------------------------
    def label_of(self, rec: Record) -> bool:
        """The record's label: a JSON boolean (or, from a CSV cell, the word true / false)."""
        name = self.cfg.label_field
        value = get_field(rec, name, (bool, str), what="true for a desirable completion, false for an undesirable one")
        if isinstance(value, str):
            if value.strip().lower() not in LABEL_WORDS:
                raise DataError(f"{rec.where}: field {name!r} is {value!r}; expected a boolean: true for a desirable "
                                "completion, false for an undesirable one")
            return LABEL_WORDS[value.strip().lower()]
        return value

    def _kto_completion(self, rec: Record, conversation: bool) -> str | list[dict]:
        name = self.cfg.completion_field
        value = get_field(rec, name, (str, list), what="a completion: a string, or a list of assistant messages")
        if isinstance(value, list) and not conversation:
            raise DataError(f"{rec.where}: field {name!r} is a list of messages but the prompt is a string; give "
                            "both as strings, or the prompt as a list of messages")
        if isinstance(value, list):
            for i, m in enumerate(value):
                if not (isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("content"), str)):
                    raise DataError(f"{rec.where}: field {name!r}, message {i} is {m!r:.80}; expected {{'role': "
                                    "'assistant', 'content': str}")
        text = value if isinstance(value, str) else "".join(m["content"] for m in value)
        if not text.strip():
            raise DataError(f"{rec.where}: field {name!r} is an empty completion; a record needs text to judge")
        if isinstance(value, str) and conversation:
            return [{"role": "assistant", "content": value}]
        return value

    def completion_ids(self, rec: Record) -> tuple[list[int], list[int]]:
        """(prompt, completion) token ids of a record, untruncated: TRL's tokenization (the prompt alone, then
        prompt + completion; the completion starts where they part)."""
        c = self.cfg
        prompt = get_field(rec, c.prompt_field, (str, list), what="a string, or a list of messages")
        conversation = isinstance(prompt, list) or c.chat
        completion = self._kto_completion(rec, conversation)
        if conversation:
            msgs = self._prompt_messages(rec, prompt)
            p = self._render_ids(rec, msgs, add_generation_prompt=True)
            full = self._render_ids(rec, msgs + completion, add_generation_prompt=False)
        else:
            if not prompt.strip():
                raise DataError(f"{rec.where}: field {c.prompt_field!r} is empty")
            p = self.lead + self.tok.encode(prompt)
            # TRL appends the EOS text when the completion does not end with it (it tokenizes to the EOS id)
            full = self.lead + self.tok.encode(prompt + completion) + ([] if completion.endswith(self.eos_text)
                                                                        else [self.eos])
        n = _common_prefix(p, full)
        return p[:n], full[n:]

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        prompt, completion = self.completion_ids(rec)
        if len(prompt) >= self.max_len:
            raise DataError(f"{rec.where}: field {self.cfg.prompt_field!r} takes {len(prompt)} tokens, the whole "
                            f"context of task.max_len={self.max_len}: no room is left for the completion. Raise "
                            f"task.max_len (the model reads up to {self.model_cfg.max_positions} tokens) or shorten "
                            "the prompt")
        self.truncated += len(prompt) + len(completion) > self.max_len  # TRL's keep_start: the completion's end
        label = self.label_of(rec) if labelled else False
        return [{"input_ids": np.asarray((prompt + completion)[: self.max_len], dtype=np.int64),
                 "prompt_ids": np.asarray(prompt, dtype=np.int64),
                 "completion_ids": np.asarray(completion, dtype=np.int64), "label": np.bool_(label)}]

    def collate(self, examples):
        """N records -> 2N rows: the records' sequences, then the mismatched ones (prompt i with completion i-1,
        rotated within the batch as TRL rotates them), right-padded: input_ids, attention_mask and labels (-100 on
        the prompts and the padding), each (2N, T); ``label``: (N,) bool."""
        n = len(examples)
        kl_rows = [np.concatenate([e["prompt_ids"], e["kl_completion_ids"] if "kl_completion_ids" in e
                                   else examples[(i - 1) % n]["completion_ids"]])[: self.max_len]
                   for i, e in enumerate(examples)]
        rows = [e["input_ids"] for e in examples] + kl_rows
        batch = completion_rows(rows, [len(e["prompt_ids"]) for e in examples] * 2, self.pad_id)
        return {**batch, "label": torch.from_numpy(np.array([e["label"] for e in examples])),
                **({"ref_logps": torch.from_numpy(np.stack([e["ref_logps"] for e in examples]))}
                   if "ref_logps" in examples[0] else {})}

    def fix_mismatched(self, features: list[dict]) -> None:
        """Give each feature a fixed mismatched completion (the previous feature's, the first the last's: TRL's
        rotation over the data set), so that its mismatched row's reference can be computed once."""
        for i, f in enumerate(features):
            f["kl_completion_ids"] = features[i - 1]["completion_ids"]

    # -- model side -------------------------------------------------------------------------------------------
    def counts(self, batch):
        desirable = int(batch["label"].sum())
        return {self.term: int(batch["label"].shape[0]), "desirable": desirable,
                "undesirable": int(batch["label"].shape[0]) - desirable}

    def reference_logps(self, model, batch) -> torch.Tensor:
        if self.reference_model is None and "ref_logps" not in batch:
            raise ConfigError("task kto compares the policy with a reference model and none was given (pretune "
                              "finetune gives one); score the records through `pretune finetune`")
        return super().reference_logps(model, batch)

    def record_logps(self, model, batch) -> dict:
        """The policy's summed log-probabilities of the N records (with gradient) and of their mismatched rows
        (without), the reference's of both, and the completions' token counts: (N,) tensors, fp32."""
        n = batch["label"].shape[0]
        rows = {k: batch[k][:n] for k in ("input_ids", "attention_mask", "labels")}
        kl_rows = {k: batch[k][n:] for k in ("input_ids", "attention_mask", "labels")}
        logps, counts = self.sequence_logps(model, rows)
        with torch.no_grad():
            kl_logps, _ = self.sequence_logps(model, kl_rows)
        ref = self.reference_logps(model, batch)  # (2N,): the records, then the mismatched rows
        return {"logps": logps, "counts": counts, "kl_logps": kl_logps, "ref_logps": ref[:n], "ref_kl_logps": ref[n:]}

    def loss(self, model, batch, totals):
        n = batch["label"].shape[0]
        if n < 2 and model.training:
            raise ConfigError("task kto estimates its KL reference point from the other records of a micro-batch; "
                              "this one holds one record. Raise train.batch_size (per process and train.grad_accum "
                              "micro-batch: at least 2 records)")
        lp = self.record_logps(model, batch)
        desirable = batch["label"].bool()
        # z0 of this micro-batch (no gradient), and its records of each side
        local = torch.stack([(lp["kl_logps"] - lp["ref_kl_logps"]).mean().detach(),
                             desirable.sum().to(lp["logps"].dtype), (~desirable).sum().to(lp["logps"].dtype)])
        if model.training:  # torchrun: z0 is TRL's gather_for_metrics(kl).mean(), clamped after; training only, as
            local = mean_over_processes(local, self.dist)  # every process runs as many micro-batches (not so in
            # evaluation)
        kl = local[0].clamp(min=0)
        held = {"desirable": bool(local[1] > 0), "undesirable": bool(local[2] > 0)}  # by this or another process
        c = self.cfg
        losses, rewards = kto_losses(beta=c.beta, desirable_weight=c.desirable_weight,
                                     undesirable_weight=c.undesirable_weight, logps=lp["logps"],
                                     ref_logps=lp["ref_logps"], desirable=desirable, kl=kl)
        total = losses.sum()
        t = self.term
        # "{term}:{name}": a sum over the term's records, logged as the mean under name (TRL's names)
        stats = {f"{t}_loss": float(total.detach()), f"{t}:kl": float(kl) * n}
        sides = {"desirable": ("chosen", desirable), "undesirable": ("rejected", ~desirable)}
        margin = 0.0  # the mean desirable reward less the mean undesirable one, as a sum over the step's records
        for term, (side, keep) in sides.items():
            if held[term]:  # every process gives the same keys (the trainer sums one vector over them): a side some
                # process's micro-batch holds, 0 where this one holds none; a side no record of it holds: none (TRL)
                stats[f"{term}:rewards/{side}"] = float(rewards[keep].sum())
                stats[f"{term}:logps/{side}"] = float(lp["logps"][keep].detach().sum())
                sign = 1.0 if side == "chosen" else -1.0
                margin += sign * stats[f"{term}:rewards/{side}"] * totals[t] / totals[term]
        stats[f"{t}:rewards/margins"] = margin
        return total / totals[t], stats

    # -- evaluation -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def outputs(self, model, batch):
        """Per record: (policy log p of the completion, reference log p, policy log p of its mismatched row,
        reference log p of it, label, completion tokens), fp32 sums."""
        lp = self.record_logps(model, batch)
        cols = torch.stack([lp["logps"], lp["ref_logps"], lp["kl_logps"], lp["ref_kl_logps"],
                            batch["label"].to(lp["logps"].dtype), lp["counts"]], dim=1)  # (N, 6)
        return list(cols.double().cpu().numpy())

    def predict(self, records, features, outputs):
        out = torch.from_numpy(np.stack(outputs))  # (records, 6)
        kl = (out[:, 2] - out[:, 3]).mean().clamp(min=0)  # z0 over the whole file
        desirable = out[:, 4] > 0.5
        c = self.cfg
        losses, rewards = kto_losses(beta=c.beta, desirable_weight=c.desirable_weight,
                                     undesirable_weight=c.undesirable_weight, logps=out[:, 0], ref_logps=out[:, 1],
                                     desirable=desirable, kl=kl)
        z0 = c.beta * float(kl)
        return [{"judged": "desirable" if float(r) > z0 else ("undesirable" if float(r) < z0 else "tie"),
                 "reward": float(r), "kl": float(kl), "loss": float(loss), "logp": float(o[0])}
                for r, loss, o in zip(rewards, losses, outputs)]

    def reference(self, rec: Record):
        return "desirable" if self.label_of(rec) else "undesirable"

    def score(self, predictions, references):
        if not predictions:
            return {}
        wanted = np.array([r == "desirable" for r in references])
        rewards = np.array([p["reward"] for p in predictions])
        side = {True: rewards[wanted], False: rewards[~wanted]}
        margin = (side[True].mean() if len(side[True]) else 0.0) - (side[False].mean() if len(side[False]) else 0.0)
        return {"loss": float(np.mean([p["loss"] for p in predictions])), "kl": float(predictions[0]["kl"]),
                "reward_accuracy": float(np.mean([p["judged"] == r for p, r in zip(predictions, references)])),
                "margin": float(margin)}

    def prediction_json(self, rec, pred):
        return dict(pred)

