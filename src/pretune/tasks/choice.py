"""Classification by scoring answer choices with the language model itself (T-Few, Liu et al. 2022).

Each label has an answer choice (a label word such as "positive", or the label itself). The model reads
``prefix + text`` and every choice is laid out after it by the model's layout (model/layout.py: an encoder-decoder's
encoder reads the text and its decoder the choice; a decoder reads ``text choice EOS``, causally or as a prefix LM,
as it was pretrained) and every choice is scored by its length-normalised log-likelihood
``beta(x, y) = (1/T) sum_t log p(y_t | x, y_<t)``; the prediction is the best-scoring choice.

Training uses the T-Few recipe's three losses (``task.choice_loss=tfew``, the default):

* L_LM  = -(1/T) sum_t log p(y_t | x, y_<t) on the correct choice y;
* L_UL  = -sum_{n != y} sum_t log(1 - p(y^n_t | x, y^n_<t)) / sum_{n != y} T^n, the unlikelihood of the
  wrong choices' tokens;
* L_LN  = -log softmax_n(beta(x, y^n))[y], a cross-entropy over the length-normalised scores;

or L_LM alone (``task.choice_loss=lm``). Pairs well with ``--peft ia3`` (the T-Few method).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from ..config import ConfigError
from ..model.layout import IGNORE, layout_of
from .base import Record, Task, TaskConfig, get_field, most_common
from .classify import Classification, _label


@dataclass
class ChoiceSettings(TaskConfig):
    """choice: a text, its label, and each label's answer text."""

    text_field: str = "text"  # the input text
    label_field: str = "label"  # the label (its answer text is scored)
    labels: list[str] = field(default_factory=list)  # the label set in id order; empty: read from the training data
    choices: list[str] = field(default_factory=list)  # answer text per label, in label order; empty: the labels
    choice_loss: str = "tfew"  # tfew (L_LM + L_UL + L_LN, Liu et al. 2022) or lm (L_LM only)
    prefix: str = ""  # put before the text ("Review: ")
    layout: Literal["auto", "causal", "prefix_lm"] = "auto"  # on a decoder-only model: how text and answer share
    # its sequence; auto: as the model was pretrained (ModelConfig.decoder_layout, model/layout.py)


class Choice(Task):
    Settings = ChoiceSettings
    name = "choice"
    model_head = "lm"
    metrics = ("accuracy", "macro_f1", "micro_f1", "mcc")
    default_metric = "accuracy"
    archs = ("encoder-decoder", "decoder")
    why = "scoring answer choices needs a language model that writes them;"
    labels_in_task = True  # the label set is saved in task.json (the LM head has no label map)

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        if not cfg.labels:
            raise ConfigError("task choice needs its label set (task.labels), read from the training data by "
                              "`pretune finetune`")
        if cfg.choices and len(cfg.choices) != len(cfg.labels):
            raise ConfigError(f"task.choices has {len(cfg.choices)} entries for {len(cfg.labels)} labels "
                              f"({', '.join(cfg.labels)}): give one answer text per label, in label order")
        if cfg.choice_loss not in ("tfew", "lm"):
            raise ConfigError(f"task.choice_loss={cfg.choice_loss!r}: expected tfew or lm")
        self.labels = list(cfg.labels)
        self.label_ids = {name: i for i, name in enumerate(self.labels)}
        self.eos = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.sep_id
        if self.eos is None:
            raise ConfigError("task choice needs an EOS (or SEP) token; the tokenizer has neither")
        self.layout = layout_of(model_cfg, cfg.layout)
        texts = list(cfg.choices) or self.labels
        lead = self.layout.target_lead  # causal decoders: the answer continues the text, after a space
        ids = [tokenizer.tk.encode(lead + t, add_special_tokens=False).ids + [self.eos] for t in texts]
        if any(len(i) == 1 for i in ids):
            raise ConfigError(f"an answer choice encodes to no tokens: {texts}")
        width = max(len(i) for i in ids)
        self.choice_ids = torch.full((len(ids), width), IGNORE, dtype=torch.long)  # (C, L), -100 padded
        for c, row in enumerate(ids):
            self.choice_ids[c, : len(row)] = torch.tensor(row)
        self.choice_texts = texts

    def records(self) -> dict:
        return {} if self.layout.encoder_decoder else {"decoder_layout": self.layout.name}

    @classmethod
    def label_set(cls, cfg, records: list[Record]) -> list[str]:
        return Classification.label_set(cfg, records)

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        text = get_field(rec, self.cfg.text_field)
        room = self.layout.source_room(self.max_len, self.choice_ids.shape[1])
        ids = self.tok.tk.encode(self.cfg.prefix + text, add_special_tokens=False).ids[: max(room, 1)]
        feat = self.layout.prompt(np.asarray(ids, dtype=np.int64), eos=self.eos)
        if labelled:
            label = _label(rec, self.cfg.label_field)
            if label not in self.label_ids:
                raise ConfigError(f"{rec.where}: label {label!r} is not one of the task's labels "
                                  f"({', '.join(self.labels)})")
            feat["labels"] = np.int64(self.label_ids[label])
        return [feat]

    def counts(self, batch):
        return {self.term: int(batch["input_ids"].shape[0])}

    def token_logprobs(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """log p of every choice token given each input: (B, C, L) and the token mask (C, L)."""
        choices = self.choice_ids.to(batch["input_ids"].device)  # (C, L)
        logp = self.layout.continuation_logprobs(model, batch["input_ids"], batch["attention_mask"], choices)
        return logp, choices != IGNORE

    def scores(self, logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Length-normalised log-likelihood beta(x, choice): (B, C)."""
        return logp.sum(-1) / valid.sum(-1)

    def loss(self, model, batch, totals):
        logp, valid = self.token_logprobs(model, batch)  # (B, C, L), (C, L)
        y = batch["labels"]
        B, C, _ = logp.shape
        n_tok = valid.sum(-1).float()  # (C,)
        beta = self.scores(logp, valid)  # (B, C)
        right = torch.nn.functional.one_hot(y, C).bool()  # (B, C)
        lm = -(beta[right])  # (B,): mean token NLL of the correct choice
        total = lm
        stats = {"task_lm_loss": float(lm.sum().detach())}
        if self.cfg.choice_loss == "tfew":
            p = logp.exp().clamp(max=1 - 1e-6)
            unlikely = -(torch.log1p(-p) * valid).sum(-1)  # (B, C): sum over each choice's tokens
            wrong = ~right
            ul = (unlikely * wrong).sum(-1) / (n_tok[None, :] * wrong).sum(-1).clamp(min=1)  # (B,)
            ln = torch.nn.functional.cross_entropy(beta, y, reduction="none")  # (B,)
            total = lm + ul + ln
            stats.update(task_ul_loss=float(ul.sum().detach()), task_ln_loss=float(ln.sum().detach()))
        stats.update(task_loss=float(total.sum().detach()), task_correct=float((beta.argmax(-1) == y).sum()))
        return total.sum() / totals[self.term], stats

    @torch.no_grad()
    def outputs(self, model, batch) -> list:
        logp, valid = self.token_logprobs(model, batch)
        return list(self.scores(logp, valid).cpu().numpy())

    def predict(self, records, features, outputs):
        return [self.labels[int(np.argmax(o))] for o in outputs]

    def reference(self, rec: Record):
        return _label(rec, self.cfg.label_field)

    def baseline_predictions(self, train, records):
        """The majority class of the training records, for every record."""
        label, share = most_common(self.reference(r) for r in train)
        return [label] * len(records), f"always {label!r} (the most frequent training label, {share:.0%})"

    def prediction_json(self, rec, pred):
        return {"text": get_field(rec, self.cfg.text_field), "prediction": pred}
