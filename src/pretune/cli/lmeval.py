"""``pretune eval MODEL --tasks ...``: lm-evaluation-harness benchmarks on any model pretune loads (docs/eval.md).

Not ``pretune evaluate``, which scores a finetuned model on a labelled file with its own task's metrics.
"""

from __future__ import annotations

import argparse
import json
import textwrap

EVAL_DESCRIPTION = (
    "Score a model (a run folder, a pretune checkpoint, a Hugging Face folder, an adapter folder or a GGUF file) on "
    "lm-evaluation-harness tasks (lm-eval's own, or task YAMLs in --include-path) with lm-eval's 'pretune' model "
    "class: log-likelihoods through pretune's batched scoring (a multiple-choice question's context runs once), "
    "generation through pretune.generate. Prints lm-eval's table; --out writes its results as JSON. lm-eval's own "
    "tasks download their data from the Hugging Face Hub. Needs the eval extra: pip install 'pretune[eval]'. "
    "(pretune evaluate is another thing: a finetuned model's task metrics on a labelled file.)")
EVAL_EPILOG = r"""examples:
  pretune eval runs/sft --tasks hellaswag,arc_easy --num-fewshot 0 --batch-size 16
  pretune eval SMOLLM2_DIR --tasks my_task --include-path my_tasks/ --limit 100 --out results.json
  pretune eval runs/lora --tasks my_task --include-path my_tasks/ --model-args max_length=1024,dtype=bfloat16
"""


def add_eval_parser(sub) -> argparse.ArgumentParser:
    """Register ``eval`` (``func=cmd_eval``); returns its parser."""
    s = sub.add_parser("eval", help="lm-evaluation-harness benchmarks (hellaswag, arc, your task YAMLs) on a model",
                       description=textwrap.fill(EVAL_DESCRIPTION, 100), epilog=EVAL_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", metavar="MODEL", help="model folder (any that pretune loads) or GGUF file")
    s.add_argument("--tasks", required=True, metavar="T1,T2",
                   help="lm-eval task or group names, comma-separated")
    s.add_argument("--include-path", metavar="DIR", help="a folder of lm-eval task YAMLs added to lm-eval's own")
    s.add_argument("--num-fewshot", type=int, metavar="K", help="examples shown before each question (task default)")
    s.add_argument("--limit", type=float, metavar="N",
                   help="examples per task at most (a fraction of each task when < 1)")
    s.add_argument("--batch-size", type=int, default=16, metavar="N",
                   help="prompts per forward pass (default 16)")
    s.add_argument("--base", metavar="DIR", help="an adapter MODEL's base folder (default: the one it recorded)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights' dtype")
    s.add_argument("--device", default="cpu", help="torch device (default cpu)")
    s.add_argument("--model-args", default="", metavar="K=V,...",
                   help="more arguments of the pretune model class (max_length, max_gen_toks, add_bos_token, "
                        "prefix_token_id)")
    s.add_argument("--seed", type=int, default=0, help="lm-eval's seeds (few-shot sampling; default 0)")
    s.add_argument("--log-samples", action="store_true", help="keep every example's requests and answers in --out")
    s.add_argument("--out", metavar="FILE.json", help="write lm-eval's results (and samples) as JSON")
    s.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    s.set_defaults(func=cmd_eval)
    return s


def cmd_eval(args) -> int:
    from ..config import ConfigError

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    if args.out:
        from ..io.outputs import check_file

        check_file(args.out, overwrite=args.overwrite, what="--out")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError(f"--tasks {args.tasks!r} names no task")
    extra = {}
    for item in filter(None, args.model_args.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--model-args {item!r}: expected KEY=VALUE")
        extra[key.strip()] = value.strip()
    try:
        from lm_eval.utils import make_table

        from ..jobs.harness import evaluate
    except ImportError as e:
        raise ConfigError(f"pretune eval needs lm-evaluation-harness ({e}): pip install 'pretune[eval]'") from None
    results = evaluate(args.model, tasks=tasks, include_path=args.include_path, num_fewshot=args.num_fewshot,
                       limit=args.limit, batch_size=args.batch_size, base=args.base, dtype=args.dtype,
                       device=args.device, seed=args.seed, log_samples=args.log_samples, **extra)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if args.out:
        from ..io.outputs import write_atomic

        write_atomic(args.out, json.dumps(results, indent=2, default=str, ensure_ascii=False) + "\n")
        print(f"results: {args.out}")
    return 0
