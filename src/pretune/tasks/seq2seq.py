"""Text-to-text finetuning (T5): "task prefix: input" → output text, for encoder-decoders and decoders.

An encoder-decoder reads ``prefix + source + EOS`` and is trained on ``target + EOS``; a decoder-only
model reads ``source EOS target EOS`` as one sequence, bidirectional over the source (prefix LM), and
is trained on the target part — the same layouts as the pretraining objectives (objectives/seq2seq.py).
Predictions are generated greedily; classification by generating the label word is this task with the
label as the target (``task.target_field=label``), scored by exact match.
"""

from __future__ import annotations

import numpy as np
import torch

from ..model import KVCache
from ..objectives.seq2seq import Seq2Seq as _Seq2SeqObjective
from .base import Record, Task, get_field


class Seq2Seq(Task, _Seq2SeqObjective):
    name = "seq2seq"
    model_head = "lm"
    archs = ("encoder-decoder", "decoder")
    why = "text-to-text needs a decoder to write the output;"
    term = "lm"
    counts = _Seq2SeqObjective.counts
    loss = _Seq2SeqObjective.loss

    def source_ids(self, rec: Record) -> np.ndarray:
        text = get_field(rec, self.cfg.source_field)
        ids = self.tok.tk.encode(self.cfg.prefix + text, add_special_tokens=False).ids
        room = self.max_len - 1 - (self.cfg.max_target_len if self.model_cfg.arch == "decoder" else 0)
        return np.asarray(ids[: max(room, 1)], dtype=np.int64)

    def target_ids(self, rec: Record) -> np.ndarray:
        text = get_field(rec, self.cfg.target_field, (str, int, float))
        ids = self.tok.tk.encode(str(text), add_special_tokens=False).ids
        return np.asarray(ids[: self.cfg.max_target_len - 1], dtype=np.int64)

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        src = self.source_ids(rec)
        eos = np.array([self.eos], dtype=np.int64)
        if labelled:
            tgt = self.target_ids(rec)
            if self.model_cfg.arch == "decoder":
                return [self._decoder_example(src, tgt, eos)]
            source, target = np.concatenate([src, eos]), np.concatenate([tgt, eos])
            return [{"input_ids": source, "attention_mask": np.ones_like(source),
                     "decoder_input_ids": np.concatenate([[self.start], target[:-1]]).astype(np.int64),
                     "decoder_attention_mask": np.ones_like(target), "labels": target}]
        source = np.concatenate([src, eos])
        feat = {"input_ids": source, "attention_mask": np.ones_like(source)}
        if self.model_cfg.arch == "decoder":
            feat["prefix_lengths"] = np.int64(len(source))
        return [feat]

    @torch.no_grad()
    def generate(self, model, batch, max_new_tokens: int | None = None) -> list[list[int]]:
        """Greedy decoding with the KV cache: generated ids (EOS excluded) per example."""
        n = max_new_tokens or self.cfg.max_target_len
        if self.model_cfg.arch == "decoder":
            out = []
            for i in range(batch["input_ids"].shape[0]):
                k = int(batch["prefix_lengths"][i])
                prompt = batch["input_ids"][i: i + 1, :k]  # the source and its EOS, without the target
                o = model(prompt, prefix_lengths=torch.tensor([k], device=prompt.device), use_cache=True)
                ids: list[int] = []
                for _ in range(n):
                    nxt = int(o.logits[0, -1].argmax())
                    if nxt == self.eos:
                        break
                    ids.append(nxt)
                    o = model(torch.tensor([[nxt]], device=prompt.device), past_key_values=o.past_key_values,
                              use_cache=True)
                out.append(ids)
            return out
        x, mask = batch["input_ids"], batch["attention_mask"]
        memory = model.transformer.encode(x, mask)
        cache = KVCache()
        cur = torch.full((x.shape[0], 1), self.start, dtype=torch.long, device=x.device)
        done = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        steps = []
        for _ in range(n):
            o = model(x, mask, decoder_input_ids=cur, encoder_hidden_states=memory, past_key_values=cache,
                      use_cache=True)
            nxt = o.logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, self.eos), nxt)
            steps.append(nxt)
            done |= nxt == self.eos
            if bool(done.all()):
                break
            cur = nxt[:, None]
        gen = torch.stack(steps, 1).tolist()
        return [row[: row.index(self.eos)] if self.eos in row else row for row in gen]

    def outputs(self, model, batch):
        return self.generate(model, batch)

    def predict(self, records, features, outputs):
        return [self.tok.decode(ids).strip() for ids in outputs]

    def reference(self, rec: Record):
        return str(get_field(rec, self.cfg.target_field, (str, int, float)))

    def prediction_json(self, rec, pred):
        return {"source": get_field(rec, self.cfg.source_field), "prediction": pred}
