"""``pretune pretrain`` and ``pretune distill``: flags and YAML into a run config, then the job."""

from __future__ import annotations

import argparse

from .. import catalog
from .flags import DISTILL_FLAGS, PRETRAIN_FLAGS, add_run_options, config_layer, is_worker


def add_pretrain_parsers(sub) -> None:
    s = sub.add_parser("pretrain", help=f"pretrain a model with any objective ({catalog.names(catalog.OBJECTIVES)})",
                       description="Pretrain from raw text: tokenizer -> token store -> packed blocks -> objective "
                       "-> checkpoints. Settings come from a preset, then --config YAML, then the flags below, then "
                       "section.key=value overrides (sections: model, tokenizer, data, objective, train; see "
                       "--print-config). "
                       "Under `torchrun --nproc_per_node N` the same command trains with DDP.",
                       epilog=f"objectives (--objective NAME; the families that serve each):\n"
                       f"{catalog.listing(catalog.OBJECTIVES)}\nexample: pretune pretrain --preset tiny-bert-base "
                       "--objective mlm --tokenizer tok.json --data corpus/*.txt.gz train.steps=200 "
                       "objective.whole_word=true",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(s, PRETRAIN_FLAGS, example="train.lr=1e-3")
    s.set_defaults(func=cmd_pretrain)

    s = sub.add_parser("distill", help="knowledge distillation: train a student on a teacher's soft predictions "
                       "(DistilBERT)",
                       description="Distil a teacher (a pretune checkpoint or Hugging Face folder with an MLM or LM "
                       "head) into a student (--preset with model.KEY=VALUE overrides, or --init CHECKPOINT) on raw "
                       "text: loss = alpha_kl * T^2 * KL(teacher || student) over the masked (MLM) or all (CLM) "
                       "positions + alpha_hard * the MLM / CLM loss + alpha_cos * (1 - cos) of the last hidden "
                       "states. The pretraining pipeline and trainer (checkpoints, --resume, torchrun) serve it; "
                       "settings as pretune pretrain's (sections: model, tokenizer, data, objective, train).",
                       epilog="example: pretune distill --teacher runs/bert/model --preset tiny-bert-base "
                       "model.n_layers=1 --init-from-teacher every_other --data corpus.txt --out runs/distil "
                       "train.steps=200\nsee docs/distill.md",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(s, DISTILL_FLAGS, example="train.lr=1e-3")
    s.set_defaults(func=cmd_distill)


def cmd_pretrain(args) -> int:
    from ..jobs.pretrain import load_run_config, pretrain

    cfg = load_run_config(args.config, args.overrides, base=config_layer(args, PRETRAIN_FLAGS))
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
        return 0
    result = pretrain(cfg, resume=args.resume, overwrite=args.overwrite, show_progress=not args.quiet)
    return _report_run(result, "finetunable model")


def _report_run(result, what: str) -> int:
    """The closing lines of a pretraining-like run (process 0 only)."""
    if is_worker():
        return 0
    if result.train_loss != result.train_loss:  # no step ran: the run had already finished
        print(f"nothing to do: {result.run_dir} already finished at step {result.steps}")
        return 0
    ev = ", ".join(f"{k} {v:.4g}" for k, v in result.eval.items())
    print(f"done: {result.steps} steps, train loss {result.train_loss:.4f}" + (f"; eval {ev}" if ev else ""))
    print(f"  {what}: {result.model_dir}   curves: {result.run_dir / 'loss.png'}")
    return 0


def cmd_distill(args) -> int:
    from ..jobs.distill import distill, load_distill_config

    cfg = load_distill_config(args.config, args.overrides, base=config_layer(args, DISTILL_FLAGS))
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
        return 0
    result = distill(cfg, resume=args.resume, overwrite=args.overwrite, show_progress=not args.quiet)
    return _report_run(result, "student")
