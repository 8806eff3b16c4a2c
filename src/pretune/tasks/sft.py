"""Supervised finetuning (SFT) of decoder-only language models, as TRL's ``SFTTrainer`` does it.

Three record formats, recognised per record (field names are settings):

    {"prompt": ..., "completion": ...}   loss on the completion only. Strings are joined as they are (the
                                          completion's leading space is the writer's), EOS appended; with
                                          ``task.chat=true`` they become a user and an assistant turn of the chat
                                          template. Lists of messages (TRL's conversational form) are a chat.
    {"messages": [{"role", "content"}]}   rendered by the chat template; loss on the assistant turns
                                          (``task.assistant_turns=last``: the last one only).
    {"text": ...}                         loss on every token (continued pretraining on documents), EOS appended.

``task.prompt_template`` builds the prompt from any fields (``"Is this message spam? Answer ham or spam.\\n{text}\\n
Answer:"``) so a labelled set (``task.completion_field=label``) becomes instructions without a new file.

The chat template is the checkpoint's (``chat_template.jinja``, or ``tokenizer_config.json`` in older folders),
rendered by the renderer ``generate --chat`` uses, token-identically to transformers' ``apply_chat_template``;
a tokenizer without one gets :data:`DEFAULT_CHAT_TEMPLATE`. Assistant turns are found by rendering the
conversation up to each turn (with and without the generation prompt) and mapping those character spans onto the
tokens of the whole rendering, so any template whose rendering of a prefix of the conversation is a prefix of the
rendering of all of it works — ``{% generation %}`` blocks are not needed.

Attention is causal over the whole sequence. Evaluation generates each completion with the main ``generate()``
(batched, left-padded, KV cache, stopping at EOS or the end-of-turn token) and scores exact match, ROUGE-L and
BLEU, the completions' perplexity, and accuracy and macro-F1 when the completions are label words. With
``data.packing=true`` several training examples share a row (:meth:`SFT.pack`): block-diagonal causal attention and
positions restarting per example, so no example sees another.
"""

from __future__ import annotations

import json
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ..config import ConfigError
from ..data.readers import DataError
from ..generation.prompt import ChatTemplate, PromptError, apply_chat_template
from ..generation.scoring import lead_ids
from ..model.layout import IGNORE
from .base import Record, get_field
from .seq2seq import GenerationSettings, Seq2Seq

# For a tokenizer with no chat template of its own: "User: ...\nAssistant: ...<eos>\n" (the generation prompt is
# "Assistant:"; the reply's leading space belongs to the reply).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")

# ChatML (TRL's setup_chat_format): "<|im_start|>role\ncontent<|im_end|>\n" per message; the generation prompt opens an
# assistant turn. A base model learns it with the two tokens added (task.add_tokens), their rows trained
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT_TEMPLATES = {"chatml": (CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>"))}  # name -> (template, its tokens)

# end-of-turn tokens of the chat formats in use; generation stops at any of them that the tokenizer has
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")
LABEL_WORDS_MAX = 20  # completions are label words when the references take at most this many short values


@dataclass
class SFTSettings(GenerationSettings):
    """sft: the record's fields (prompt and completion, messages, or text) and how a chat is rendered."""

    prompt_field: str = "prompt"  # the prompt (a string, or a list of messages)
    completion_field: str = "completion"  # what the model learns to write after the prompt
    messages_field: str = "messages"  # a conversation [{"role", "content"}, ...]; loss on assistant turns
    text_field: str = "text"  # a document: loss on every token
    prompt_template: str = ""  # the prompt from the record's fields ("Classify: {text}\nAnswer:"); empty: prompt
    chat: bool = False  # prompt/completion strings become a user and an assistant turn of the chat template
    system: str = ""  # a system message put before each conversation that has none
    assistant_turns: Literal["all", "last"] = "all"  # chats: learn every assistant turn, or the last one only
    chat_template: str = ""  # the run's chat template, in place of the model's: chatml (needs its two tokens, e.g.
    # task.add_tokens='["<|im_start|>","<|im_end|>"]' on a base model), a .jinja file, or Jinja text; the finetuned
    # folder keeps it (chat_template.jinja). Empty: the model's own, else pretune's default

    def validate(self) -> None:
        super().validate()
        t = self.chat_template
        if t.endswith(".jinja") and "{" not in t and not Path(t).is_file():
            raise ConfigError(f"task.chat_template={t!r}: no such file (a .jinja file, Jinja text, or one of "
                              f"{', '.join(CHAT_TEMPLATES)})")
        if t and t not in CHAT_TEMPLATES and "{" not in t and not t.endswith(".jinja"):
            raise ConfigError(f"task.chat_template={t!r} is neither a template name ({', '.join(CHAT_TEMPLATES)}), a "
                              ".jinja file nor Jinja text")

    def template_text(self) -> str:
        """The Jinja text task.chat_template names (empty: none set)."""
        t = self.chat_template
        if t in CHAT_TEMPLATES:
            return CHAT_TEMPLATES[t][0]
        return Path(t).read_text() if t.endswith(".jinja") and "{" not in t else t


def chat_template(tok) -> ChatTemplate:
    """The chat template a task renders conversations with: the tokenizer's, else pretune's default (sft, dpo, kto,
    reward, grpo)."""
    return ChatTemplate(tok.chat_template or DEFAULT_CHAT_TEMPLATE,
                        {f"{r}_token": t for r, t in tok.roles.items() if t is not None},
                        "the tokenizer" if tok.chat_template else "pretune's default chat template")


def stop_ids(tok, eos: int) -> list[int]:
    """The tokens a generated completion ends at: ``eos`` and the tokenizer's special end-of-turn tokens."""
    specials = {tok.id_to_token(i) for i in tok.special_ids}
    return sorted({eos} | {tok.token_to_id(t) for t in END_OF_TURN if t in specials})


class SFT(Seq2Seq):
    Settings = SFTSettings
    name = "sft"
    archs = ("decoder",)
    why = "instruction finetuning trains a decoder-only language model to continue a prompt;"
    packable = True

    def __init__(self, cfg, model_cfg, tokenizer):
        if cfg.layout == "prefix_lm":
            raise ConfigError("task sft trains with causal attention (as the model generates); task.layout=prefix_lm "
                              "is for task seq2seq on a model pretrained as a prefix LM")
        super().__init__(cfg, model_cfg, tokenizer)
        from ..model.layout import layout_of

        self.layout = layout_of(model_cfg, "causal")
        tok = tokenizer
        self.lead = lead_ids(tok)
        self.template = chat_template(tok)
        self.stop_ids = stop_ids(tok, self.eos)
        self.formats: Counter = Counter()
        self.truncated = 0  # examples cut at task.max_len (their end, or a prompt's beginning): reported by prepare

    def records(self) -> dict:
        return {"decoder_layout": "causal"}

    @classmethod
    def setup_tokenizer(cls, cfg: SFTSettings, tok, log=print) -> None:
        """task.chat_template: the run's tokenizer renders chats with it from now on, and the model folder keeps it.
        ChatML's tokens must be single tokens of the tokenizer (a base model: task.add_tokens adds them)."""
        text = cfg.template_text()
        if not text:
            return
        needs = CHAT_TEMPLATES.get(cfg.chat_template, ("", ()))[1]
        missing = [t for t in needs if tok.tk.encode(t, add_special_tokens=False).ids != [tok.token_to_id(t)]]
        if missing:
            raise ConfigError(f"task.chat_template={cfg.chat_template} writes {', '.join(missing)}, which the "
                              f"tokenizer does not hold as single tokens: add {'them' if len(missing) > 1 else 'it'} "
                              f"with task.add_tokens='{json.dumps(missing)}' (new rows, trained) or use the model's "
                              "own template")
        if tok.chat_template and tok.chat_template != text:
            log(f"task.chat_template={cfg.chat_template if cfg.chat_template in CHAT_TEMPLATES else '...'} replaces "
                "the model's own chat template")
        tok.chat_template = text


    # -- records -> token ids ---------------------------------------------------------------------------------
    def _format(self, rec: Record) -> str:
        c = self.cfg
        if c.messages_field in rec.data:
            return "messages"
        if c.prompt_template or c.prompt_field in rec.data:
            if isinstance(rec.data.get(c.prompt_field), list) or isinstance(rec.data.get(c.completion_field), list):
                return "conversation"
            return "prompt"
        if c.text_field in rec.data:
            return "text"
        have = ", ".join(sorted(map(str, rec.data))) or "none"
        raise DataError(f"{rec.where}: an SFT record needs {c.prompt_field!r} and {c.completion_field!r}, or "
                        f"{c.messages_field!r}, or {c.text_field!r}; the record has: {have}. Name the fields with "
                        "task.prompt_field=..., task.completion_field=..., task.messages_field=..., "
                        "task.text_field=... (or build the prompt with task.prompt_template)")

    def _prompt_text(self, rec: Record) -> str:
        c = self.cfg
        if not c.prompt_template:
            return get_field(rec, c.prompt_field)
        template = c.prompt_template.replace("\\n", "\n").replace("\\t", "\t")  # "\n" typed on a command line
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(template) if f]
        except ValueError as e:
            raise ConfigError(f"task.prompt_template={c.prompt_template!r} is not a format string ({e}); write "
                              "fields as {name} and a literal brace as {{ or }}") from None
        values = {}
        for name in names:
            if not name.isidentifier():
                raise ConfigError(f"task.prompt_template: {{{name}}} is not a field name")
            values[name] = get_field(rec, name, (str, int, float))
        return template.format(**values)

    def _messages(self, rec: Record, fmt: str) -> list[dict]:
        c = self.cfg
        if fmt == "messages":
            msgs = get_field(rec, c.messages_field, list, what="a list of {'role', 'content'} messages")
        elif fmt == "conversation":
            prompt = rec.data.get(c.prompt_field)
            completion = get_field(rec, c.completion_field, (str, list))
            msgs = ((prompt if isinstance(prompt, list) else [{"role": "user", "content": self._prompt_text(rec)}])
                    + (completion if isinstance(completion, list)
                       else [{"role": "assistant", "content": completion}]))
        else:  # prompt/completion strings as one exchange (task.chat=true)
            msgs = [{"role": "user", "content": self._prompt_text(rec)},
                    {"role": "assistant", "content": str(get_field(rec, c.completion_field, (str, int, float)))}]
        if c.system and not (msgs and isinstance(msgs[0], dict) and msgs[0].get("role") == "system"):
            msgs = [{"role": "system", "content": c.system}] + msgs
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{rec.where}: message {i} is {m!r:.80}; expected {{'role': str, 'content': str}}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{rec.where}: the conversation has no assistant turn to learn from")
        return msgs

    def _render(self, rec: Record, msgs: list[dict], *, add_generation_prompt: bool) -> str:
        try:
            return apply_chat_template(self.template, msgs, add_generation_prompt=add_generation_prompt)
        except PromptError as e:
            raise DataError(f"{rec.where}: {e}") from None

    def chat_example(self, rec: Record, msgs: list[dict]) -> tuple[list[int], list[int], int, str]:
        """(ids, labels, prompt length, reference) of a conversation: the rendering tokenized as a whole, labels on
        the assistant turns (``task.assistant_turns``), the prompt = everything before the last assistant turn."""
        full = self._render(rec, msgs, add_generation_prompt=False)
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if self.cfg.assistant_turns == "last":
            turns = turns[-1:]
        spans = []
        for i in turns:
            before = self._render(rec, msgs[:i], add_generation_prompt=True)
            upto = self._render(rec, msgs[: i + 1], add_generation_prompt=False)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise DataError(f"{rec.where}: the chat template renders turn {i} differently once later turns follow "
                                "(it is not prefix-stable), so the assistant tokens cannot be found; train on the last "
                                "turn only (task.assistant_turns=last) or split the conversation")
            spans.append((len(before), len(upto)))
        enc = self.tok.tk.encode(full, add_special_tokens=False)
        ids = list(enc.ids)
        labels = [IGNORE] * len(ids)
        for t, (a, b) in enumerate(enc.offsets):
            if any(b > s and a < e for s, e in spans):
                labels[t] = ids[t]
        first = next((t for t, (a, b) in enumerate(enc.offsets) if b > spans[-1][0]), len(ids))
        return ids, labels, first, msgs[turns[-1]]["content"]

    def prompt_example(self, rec: Record) -> tuple[list[int], list[int], int, str]:
        """(ids, labels, prompt length, reference) of a prompt/completion pair of strings (TRL: the prompt tokenized
        alone gives the boundary; EOS appended)."""
        prompt = self._prompt_text(rec)
        completion = str(get_field(rec, self.cfg.completion_field, (str, int, float)))
        p = self.tok.encode(prompt)
        full = self.tok.encode(prompt + completion)[len(p):] if completion else []
        cut = len(full) > self.cfg.max_target_len - 1
        full = full[: max(self.cfg.max_target_len - 1, 0)] + [self.eos]
        room = self.max_len - len(self.lead) - len(full)
        if room < 1:
            raise ConfigError(f"task.max_len={self.max_len} leaves no room for a prompt next to task.max_target_len="
                              f"{self.cfg.max_target_len} completion tokens")
        self.truncated += cut or len(p) > room
        p = p[-room:]  # a long prompt loses its beginning: its end (the question, "Answer:") stays
        ids = self.lead + p + full
        prompt_len = len(self.lead) + len(p)
        return ids, [IGNORE] * prompt_len + full, prompt_len, completion

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        fmt = self._format(rec)
        self.formats[fmt] += 1
        # documents only (nothing to generate): model selection by the perplexity
        self.default_metric = "perplexity" if set(self.formats) == {"text"} else "rouge_l"
        if fmt == "text":
            ids = self.lead + self.tok.encode(get_field(rec, self.cfg.text_field))
            self.truncated += len(ids) > self.max_len - 1
            ids = ids[: self.max_len - 1] + [self.eos]
            labels, prompt_len, ref = list(ids), 0, ""
        elif fmt == "prompt" and not self.cfg.chat:
            ids, labels, prompt_len, ref = self.prompt_example(rec)
        else:
            ids, labels, prompt_len, ref = self.chat_example(rec, self._messages(rec, fmt))
            self.truncated += len(ids) > self.max_len
            ids, labels = ids[: self.max_len], labels[: self.max_len]
            prompt_len = min(prompt_len, len(ids))
        ids_a = np.asarray(ids, dtype=np.int64)
        if not labelled:
            return [{"input_ids": ids_a[:prompt_len], "attention_mask": np.ones(prompt_len, dtype=np.int64),
                     "prompt_len": np.int64(prompt_len), "_reference": ref}]
        return [{"input_ids": ids_a, "attention_mask": np.ones_like(ids_a), "labels": np.asarray(labels, np.int64),
                 "prompt_len": np.int64(prompt_len), "_reference": ref}]

    # -- packing ----------------------------------------------------------------------------------------------
    def pack(self, features: list[dict], width: int) -> list[dict]:
        """Training features packed into rows of at most ``width`` tokens (best fit, longest first): each row holds
        ``document_ids`` (1, 2, ... per example) and ``position_ids`` restarting at 0 per example; the first token
        of each example predicts nothing from the one before it."""
        order = sorted(range(len(features)), key=lambda i: -len(features[i]["input_ids"]))
        rows: list[list[int]] = []
        room: list[int] = []
        for i in order:
            n = len(features[i]["input_ids"])
            fits = [r for r in range(len(rows)) if room[r] >= n]
            if fits:
                r = min(fits, key=lambda r: room[r])
                rows[r].append(i)
                room[r] -= n
            else:
                rows.append([i])
                room.append(width - n)
        out = []
        for members in rows:
            parts = [features[i] for i in members]
            labels = [p["labels"].copy() for p in parts]
            for lab in labels:
                lab[0] = IGNORE  # nothing before it in its own example
            ids = np.concatenate([p["input_ids"] for p in parts])
            out.append({"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": np.concatenate(labels),
                        "position_ids": np.concatenate([np.arange(len(p["input_ids"])) for p in parts]),
                        "document_ids": np.concatenate([np.full(len(p["input_ids"]), d + 1)
                                                        for d, p in enumerate(parts)]).astype(np.int64)})
        return out

    def collate(self, examples):
        batch = super().collate(examples)
        if "position_ids" in batch:  # padding: position 0 in no document (the key mask hides it)
            pad = batch["attention_mask"] == 0
            batch["position_ids"] = batch["position_ids"].masked_fill(pad, 0)
            batch["document_ids"] = batch["document_ids"].masked_fill(pad, 0)
        return batch

    # -- evaluation -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def outputs(self, model, batch):
        rows = [i for i, n in enumerate(batch["prompt_len"].tolist()) if n > 0]
        out: list[list[int]] = [[] for _ in range(batch["input_ids"].shape[0])]
        if rows:
            sub = {k: v[rows] for k, v in batch.items()}
            for i, ids in zip(rows, self.generate(model, sub)):
                out[i] = ids
        return out

    def predict(self, records, features, outputs):
        return [self.tok.decode(ids, skip_special_tokens=True).strip() for ids in outputs]

    def reference(self, rec: Record):
        fmt = self._format(rec)
        if fmt == "text":
            return ""
        if fmt == "prompt" and not self.cfg.chat:
            return str(get_field(rec, self.cfg.completion_field, (str, int, float))).strip()
        msgs = self._messages(rec, fmt)
        return [m for m in msgs if m["role"] == "assistant"][-1]["content"].strip()

    def score(self, predictions, references):
        from .metrics import compute

        pairs = [(p, r) for p, r in zip(predictions, references) if r != ""]  # documents have nothing to generate
        if not pairs:
            return {}
        preds, refs = [p for p, _ in pairs], [r for _, r in pairs]
        names = list(self.metrics)
        values = set(refs)
        if 2 <= len(values) <= LABEL_WORDS_MAX and all(len(v.split()) <= 3 and "\n" not in v for v in values):
            names += ["accuracy", "macro_f1"]  # the completions are label words
        return compute(names, preds, refs)

    def prediction_json(self, rec, pred):
        fmt = self._format(rec)
        out = {"prediction": pred}
        if fmt == "prompt" and not self.cfg.chat:
            out = {"prompt": self._prompt_text(rec), **out}
        return out
