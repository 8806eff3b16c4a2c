"""Downstream tasks for finetuning (``pretune finetune --task NAME``) and their metrics.

    classification  one text → label (encoders pool [CLS]/mean, decoders read the last token)
    pair            two texts → label: BERT ``[CLS] a [SEP] b [SEP]`` or GPT ``[START] a [DELIM] b [EXTRACT]``
    regression      one text or pair → real value (STS-B), mean squared error
    tagging         one label per word (POS, NER with BIO), on each word's first subword
    qa              extractive QA: start/end logits, sliding window over long contexts, SQuAD 2.0 no-answer
    seq2seq         text-to-text with a task prefix, for encoder-decoders and decoders; greedy generation
    sft             instruction / chat finetuning of decoders: prompt → completion, chats, documents (TRL's SFT)
    choice          classification by the LM's likelihood of each label's answer text (T-Few losses)
    multilabel      one text → a set of labels (a sigmoid each, binary cross-entropy)
"""

from __future__ import annotations

from .base import Layout, Record, Task, TaskConfig, read_records
from .choice import Choice
from .classify import Classification, Pair, Regression
from .multilabel import Multilabel
from .qa import QA
from .seq2seq import Seq2Seq
from .sft import SFT
from .tagging import Tagging

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (Classification, Pair, Regression, Tagging, QA, Seq2Seq,
                                                          SFT, Choice, Multilabel)}
TASK_METRICS: dict[str, list[str]] = {name: list(cls.metrics) for name, cls in TASKS.items()}  # what each reports
DEFAULT_METRIC: dict[str, str] = {name: cls.default_metric for name, cls in TASKS.items()}  # model selection


def build_task(cfg: TaskConfig, model_cfg, tokenizer) -> Task:
    """The task named by ``cfg.name`` for a model whose config carries the task's head (and label map)."""
    return TASKS[cfg.name](cfg, model_cfg, tokenizer)


__all__ = ["TASKS", "TASK_METRICS", "DEFAULT_METRIC", "Task", "TaskConfig", "Record", "Layout", "read_records",
           "build_task"]
