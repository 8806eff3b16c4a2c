"""The task interface: labelled records → features (numpy) → padded batch → loss and predictions.

A task is an :class:`~pretune.objectives.base.Objective` without corruption, so finetuning runs in
the same training loop as pretraining. Beyond the objective interface it knows how to read and
validate its records (every error names ``file:line``), build the label map, encode a record into
one or more features (QA: one per sliding window), and turn model outputs back into predictions
per record, which ``tasks.metrics`` scores.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ..config import ConfigError
from ..data.readers import DataError
from ..data.records import Record, read_records  # re-exported: tasks read their data as records
from ..data.records import get_field as _get_field
from ..model.layout import layout_of
from ..objectives.base import IGNORE, Objective
from ..runconfig import Owned

__all__ = ["Task", "TaskConfig", "Baseline", "Layout", "Record", "read_records", "get_field", "most_common", "IGNORE"]



@dataclass
class TaskConfig(metaclass=Owned):
    """A task's section of a finetuning config (``task: {name: ..., ...}``): the settings every task has. Each task
    owns a subclass with its own (``Task.Settings``: its data fields and knobs, each with a one-line comment, checked
    in ``validate``). ``TaskConfig(name="qa", stride=64)`` is the qa task's settings; ``pretune.tasks.task_settings``
    builds them from a mapping, checked (unknown keys name the nearest; another task's keys are left out)."""

    name: str = "classification"  # the downstream task: a name of pretune.tasks.TASKS (see `pretune finetune --help`)
    max_len: int = 128  # tokens per input, special tokens included (qa: per window)
    metric: str = ""  # dev metric for early stopping / keep-best; empty: the task's default
    add_tokens: list[str] = field(default_factory=list)  # new special tokens (e.g. [DELIM]), each a new embedding
    # row starting at the mean of the others; trained by full finetuning, or alone beside a PEFT adapter

    SELECTOR = "name"  # TaskConfig(name=X, ...) is task X's settings (runconfig.Owned)

    @classmethod
    def settings_for(cls, name: str) -> type[TaskConfig]:
        from . import settings_class

        return settings_class(name)

    @classmethod
    def all_keys(cls) -> set[str]:
        from . import task_defaults

        return set(task_defaults())

    @classmethod
    def from_values(cls, values: dict) -> TaskConfig:
        """``runconfig.section("task", TaskConfig, values)``: the named task's settings, checked."""
        from . import task_settings

        return task_settings(values)

    def validate(self) -> None:
        """Check the values (each rule once, here or in the subclass); raise ConfigError naming the key."""
        if self.max_len < 8:
            raise ConfigError(f"task.max_len={self.max_len} is too short (at least 8 tokens)")
        if self.add_tokens:
            from ..io.new_tokens import check_new_tokens

            check_new_tokens(self.add_tokens)


_SETTING_FORM = contextvars.ContextVar("setting_form", default="task.{key}=...")  # how hints spell a task setting


@contextlib.contextmanager
def setting_form(form: str) -> Iterator[None]:
    """Within the block, hints spell a task setting as ``form`` (``{key}``: the setting's name): the default is the
    config key finetuning reads (``task.{key}=...``); ``pretune evaluate`` / ``predict`` take ``--set {key}=...``."""
    token = _SETTING_FORM.set(form)
    try:
        yield
    finally:
        _SETTING_FORM.reset(token)


def get_field(rec: Record, name: str, kind: type | tuple[type, ...] = str, *, what: str = "") -> Any:
    """``rec.data[name]`` checked for presence and type (data/records.py); when no record of the file has the
    field, the error says which task setting names it (spelled as :func:`setting_form` says)."""
    form = _SETTING_FORM.get().format(key=_field_key(name))
    return _get_field(rec, name, kind, what=what, hint=f"Set the task's field name (e.g. {form})")


def get_number(rec: Record, name: str, *, what: str) -> float:
    """``rec.data[name]`` as a float: a number (``what`` says what it means), not a boolean, finite; else a DataError
    naming the row and the field."""
    value = get_field(rec, name, (int, float), what=what)
    if isinstance(value, bool) or not math.isfinite(value):
        raise DataError(f"{rec.where}: field {name!r} is {value!r}; expected a finite number")
    return float(value)


def same_kind(rec: Record, kind: str, first: str | None) -> str:
    """``kind`` (what kind of record ``rec`` is, for a task that reads several) if it is ``first``, the kind of the
    file's first record (None: ``rec`` is the first); else a DataError: one file holds one kind."""
    if first is not None and kind != first:
        raise DataError(f"{rec.where}: a {kind} record among {first} records; one file holds one kind")
    return kind


def label_text(rec: Record, name: str, label: str, *, what: str = "label", expected: str = "a class name") -> str:
    """``label`` (field ``name`` of ``rec``, as a string) unless it is empty or blank: then a DataError naming the
    row, the field and the value, since an empty label would silently become a class of its own."""
    if not label.strip():
        raise DataError(f"{rec.where}: the {what} in field {name!r} is empty ({label!r}); expected {expected}. Fill "
                        "it in or drop the record")
    return label


def _field_key(name: str) -> str:
    """The task setting whose default is ``name`` (text -> text_field), else the generic form."""
    from . import task_defaults

    keys = [k for k, v in task_defaults().items() if k.endswith("_field") and v == name]
    return keys[0] if keys else "<x>_field"


@dataclass
class Baseline:
    """What a model that ignores its input scores: the floor a trained model must beat (``Task.baseline``)."""

    what: str  # the constant guess in words: "always 'pos' (the most frequent training label, 62%)"
    metrics: dict  # the task's metrics of that guess on the scored records


def most_common(values: Iterable[Hashable]) -> tuple[Any, float]:
    """The most frequent value and its share of ``values`` (a tie: the one seen first)."""
    counts = Counter(values)
    value, n = counts.most_common(1)[0]
    return value, n / sum(counts.values())


class Task(Objective):
    """Base of the downstream tasks. Subclasses set ``name``, ``model_head``, ``Settings`` and the hooks below."""

    Settings: ClassVar[type[TaskConfig]] = TaskConfig  # this task's config section: TaskConfig's fields and its own
    corrupts = False  # no random corruption: the same feature every epoch
    archs = ("encoder", "decoder", "encoder-decoder")
    model_head: ClassVar[str]  # ModelConfig.head the task trains
    has_labels: ClassVar[bool] = False  # a discrete label map lives in the model config
    term = "task"  # the loss term name in logs (task_loss, task_acc)
    metrics: ClassVar[tuple[str, ...]] = ()  # the metrics it reports (names of tasks.metrics.METRICS)
    default_metric: ClassVar[str] = ""  # the dev metric of model selection and early stopping (task.metric)
    labels_in_task: ClassVar[bool] = False  # the label set lives in task.json (task.labels), not the model
    dist = None  # under torchrun, the job's train.dist.DistInfo (its rank, world, all_gather), set by the finetuning
    # job for the tasks that talk to the other processes while training (kto's z0, grpo's rewards); None: one process

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "model_head" in cls.__dict__:
            cls.head = cls.model_head  # the Objective check: the model must carry this head

    def __init__(self, cfg: TaskConfig, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        self.max_len = min(cfg.max_len, model_cfg.max_positions)  # RoBERTa, BART: the offset rows are no positions
        self.labels: list[str] = list(model_cfg.labels or []) if self.has_labels else []
        self.label_ids = {name: i for i, name in enumerate(self.labels)}

    # -- data -----------------------------------------------------------------------------------
    @classmethod
    def label_set(cls, cfg: TaskConfig, records: list[Record]) -> list[str]:
        """The label map for training: ``cfg.labels`` or the sorted labels found in ``records``."""
        return []

    @classmethod
    def head_config(cls, cfg: TaskConfig, labels: list[str]) -> dict:
        """ModelConfig fields of the head this task trains."""
        out: dict = {"head": cls.model_head}
        if cls.model_head in ("classification", "tagging"):
            out.update(num_labels=len(labels), labels=list(labels))
        elif cls.model_head == "regression":
            out.update(num_labels=1, labels=None)
        elif cls.model_head == "qa":
            out.update(num_labels=2, labels=None)
        return out

    @classmethod
    def setup_tokenizer(cls, cfg: TaskConfig, tok, log=print) -> None:
        """Set the run's tokenizer up before the task reads it, after task.add_tokens (sft: its chat template)."""

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        """Features (numpy arrays; keys starting with '_' are metadata, not collated) for one record."""
        raise NotImplementedError

    def example(self, block, rng, random_block):
        return {k: v for k, v in block.items() if not k.startswith("_")}

    def collate(self, examples):
        return super().collate([{k: v for k, v in e.items() if not k.startswith("_")} for e in examples])

    # -- model side -----------------------------------------------------------------------------
    def counts(self, batch):
        return {self.term: int(batch["labels"].numel() if batch["labels"].ndim == 1
                               else (batch["labels"] != IGNORE).sum())}

    def forward_logits(self, model, batch) -> torch.Tensor:
        return model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")).logits

    @torch.no_grad()
    def outputs(self, model, batch) -> list:
        """Per-example raw outputs (numpy) for :meth:`predict`."""
        logits = self.forward_logits(model, batch).float()
        mask = batch["attention_mask"]
        if logits.ndim == 2:
            return list(logits.cpu().numpy())
        return [row[: int(m.sum())] for row, m in zip(logits.cpu().numpy(), mask)]

    def predict(self, records: list[Record], features: list[dict], outputs: list) -> list:
        """One prediction per record from the outputs of its features (features carry ``_record``)."""
        raise NotImplementedError

    def reference(self, rec: Record):
        """The gold answer of a record, in the form ``predict`` returns (for metrics)."""
        raise NotImplementedError

    def prediction_json(self, rec: Record, pred) -> dict:
        """One line of ``pretune predict`` output."""
        return {"prediction": pred}

    def scores_json(self, output) -> dict | list | float | None:
        """A record's raw output as JSON for ``pretune predict --scores`` (None: the task shows none)."""
        return None

    def score(self, predictions: list, references: list) -> dict:
        """The task's metrics of ``predictions`` against ``references`` (tasks/metrics.py)."""
        from .metrics import compute

        return compute(list(self.metrics), predictions, references)

    # -- a model that reads no input --------------------------------------------------------------
    def baseline_predictions(self, train: list[Record], records: list[Record]) -> tuple[list, str] | None:
        """What a model that ignores its input would predict for each of ``records``, learned from the ``train``
        records (the majority class, the mean value), and that guess in words; None: the task has no such guess
        (seq2seq, sft: a run is judged by its train loss alone)."""
        return None

    def baseline(self, train: list[Record], records: list[Record]) -> Baseline | None:
        """The task's metrics on ``records`` of :meth:`baseline_predictions`: what a trained model must beat
        (``pretune finetune`` warns when its dev score does not)."""
        guess = self.baseline_predictions(train, records) if train and records else None
        if guess is None:
            return None
        preds, what = guess
        return Baseline(what=what, metrics=self.score(preds, [self.reference(r) for r in records]))

    @staticmethod
    def higher_is_better(metric: str) -> bool:
        from .metrics import HIGHER_IS_BETTER

        return HIGHER_IS_BETTER.get(metric, True)


# -- input layouts shared by the sentence tasks ---------------------------------------------------
GPT_PAIR_TOKENS = ("[START]", "[DELIM]", "[EXTRACT]")  # Radford et al. 2018 §3.3: learned start, delimiter, extract


class Layout:
    """How one or two texts become model input for a family.

    BERT (encoders): ``[CLS] a [SEP] b [SEP]`` with segment ids 0/1 (Devlin et al. 2019); segment ids only
    for models with at least two token types (RoBERTa's single type: none); RoBERTa/BART vocabularies
    (``<s>``/``</s>``) separate a pair by two separators, ``<s> a </s></s> b </s>``, as Hugging Face does.
    GPT (decoders): ``[START] a [DELIM] b [EXTRACT]``; the head reads the last token (Radford et al. 2018 §3.3).
    T5 (encoder-decoders): ``a [EOS] b [EOS]`` (the encoder reads the text; the head pools it).
    A decoder's tokenizer that holds ``[START]`` / ``[DELIM]`` / ``[EXTRACT]`` (``task.add_tokens``) gets them, else
    its BOS / SEP-or-EOS / EOS. Tokens a tokenizer lacks are left out (e.g. GPT-2 has no [START]); EXTRACT is required
    for decoders.
    """

    def __init__(self, tok, model_cfg, style: str = "auto"):
        layout = layout_of(model_cfg)
        if style == "auto":
            style = layout.pair_style
        if style == "bert" and not layout.bidirectional:
            raise ConfigError("task.pair_style='bert' needs an encoder: a decoder only sees to the left, so its "
                              "[CLS] would see nothing; use pair_style=gpt (or auto)")
        if style == "gpt" and layout.bidirectional:
            raise ConfigError(f"task.pair_style='gpt' is the decoder-only input format; the model is "
                              f"{model_cfg.family}")
        self.style = style

        def first(*ids):
            return next((int(i) for i in ids if i is not None), None)

        if style == "bert":
            self.start, self.delim = first(tok.cls_id, tok.bos_id), first(tok.sep_id, tok.eos_id)
            self.end = self.delim
        elif style == "gpt":  # deck 001's own tokens when the run added them (task.add_tokens), else the roles
            named = getattr(tok, "token_to_id", lambda t: None)
            start, delim, extract = (named(t) for t in GPT_PAIR_TOKENS)
            self.start = first(start, tok.bos_id, tok.cls_id)
            self.delim = first(delim, tok.sep_id, tok.eos_id)
            self.end = first(extract, tok.eos_id, tok.cls_id, tok.sep_id)
            if self.end is None:
                raise ConfigError("the GPT input format needs an [EXTRACT] token (EOS, CLS or SEP); the tokenizer has "
                                  "none")
        else:
            self.start, self.delim = None, first(tok.eos_id, tok.sep_id)
            self.end = self.delim
        if self.start == self.end and style == "gpt":
            self.start = None  # GPT-2's <|endoftext|> serves as [EXTRACT]; no separate [START]
        roles = getattr(tok, "roles", None) or {}
        double = style == "bert" and roles.get("cls") == "<s>" and roles.get("sep") == "</s>"
        # what goes between a and b: RoBERTa's </s></s>, else the one delimiter (none when the tokenizer lacks it)
        self.pair_sep: list[int] = [] if self.delim is None else [self.delim] * (2 if double else 1)
        # segment ids need a second token type: a one-type model (RoBERTa) reads type 0 everywhere
        self.token_types = model_cfg.token_types >= 2 and style == "bert"

    def n_special(self, pair: bool) -> int:
        return (self.start is not None) + (len(self.pair_sep) if pair else 0) + (self.end is not None)

    def build(self, a: list[int], b: list[int] | None, max_len: int) -> dict:
        """input_ids, attention_mask (and token_type_ids) for a (pair of) token list(s), truncated
        longest-first so the whole input fits ``max_len``."""
        budget = max_len - self.n_special(b is not None)
        if budget < (2 if b is not None else 1):
            raise ConfigError(f"task.max_len={max_len} leaves no room for text after the special tokens")
        a = list(a)
        b = list(b) if b is not None else None
        # longest-first, a tie cut from b (BERT's _truncate_seq_pair; Hugging Face's "longest_first")
        while len(a) + (len(b) if b is not None else 0) > budget:
            if b is not None and len(b) >= len(a):
                b.pop()
            else:
                a.pop()
        ids = ([self.start] if self.start is not None else []) + a
        types = [0] * len(ids)
        if b is not None:
            ids += self.pair_sep
            types += [0] * len(self.pair_sep)
            ids += b
            types += [1] * len(b)
        if self.end is not None:
            ids.append(self.end)
            types.append(1 if b is not None else 0)
        out = {"input_ids": np.asarray(ids, dtype=np.int64), "attention_mask": np.ones(len(ids), dtype=np.int64)}
        if self.token_types:
            out["token_type_ids"] = np.asarray(types, dtype=np.int64)
        return out
