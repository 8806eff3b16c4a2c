"""Text-to-text finetuning (T5): "task prefix: input" → output text, for encoder-decoders and decoders.

The model's layout (model/layout.py) packs each (source, target) pair: an encoder-decoder reads
``prefix + source + EOS`` and is trained on ``target + EOS``; a decoder-only model reads them as one sequence,
laid out as it was pretrained (``causal``: ``source target EOS``; ``prefix_lm``: ``source EOS target EOS``,
bidirectional over the source; ``task.layout`` overrides), and is trained on the target part. Predictions are
generated greedily by the main ``generate()`` (batched, KV cache, stopping at EOS); classification by generating
the label word is this task with the label as the target (``task.target_field=label``), scored by exact match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..config import ConfigError
from ..generation.decode import generate
from ..model.layout import IGNORE, layout_of
from ..objectives.lm import lm_loss_sum
from .base import Record, Task, TaskConfig, get_field


@dataclass
class GenerationSettings(TaskConfig):
    """What the tasks that write text (seq2seq, sft) share: the target's length and the decoder's layout."""

    max_target_len: int = 32  # target tokens (training truncation and generation length)
    layout: Literal["auto", "causal", "prefix_lm"] = "auto"  # on a decoder-only model: how source and target share
    # its sequence; auto: as the model was pretrained (ModelConfig.decoder_layout, model/layout.py)

    def validate(self) -> None:
        super().validate()
        if self.max_target_len < 2:
            raise ConfigError(f"task.max_target_len={self.max_target_len} must be >= 2 (a token and EOS)")


@dataclass
class Seq2SeqSettings(GenerationSettings):
    """seq2seq: a source text, a target text, a task prefix."""

    source_field: str = "source"  # input text
    target_field: str = "target"  # output text
    prefix: str = ""  # task prefix put before the source ("sst2 sentence: ")


class Seq2Seq(Task):
    Settings = Seq2SeqSettings
    name = "seq2seq"
    model_head = "lm"
    metrics = ("exact_match_text", "rouge_l", "bleu")  # + perplexity of the targets (inference.evaluate_task)
    default_metric = "rouge_l"
    archs = ("encoder-decoder", "decoder")
    why = "text-to-text needs a decoder to write the output;"
    term = "lm"
    reports_perplexity = True  # evaluation adds the perplexity of the targets

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        self.eos = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.sep_id
        if self.eos is None:
            raise ConfigError(f"task {self.name!r} needs an EOS (or SEP) token; the tokenizer has neither")
        self.start = model_cfg.decoder_start_token_id
        self.layout = layout_of(model_cfg, cfg.layout)
        self.stop_ids = [self.eos]  # generation stops at any of these (sft adds the chat's end-of-turn tokens)

    def records(self) -> dict:
        return {} if self.layout.encoder_decoder else {"decoder_layout": self.layout.name}

    def source_ids(self, rec: Record) -> np.ndarray:
        text = get_field(rec, self.cfg.source_field)
        ids = self.tok.tk.encode(self.cfg.prefix + text, add_special_tokens=False).ids
        room = self.layout.source_room(self.max_len, self.cfg.max_target_len)
        return np.asarray(ids[: max(room, 1)], dtype=np.int64)

    def target_ids(self, rec: Record) -> np.ndarray:
        text = get_field(rec, self.cfg.target_field, (str, int, float))
        ids = self.tok.tk.encode(self.layout.target_lead + str(text), add_special_tokens=False).ids
        return np.asarray(ids[: self.cfg.max_target_len - 1], dtype=np.int64)

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        src = self.source_ids(rec)
        prompt = self.layout.prompt(src, eos=self.eos)
        if not labelled:
            return [prompt]
        feat = self.layout.example(src, self.target_ids(rec), eos=self.eos, start=self.start)
        if not self.layout.encoder_decoder:  # the generation prompt is the first tokens of the training sequence
            feat["prompt_len"] = np.int64(len(prompt["input_ids"]))
        return [feat]

    def counts(self, batch):
        return {self.term: self.layout.count_targets(batch)}

    def loss(self, model, batch, totals):
        h, targets = self.layout.lm_inputs(model, batch)
        n = int((targets != IGNORE).sum())
        s, correct = lm_loss_sum(model, h, targets, n)
        stats = {"lm_loss": float(s.detach())}
        if correct is not None:
            stats["lm_correct"] = float(correct)
        return s / totals[self.term], stats

    @torch.no_grad()
    def generate(self, model, batch, max_new_tokens: int | None = None) -> list[list[int]]:
        """Greedy decoding of a batch (``generate()``: left-padded prompts, KV cache): generated ids per example,
        the first stop token (EOS) and what follows it excluded."""
        n = max_new_tokens or self.cfg.max_target_len
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if not self.layout.encoder_decoder:  # decoders: each row's prompt, left-padded
            lengths = batch["prompt_len"] if "prompt_len" in batch else mask.sum(1)
            width = int(lengths.max())
            left = torch.full((ids.shape[0], width), self.pad_id, dtype=torch.long, device=ids.device)
            left_mask = torch.zeros_like(left)
            for i, k in enumerate(lengths.tolist()):
                left[i, width - k:] = ids[i, :k]
                left_mask[i, width - k:] = 1
            ids, mask = left, left_mask
        out = generate(model, ids, mask, max_new_tokens=n, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                       layout=self.layout.name)
        rows = self.layout.new_tokens(out, ids.shape[1]).tolist()
        stops = set(self.stop_ids)
        return [row[: next((j for j, t in enumerate(row) if t in stops), len(row))] for row in rows]

    def outputs(self, model, batch):
        return self.generate(model, batch)

    def predict(self, records, features, outputs):
        return [self.tok.decode(ids).strip() for ids in outputs]

    def reference(self, rec: Record):
        return str(get_field(rec, self.cfg.target_field, (str, int, float)))

    def prediction_json(self, rec, pred):
        return {"source": get_field(rec, self.cfg.source_field), "prediction": pred}
