"""``pretune finetune``, ``evaluate`` and ``predict``: a task model from a checkpoint and labelled data, then its
scores and predictions on other files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import catalog
from .flags import FINETUNE_FLAGS, add_run_options, config_layer, is_worker
from .quantize import add_quantize_argument

FINETUNE_EPILOG = f"""tasks and the record fields they read (rename with task.<x>_field=NAME):
{catalog.listing(catalog.TASKS)}
PEFT methods (--peft METHOD, or a '+' combination such as lora+prompt):
{catalog.listing(catalog.PEFT_METHODS)}
examples:
  pretune finetune --model MINILM_DIR --task classification --train train.jsonl --dev dev.jsonl --test test.jsonl
  pretune finetune --model runs/mlm/model --from-scratch --task classification --train ... --epochs 2
  pretune finetune --model ckpt --task pair --train pairs.jsonl tune.freeze_body=true train.lr=1e-3
  pretune evaluate runs/finetune/model test.jsonl
  pretune predict runs/finetune/model new.jsonl --out predictions.jsonl
"""


def add_finetune_parsers(sub) -> None:
    s = sub.add_parser("finetune", help=f"finetune a checkpoint on a downstream task ({catalog.names(catalog.TASKS)})",
                       description="Finetune a pretune checkpoint or Hugging Face folder (or a preset from scratch) "
                       "on labelled JSONL/CSV/TSV/Parquet data, with the task's standard metrics on dev (keep-best, "
                       "early stopping) and test. Settings: --config YAML, then the flags below, then "
                       "section.key=value overrides (sections: model, tokenizer, task, data, tune, peft, train; see "
                       "--print-config).",
                       epilog=FINETUNE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(s, FINETUNE_FLAGS, example="task.max_len=64", config="finetuning config file",
                    resume="continue the run in --out from its newest intact checkpoint (bit for bit as if it had "
                    "not stopped)",
                    print_config="print the config the run would use and exit: values derived from the data (steps "
                    "from epochs, warmup, evaluation interval, learning rate) filled in and marked")
    s.set_defaults(func=cmd_finetune)

    for name, helptext in (("evaluate", "score a finetuned model on a labelled file with the task's metrics"),
                           ("predict", "write a finetuned model's predictions for a file as JSONL")):
        s = sub.add_parser(name, help=helptext, description=helptext + ". The task and its fields come from the "
                           "model's task.json; an imported Hugging Face task model needs --task.")
        s.add_argument("model", help="finetuned checkpoint folder (or Hugging Face *For...* folder)")
        s.add_argument("data", help="JSONL/CSV/TSV/Parquet records")
        if name == "predict":
            s.add_argument("--out", required=True, help="predictions JSONL (a new file)")
            s.add_argument("--scores", action="store_true", help="also write each record's raw scores (class "
                           "probabilities, span scores, ...)")
        else:
            s.add_argument("--json", help="also write the metrics to this JSON file (a new file)")
        s.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")
        s.add_argument("--task", help=f"task name when the model has no task.json: {catalog.names(catalog.TASKS)}")
        s.add_argument("--base", help="base model of an adapter folder (default: the path it recorded)")
        s.add_argument("--reference", metavar="MODEL", help="dpo/kto: the reference model the rewards compare with "
                       "(default: an adapter folder's base with the adapter off; a full model's starting model, "
                       "model.init of its run.yaml)")
        s.add_argument("--set", action="append", metavar="FIELD=VALUE",
                       help="task setting override, e.g. --set text_field=sentence (repeatable)")
        s.add_argument("--batch-size", type=int, default=64, help="examples per forward pass (default 64)")
        s.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="inference precision")
        add_quantize_argument(s)
        s.add_argument("--quiet", action="store_true", help="no progress bars")
        s.set_defaults(func=cmd_evaluate if name == "evaluate" else cmd_predict)


def cmd_finetune(args) -> int:
    from ..config import ConfigError
    from ..jobs.finetune import finetune
    from ..jobs.finetune.config import load_finetune_config
    from ..jobs.finetune.prepare import resolved_yaml

    base = config_layer(args, FINETUNE_FLAGS)
    if {"init", "preset"} <= set(base.get("model", {})):
        raise ConfigError("give --model (start from a checkpoint) or --preset (train from scratch), not both")
    cfg = load_finetune_config(args.config, args.overrides, base=base)
    if args.print_config:
        print(resolved_yaml(cfg))
        return 0
    result = finetune(cfg, resume=args.resume, overwrite=args.overwrite, show_progress=not args.quiet)
    if not is_worker():
        print(f"  results: {result.run_dir / 'results.json'}   model: {result.model_dir}")
    return 0


SET_FORM = "--set {key}=..."  # how evaluate's and predict's hints spell a task setting (tasks.base.setting_form)


def _task_overrides(args) -> dict:
    out = {}
    if getattr(args, "task", None):
        out["name"] = args.task
    for item in getattr(args, "set", None) or []:
        key, _, value = item.partition("=")
        if not _ or not key:
            from ..config import ConfigError

            raise ConfigError(f"--set {item!r} must look like field=value (e.g. text_field=sentence)")
        out[key.removeprefix("task.")] = _scalar(value)
    return out


def _scalar(text: str):
    """A ``--set`` value as the setting takes it: true/false, an integer, a number, else the text as written (a text
    setting turns a number back into its text)."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def cmd_evaluate(args) -> int:
    from ..io.outputs import check_file
    from ..jobs.inference import evaluate, format_scores
    from ..tasks.base import setting_form

    if args.json:
        check_file(args.json, overwrite=args.overwrite, what="metrics file")
    with setting_form(SET_FORM):
        metrics = evaluate(args.model, args.data, task_overrides=_task_overrides(args), batch_size=args.batch_size,
                           precision=args.precision, show_progress=not args.quiet, base=args.base or "",
                           reference=args.reference or "", quantize=args.quantize)
    print(format_scores(Path(args.data).name, metrics))
    if args.json:
        from ..io.outputs import write_atomic

        write_atomic(Path(args.json), json.dumps(metrics, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_predict(args) -> int:
    from ..io.outputs import check_file
    from ..jobs.inference import predict
    from ..tasks.base import setting_form

    check_file(args.out, overwrite=args.overwrite, what="predictions file")
    with setting_form(SET_FORM):
        n = predict(args.model, args.data, args.out, task_overrides=_task_overrides(args), batch_size=args.batch_size,
                    precision=args.precision, show_progress=not args.quiet, base=args.base or "", scores=args.scores,
                    reference=args.reference or "", quantize=args.quantize)
    print(f"wrote {n} predictions to {args.out}")
    return 0
