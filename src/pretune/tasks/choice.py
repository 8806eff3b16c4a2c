"""Classification by scoring answer choices with the language model itself (T-Few, Liu et al. 2022).

Each label has an answer choice (a label word such as "positive", or the label itself). The model reads
``prefix + text`` (an encoder-decoder's encoder; a decoder reads ``text EOS choice EOS`` as a prefix LM)
and every choice is scored by its length-normalised log-likelihood
``beta(x, y) = (1/T) sum_t log p(y_t | x, y_<t)``; the prediction is the best-scoring choice.

Training uses the T-Few recipe's three losses (``task.choice_loss=tfew``, the default):

* L_LM  = -(1/T) sum_t log p(y_t | x, y_<t) on the correct choice y;
* L_UL  = -sum_{n != y} sum_t log(1 - p(y^n_t | x, y^n_<t)) / sum_{n != y} T^n, the unlikelihood of the
  wrong choices' tokens;
* L_LN  = -log softmax_n(beta(x, y^n))[y], a cross-entropy over the length-normalised scores;

or L_LM alone (``task.choice_loss=lm``). Pairs well with ``--peft ia3`` (the T-Few method).
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import ConfigError
from ..objectives.base import IGNORE
from .base import Record, Task, get_field
from .classify import Classification, _label_str


class Choice(Task):
    name = "choice"
    model_head = "lm"
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
        self.start = model_cfg.decoder_start_token_id
        texts = list(cfg.choices) or self.labels
        lead = " " if model_cfg.arch == "decoder" else ""  # a word after the EOS, as in running text
        ids = [tokenizer.tk.encode(lead + t, add_special_tokens=False).ids + [self.eos] for t in texts]
        if any(len(i) == 1 for i in ids):
            raise ConfigError(f"an answer choice encodes to no tokens: {texts}")
        width = max(len(i) for i in ids)
        self.choice_ids = torch.full((len(ids), width), IGNORE, dtype=torch.long)  # (C, L), -100 padded
        for c, row in enumerate(ids):
            self.choice_ids[c, : len(row)] = torch.tensor(row)
        self.choice_texts = texts

    @classmethod
    def label_set(cls, cfg, records: list[Record]) -> list[str]:
        return Classification.label_set(cfg, records)

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        text = get_field(rec, self.cfg.text_field)
        room = self.max_len - 1 - (self.choice_ids.shape[1] if self.model_cfg.arch == "decoder" else 0)
        ids = self.tok.tk.encode(self.cfg.prefix + text, add_special_tokens=False).ids[: max(room, 1)]
        source = np.asarray(ids + [self.eos], dtype=np.int64)
        feat = {"input_ids": source, "attention_mask": np.ones_like(source)}
        if labelled:
            label = _label_str(get_field(rec, self.cfg.label_field, (str, int, float)))
            if label not in self.label_ids:
                raise ConfigError(f"{rec.where}: label {label!r} is not one of the task's labels "
                                  f"({', '.join(self.labels)})")
            feat["labels"] = np.int64(self.label_ids[label])
        return [feat]

    def counts(self, batch):
        return {self.term: int(batch["input_ids"].shape[0])}

    def token_logprobs(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """log p of every choice token given each input: (B, C, L) and the token mask (C, L)."""
        x, mask = batch["input_ids"], batch["attention_mask"]
        B, C = x.shape[0], self.choice_ids.shape[0]
        choices = self.choice_ids.to(x.device)  # (C, L)
        valid = choices != IGNORE
        tokens = choices.clamp(min=0)
        tr = model.transformer
        if self.model_cfg.arch == "encoder-decoder":
            memory = tr.encode(x, mask).repeat_interleave(C, dim=0)  # (B*C, S, dim)
            dec_in = torch.cat([torch.full((C, 1), self.start, device=x.device), tokens[:, :-1]], 1)
            dec_in = torch.where(torch.cat([torch.ones(C, 1, dtype=torch.bool, device=x.device), valid[:, :-1]], 1),
                                 dec_in, torch.full_like(dec_in, self.pad_id))
            h = tr.decode(dec_in.repeat(B, 1), valid.long().repeat(B, 1), memory=memory,
                          memory_mask=mask.repeat_interleave(C, dim=0))  # (B*C, L, dim)
        else:  # one row per (input, choice): [source, choice], the source bidirectional (prefix LM)
            lengths = mask.sum(1)  # (B,)
            S, L = x.shape[1], tokens.shape[1]
            rows = torch.full((B, C, S + L), self.pad_id, dtype=torch.long, device=x.device)
            row_mask = torch.zeros(B, C, S + L, dtype=torch.long, device=x.device)
            for b in range(B):  # left-aligned: source then choice; the rest padding
                n = int(lengths[b])
                rows[b, :, :n] = x[b, :n]
                rows[b, :, n:n + L] = tokens
                row_mask[b, :, :n] = 1
                row_mask[b, :, n:n + L] = valid.long()
            flat = rows.view(B * C, S + L)
            hidden = tr.decode(flat, row_mask.view(B * C, -1), prefix_lengths=lengths.repeat_interleave(C))
            # the states that predict choice token t sit at position n - 1 + t
            at = (lengths[:, None] - 1 + torch.arange(L, device=x.device)[None, :])  # (B, L)
            at = at.repeat_interleave(C, dim=0)  # (B*C, L)
            h = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = model.head(h).float()  # (B*C, L, vocab)
        logp = logits.log_softmax(-1).gather(-1, tokens.repeat(B, 1)[..., None]).squeeze(-1)
        return logp.view(B, C, -1) * valid, valid

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
        return _label_str(get_field(rec, self.cfg.label_field, (str, int, float)))

    def prediction_json(self, rec, pred):
        return {"text": get_field(rec, self.cfg.text_field), "prediction": pred}
