"""Command-line flags that are config keys, one table per run command: ``--lr 1e-3`` is ``train.lr=1e-3``.

Each flag is declared once with the key it sets; the parser gets it with its help (the key named in it), and
the flags given become one config layer (above the YAML file, below ``section.key=value`` overrides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import catalog


def _number_or_auto(text: str) -> float | str:
    """A flag's value that is a number or ``auto`` (chosen by the run)."""
    import argparse

    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


@dataclass(frozen=True)
class Flag:
    """One flag and the config key it sets."""

    flag: str  # "--lr"
    key: str  # "train.lr" (a dotted path into the run config)
    help: str
    type: Any = None  # argparse type (None: str)
    nargs: str | None = None
    metavar: str | None = None
    switch: bool = False  # a flag without a value that sets the key to true
    repeat: bool = False  # a flag given once per value, the key a list of them (--reward a --reward b)

    @property
    def dest(self) -> str:
        return "flag_" + self.key.replace(".", "__")


PRETRAIN_FLAGS = (
    Flag("--preset", "model.preset", "model preset"),
    Flag("--objective", "objective.name", f"objective name: {catalog.names(catalog.OBJECTIVES)}"),
    Flag("--tokenizer", "tokenizer", "tokenizer.json or a folder holding one"),
    Flag("--data", "data.train", "training text (files, folders, globs)", nargs="+", metavar="SOURCE"),
    Flag("--out", "train.out", "run folder"),
    Flag("--steps", "train.steps", "optimizer steps", type=int),
)

DISTILL_FLAGS = (
    Flag("--teacher", "objective.teacher", "the teacher: a pretune checkpoint or Hugging Face model folder"),
    Flag("--preset", "model.preset", "the student's preset (model.KEY=VALUE overrides change it)"),
    Flag("--init", "model.init", "start the student from this checkpoint instead"),
    Flag("--init-from-teacher", "objective.init_from_teacher", "every_other: student layer i starts as teacher "
         "layer 2i, with its embeddings and head (DistilBERT)", metavar="HOW"),
    Flag("--temperature", "objective.temperature", "softmax temperature T of the KL term (default 2)", type=float),
    Flag("--alpha-kl", "objective.alpha_kl", "weight of T^2 KL(teacher || student) (default 5)", type=float),
    Flag("--alpha-hard", "objective.alpha_hard", "weight of the student's own MLM / CLM loss (default 2)",
         type=float),
    Flag("--alpha-cos", "objective.alpha_cos", "weight of the last hidden states' cosine loss (default 0)",
         type=float),
    Flag("--tokenizer", "tokenizer", "tokenizer.json or a folder holding one (default: the teacher's)"),
    Flag("--data", "data.train", "training text (files, folders, globs)", nargs="+", metavar="SOURCE"),
    Flag("--out", "train.out", "run folder"),
    Flag("--steps", "train.steps", "optimizer steps", type=int),
)

FINETUNE_FLAGS = (
    Flag("--model", "model.init", "checkpoint, Hugging Face or adapter folder to start from"),
    Flag("--preset", "model.preset", "train a preset from scratch instead (needs --tokenizer)"),
    Flag("--task", "task.name", catalog.names(catalog.TASKS)),
    Flag("--tokenizer", "tokenizer", "tokenizer.json or folder (default: the model's)"),
    Flag("--train", "data.train", "training records"),
    Flag("--dev", "data.dev", "dev records (default: 10%% of train held out)"),
    Flag("--test", "data.test", "test records, scored at the end"),
    Flag("--epochs", "tune.epochs", "passes over the training data, which set train.steps (default auto: enough for "
         "at least 250 optimizer steps, 3 to 20 epochs; 0: train for train.steps instead)", type=_number_or_auto),
    Flag("--from-scratch", "tune.from_scratch", "same architecture, random weights", switch=True),
    Flag("--freeze-body", "tune.freeze_body", "train only the task head", switch=True),
    Flag("--peft", "peft.method", f"parameter-efficient: {catalog.names(catalog.PEFT_METHODS)} or a "
         "'+' combination (sizes: peft.r=8 peft.alpha=16 peft.n_virtual=20 ...; peft.base_dtype=bf16 stores the "
         "frozen linear weights in bf16, with train.precision=bf16); the run saves a small adapter folder",
         metavar="METHOD"),
    Flag("--add-tokens", "task.add_tokens", "new special tokens (e.g. [START] [DELIM] [EXTRACT]), each a new "
         "embedding row starting at the mean of the others; with --peft only those rows train beside the adapter",
         nargs="+", metavar="TOKEN"),
    Flag("--patience", "tune.patience", "early stopping after N evaluations without dev improvement", type=int),
    Flag("--lr", "train.lr", "peak learning rate (default: 5e-5 for full finetuning, each PEFT method its own; "
         "--print-config shows it)", type=float),
    Flag("--head-lr", "tune.head_lr", "peak learning rate of the task head (default: --lr for full finetuning; with "
         "--peft 1e-2, or --lr if higher, which keeps a small adapter from settling on the majority class)",
         type=float),
    Flag("--batch-size", "train.batch_size", "examples per optimizer step (default: chosen from the data, 8 below 500 "
         "training examples, 16 below 2,000, else 32; grpo: prompts per step, default 4)", type=int),
    Flag("--steps", "train.steps", "optimizer steps, instead of --epochs (grpo: the run's length, default 60)",
         type=int),
    Flag("--reward", "task.rewards", "grpo: a reward function, given once per function: exact_match, format, "
         "length, or module:function (TRL's signature, imported from your code); weights as "
         "task.reward_weights=[1.0,0.5]", repeat=True, metavar="NAME"),
    Flag("--out", "train.out", "run folder (default runs/finetune)"),
)


def add_flags(parser, flags: tuple[Flag, ...]) -> None:
    """Add every flag of the table to ``parser``, its help naming the config key it sets."""
    for f in flags:
        kwargs: dict[str, Any] = {"dest": f.dest, "help": f"{f.help} ({f.key})"}
        if f.switch:
            kwargs["action"] = "store_true"
        elif f.repeat:
            kwargs.update(action="append", metavar=f.metavar or f.flag.lstrip("-").upper())
        else:
            metavar = f.metavar or f.flag.lstrip("-").upper().replace("-", "_")
            kwargs.update({k: v for k, v in (("type", f.type), ("nargs", f.nargs), ("metavar", metavar)) if v})
        parser.add_argument(f.flag, **kwargs)


_DEFAULT_RESUME = "continue from the newest checkpoint in the run folder"
_DEFAULT_PRINT = "print the resolved config and exit"


def add_run_options(parser, flags: tuple[Flag, ...], *, example: str, config: str = "run config file",
                    resume: str = _DEFAULT_RESUME, print_config: str = _DEFAULT_PRINT) -> None:
    """What every training command takes: section.key=value overrides, --config, its flag table, --resume,
    --overwrite, --print-config and --quiet (``example``: an override for the help)."""
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help=f"config overrides, e.g. {example}")
    parser.add_argument("--config", metavar="YAML", help=config)
    add_flags(parser, flags)
    parser.add_argument("--resume", action="store_true", help=resume)
    parser.add_argument("--overwrite", action="store_true", help="start over in a folder that holds an earlier run "
                        "(what that run wrote is removed, nothing else)")
    parser.add_argument("--print-config", action="store_true", help=print_config)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def config_layer(args, flags: tuple[Flag, ...]) -> dict:
    """The flags given on the command line as a nested config dict (``{"train": {"lr": 0.001}}``)."""
    out: dict = {}
    for f in flags:
        value = getattr(args, f.dest, None)
        if value is None or (f.switch and not value):
            continue
        *path, leaf = f.key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = list(value) if isinstance(value, tuple) else value
    return out


def is_worker() -> bool:
    """A process of a torchrun job other than the first: process 0 reports for all."""
    import os

    return int(os.environ.get("RANK", "0")) != 0
