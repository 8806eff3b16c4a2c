"""``pretune quickstart`` (alias ``demo``): the whole paradigm on the bundled data, a table and a plot."""

from __future__ import annotations


def add_quickstart_parser(sub) -> None:
    s = sub.add_parser("quickstart", aliases=["demo"], help="the whole paradigm on bundled data: tokenizer -> "
                       "MLM pretraining -> finetuning vs from scratch vs MiniLM, with a table and a plot",
                       description="Trains a WordPiece tokenizer on the bundled corpus, pretrains a small BERT-style "
                       "encoder with dynamic masked LM, finetunes it on the bundled sms_spam task, finetunes the same "
                       "architecture from random weights the same way, and the real all-MiniLM-L6-v2 checkpoint when "
                       "its package is installed; prints test accuracy, macro-F1 and training time of each and draws "
                       "quickstart.png (pretraining loss, dev accuracy over finetuning steps). About 6 minutes on 2 "
                       "CPU cores; every artefact lands in --out.")
    s.add_argument("--out", default="runs/quickstart", help="run folder (default runs/quickstart; new or empty)")
    s.add_argument("--overwrite", action="store_true", help="start over in a folder that holds an earlier quickstart "
                   "(what it wrote is removed, nothing else)")
    s.add_argument("--fast", action="store_true", help="a one-minute version with a tiny model (used by the tests)")
    s.add_argument("--seed", type=int, default=0, help="initialisation, data order and masking (default 0)")
    s.add_argument("--no-minilm", action="store_true", help="skip finetuning the real MiniLM checkpoint")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_quickstart)


def cmd_quickstart(args) -> int:
    from ..jobs.quickstart import run_quickstart

    run_quickstart(args.out, fast=args.fast, seed=args.seed, minilm=not args.no_minilm, show_progress=not args.quiet,
                   overwrite=args.overwrite)
    return 0
