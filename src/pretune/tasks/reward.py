"""A reward model on preference pairs: a scalar head on a decoder's last token, trained as TRL's RewardTrainer does.

A record is dpo's paired preference format (field names are settings):

    {"prompt": "...", "chosen": "...", "rejected": "...", "margin": 0.5}    strings: the prompt and each completion
                                                                             joined, tokenized whole, EOS appended
    {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}
                                                                             rendered whole with the chat template
    {"chosen": ..., "rejected": ...}                                         no prompt: each side is the whole text

``margin`` is optional (a number; absent: 0). The model is the decoder with a ``regression`` head (one output, no
bias), read at each sequence's last token that is not the pad token, as transformers' ``*ForSequenceClassification``
with ``num_labels=1`` reads it (so ``pretune convert --to-hf`` gives a model that scores alike). With ``r_c, r_r`` the
scores of the chosen and the rejected sequence and ``m`` the record's margin, per pair:

    loss = -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2          Bradley-Terry (Ouyang et al. 2022, eq. 1; Llama 2's
                                                                   margin, Touvron et al. 2023 §3.2.2); c:
                                                                   task.center_rewards_coefficient (Eisenstein et al.
                                                                   2023: keeps the rewards centred on 0)

and the loss is the mean over the batch's pairs. Evaluation reports the mean per-pair ``loss``, ``accuracy`` (the
chosen scored above the rejected; a tie is wrong, as in TRL) and ``margin`` (the mean ``r_c - r_r``).
``pretune predict`` writes a score per record: both scores for a pair, the score of a ``{"text"}`` or
``{"prompt", "completion"}`` record.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..data.readers import DataError
from .base import Record, TaskConfig, get_field
from .dpo import DPO


@dataclass
class RewardSettings(TaskConfig):
    """reward: the record's fields, how a sequence is rendered, and the pairwise loss's knobs."""

    prompt_field: str = "prompt"  # the prompt (a string, or a list of messages); a record without it: the
    # completions are whole texts
    chosen_field: str = "chosen"  # the preferred completion (a string, or a list of assistant messages)
    rejected_field: str = "rejected"  # the dispreferred completion (same form as chosen)
    margin_field: str = "margin"  # an optional number per pair: how much higher the chosen must score (0 if absent)
    text_field: str = "text"  # pretune predict: a record with only this field is one text to score
    completion_field: str = "completion"  # pretune predict: a {prompt, completion} record is one sequence to score
    chat: bool = False  # prompt/completion strings become a user and an assistant turn of the chat template
    system: str = ""  # a system message put before each conversation that has none
    center_rewards_coefficient: float = 0.0  # c of the centring term c (r_c + r_r)^2 (TRL's; 0.01 is its usual
    # value): rewards near 0 make scores of different runs comparable; 0: off

    def validate(self) -> None:
        super().validate()
        if self.center_rewards_coefficient < 0:
            raise ConfigError(f"task.center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0")


class Reward(DPO):
    """Differs from dpo: a scalar head scores each whole sequence (no reference, no log-probabilities); the pair's
    sides are rendered as dpo renders them."""

    Settings = RewardSettings
    name = "reward"
    model_head = "regression"
    why = "a reward model scores a decoder's sequence at its last token, as transformers' *ForSequenceClassification;"
    term = "reward"  # the loss term in logs: reward_loss, reward_acc
    metrics = ("loss", "accuracy", "margin")
    default_metric = "accuracy"

    @property
    def needs_reference(self) -> bool:
        return False

    @classmethod
    def head_config(cls, cfg, labels):
        return {"head": "regression", "num_labels": 1, "labels": None, "pooling": "last"}

    # -- records -> token ids ---------------------------------------------------------------------------------
    def sequence_ids(self, rec: Record, prompt, completion_field: str) -> list[int]:
        """The ids of ``prompt`` (None: none) followed by the record's ``completion_field``, tokenized whole as
        TRL's RewardTrainer tokenizes it (strings: EOS appended; conversations: rendered by the chat template)."""
        conversation = isinstance(prompt, list) or isinstance(rec.data.get(completion_field), list) or self.cfg.chat
        completion = self._completion(rec, completion_field, conversation)
        if conversation:
            msgs = self._prompt_messages(rec, prompt) if prompt is not None else []
            return self._render_ids(rec, msgs + completion, add_generation_prompt=False)
        text = (prompt or "") + completion
        return self.lead + self.tok.encode(text) + ([] if text.endswith(self.eos_text) else [self.eos])

    def _prompt(self, rec: Record):
        if self.cfg.prompt_field not in rec.data:
            return None
        prompt = get_field(rec, self.cfg.prompt_field, (str, list), what="a string, or a list of messages")
        if isinstance(prompt, str) and not prompt.strip():
            raise DataError(f"{rec.where}: field {self.cfg.prompt_field!r} is empty")
        return prompt

    def _margin(self, rec: Record) -> float:
        name = self.cfg.margin_field
        if name not in rec.data:
            return 0.0
        value = get_field(rec, name, (int, float), what="a number: how much higher the chosen must score")
        if isinstance(value, bool) or not np.isfinite(value):
            raise DataError(f"{rec.where}: field {name!r} is {value!r}; expected a finite number")
        return float(value)

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        c = self.cfg
        prompt = self._prompt(rec)
        if labelled or c.chosen_field in rec.data:  # a pair
            ids = [self.sequence_ids(rec, prompt, name) for name in (c.chosen_field, c.rejected_field)]
            if ids[0] == ids[1]:
                raise DataError(f"{rec.where}: fields {c.chosen_field!r} and {c.rejected_field!r} are identical; a "
                                "pair must prefer one completion to a different one")
            margin = self._margin(rec)
        elif c.text_field in rec.data and prompt is None:  # one text
            text = get_field(rec, c.text_field)
            if not text.strip():
                raise DataError(f"{rec.where}: field {c.text_field!r} is empty")
            ids = [self.lead + self.tok.encode(text) + ([] if text.endswith(self.eos_text) else [self.eos])]
            margin = 0.0
        else:  # a prompt and one completion
            ids, margin = [self.sequence_ids(rec, prompt, c.completion_field)], 0.0
        self.truncated += any(len(x) > self.max_len for x in ids)  # TRL drops such pairs; pretune keeps their start
        ids = [np.asarray(x[: self.max_len], dtype=np.int64) for x in ids]
        return [{"input_ids": ids[0], "rejected_ids": ids[1] if len(ids) > 1 else np.zeros(0, dtype=np.int64),
                 "margin": np.float32(margin)}]

    def collate(self, examples):
        """B records -> rows: each record's (chosen) sequence, then the rejected sequences of the pairs (TRL's
        layout), right-padded: input_ids, attention_mask (R, T); margin (B,); paired (B,) bool."""
        rows = [e["input_ids"] for e in examples] + [e["rejected_ids"] for e in examples if len(e["rejected_ids"])]
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                "margin": torch.from_numpy(np.array([e["margin"] for e in examples], dtype=np.float32)),
                "paired": torch.tensor([len(e["rejected_ids"]) > 0 for e in examples])}

    # -- model side -------------------------------------------------------------------------------------------
    def counts(self, batch):
        return {self.term: int(batch["paired"].sum())}

    def scores(self, model, batch) -> torch.Tensor:
        """(R,) each row's score in fp32: the head on the last token that is not the pad token (transformers'
        *ForSequenceClassification rule, so an exported model scores alike; a trailing EOS that is also the pad
        token is not read)."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        h = self.layout.hidden_states(model, ids, mask)  # (R, T, dim)
        pad = self.model_cfg.pad_token_id
        read = mask if pad is None else mask * (ids != pad)  # the head pools the last 1 of each row
        return model.head(h, read).float().squeeze(-1)

    def pair_scores(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        B = batch["paired"].shape[0]
        if not bool(batch["paired"].all()):
            raise DataError("task reward trains and evaluates on pairs (prompt, chosen, rejected); this batch holds "
                            "single texts (score them with pretune predict)")
        s = self.scores(model, batch)
        return s[:B], s[B:]

    def loss(self, model, batch, totals):
        chosen, rejected = self.pair_scores(model, batch)
        per_pair = -F.logsigmoid(chosen - rejected - batch["margin"])  # TRL's RewardTrainer.compute_loss
        if self.cfg.center_rewards_coefficient:
            per_pair = per_pair + self.cfg.center_rewards_coefficient * (chosen + rejected) ** 2
        total = per_pair.sum()
        d = (chosen - rejected).detach()
        t = self.term
        stats = {f"{t}_loss": float(total.detach()), f"{t}_correct": float((d > 0).sum()),
                 # "{term}:{name}": a sum over the term's pairs, logged as the mean under name (TRL's names)
                 f"{t}:accuracy": float((d > 0).sum()), f"{t}:margin": float(d.sum()),
                 f"{t}:mean_reward": float(((chosen + rejected) / 2).detach().sum())}
        return total / totals[t], stats

    # -- evaluation -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def outputs(self, model, batch):
        """Per record: (its (chosen) score, the rejected score (nan for a single text), its margin)."""
        B = batch["paired"].shape[0]
        s = self.scores(model, batch)
        rejected = torch.full((B,), float("nan"), device=s.device)
        rejected[batch["paired"]] = s[B:]
        return list(torch.stack([s[:B], rejected, batch["margin"].float()], dim=1).double().cpu().numpy())

    def predict(self, records, features, outputs):
        c = self.cfg
        preds = []
        for chosen, rejected, margin in outputs:
            if np.isnan(rejected):
                preds.append({"score": float(chosen)})
                continue
            d = float(chosen - rejected)
            loss = float(-F.logsigmoid(torch.tensor(d - margin, dtype=torch.float64))
                         + c.center_rewards_coefficient * (chosen + rejected) ** 2)
            preds.append({"preferred": "chosen" if d > 0 else "rejected", "score_chosen": float(chosen),
                          "score_rejected": float(rejected), "margin": d, "loss": loss})
        return preds

    def score(self, predictions, references):
        pairs = [(p, r) for p, r in zip(predictions, references) if "preferred" in p]
        if not pairs:
            return {}
        return {"loss": float(np.mean([p["loss"] for p, _ in pairs])),
                "accuracy": float(np.mean([p["preferred"] == r for p, r in pairs])),
                "margin": float(np.mean([p["margin"] for p, _ in pairs]))}
