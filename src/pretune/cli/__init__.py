"""The ``pretune`` command: subcommands that call plain functions; no logic of its own."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .. import catalog
from .flags import DISTILL_FLAGS, FINETUNE_FLAGS, PRETRAIN_FLAGS, add_flags, config_layer

EPILOG = """examples:
  pretune tokenizer train CORPUS/*.txt.gz --kind wordpiece --vocab-size 8000 --out tok/tokenizer.json
  pretune data clean raw/*.jsonl.gz --out clean.jsonl.gz      C4-style cleaning with a per-rule report
  pretune data tokenize CORPUS/*.txt.gz --tokenizer tok/tokenizer.json --out store/
  pretune pretrain --preset tiny-bert-base --objective mlm --tokenizer tok/tokenizer.json --data CORPUS/*.txt.gz
  pretune pretrain --config configs/pretrain/bert-mlm.yaml train.lr=1e-3 --resume
  pretune distill --teacher runs/bert/model --preset distilbert-base --init-from-teacher every_other --data CORPUS
  pretune show bert-base                 architecture and parameter counts of a preset
  pretune show path/to/checkpoint        ... or of a saved checkpoint / Hugging Face folder
  pretune convert --from-hf HF_DIR --out CKPT_DIR
  pretune convert --to-hf CKPT_DIR --out HF_DIR
  pretune bench model                    training throughput vs transformers (BENCHMARKS.md)
  pretune bench pretrain                 MLM pretraining tokens/s vs transformers, tokenize-to-store MB/s
  pretune bench finetune                 MiniLM on sms_spam, 1 epoch: wall time and accuracy vs HF Trainer
  pretune bench generate                 greedy decoding tokens/s of SmolLM2-135M vs transformers' generate
  pretune finetune --model CKPT --task classification --train train.jsonl --dev dev.jsonl --test test.jsonl
  pretune evaluate runs/finetune/model test.jsonl      accuracy, F1, MCC, ... of a finetuned model
  pretune predict runs/finetune/model new.jsonl --out predictions.jsonl
  pretune embed MODEL_DIR sentences.txt --out emb.npy   sentence embeddings (--similarity ranks pairs)
  pretune generate MODEL "Once upon a time" --max-new-tokens 40   greedy / --do-sample / --num-beams 4, streamed
  pretune prompt MODEL --data test.jsonl --template 'Message: {text}\\nSpam? Answer:' --labels 'ham=No,spam=Yes' \\
      --shots 4 --shots-from train.jsonl      few-shot classification by label-word likelihood (--cot: reasoning)
  pretune quickstart                     tokenizer -> MLM pretraining -> finetune vs scratch vs MiniLM, a table + plot
  pretune sweep configs/sweep/lora-lr.yaml --jobs 2   grid / random search x seeds: results, mean ± std table, plots
  pretune experiment list                 the lectures' findings re-run: pretune experiment NAME -> table + verdict
  pretune data bundled --copy data       the bundled real corpus and task files (list them, or copy them to data/)
"""


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

OVERRIDE = re.compile(r"^-{0,2}[A-Za-z_]\w*\.[\w.]+=")  # a `section.key=value` config override


def _load_any(spec: str):
    """A preset name, or any model folder (pretune, Hugging Face, adapter) -> (config, model or None)."""
    from ..loading import load
    from ..presets import PRESETS, get_preset

    if spec in PRESETS:
        return get_preset(spec), None
    if Path(spec).is_dir():
        model = load(spec)
        return model.config, model
    from ..config import ConfigError, _did_you_mean
    from ..presets import preset_names

    raise ConfigError(f"{spec!r} is neither a preset nor a folder{_did_you_mean(spec, preset_names())}")


def cmd_show(args) -> int:
    import torch

    from ..model import TransformerLM, count_parameters

    cfg, model = _load_any(args.target)
    if model is None:
        with torch.device("meta"):  # no memory, no init time: counts only
            model = TransformerLM(cfg)
    counts = count_parameters(model)
    print(f"{args.target}: {cfg.family} transformer")
    layers = cfg.layers_text + (" (one block's weights shared across depth)" if cfg.share_layers else "")
    attn = f"{cfg.n_heads} heads x {cfg.dh}"
    if cfg.kv_heads != cfg.n_heads:
        attn += f", {cfg.kv_heads} kv heads (GQA)"
    if cfg.qkv_bias and not cfg.bias:
        attn += ", q/k/v biases"
    if cfg.qk_norm:
        attn += ", q/k norm"
    if cfg.sliding_window is not None:
        where = "" if cfg.sliding_layers is None else f" on layers {', '.join(map(str, cfg.sliding_layers))}"
        attn += f", sliding window {cfg.sliding_window}{where}"
    if cfg.attn_softcap is not None:
        attn += f", scores soft-capped at {cfg.attn_softcap:g}"
    rope = f" (base {cfg.rope_base:g}" + (f", sliding-window layers {cfg.rope_local_base:g}"
                                           if cfg.rope_local_base is not None else "") + (
        f", {cfg.rope_scaling} scaling x{cfg.rope_factor:g}" if cfg.rope_scaling != "none" else "") + ")"
    rows = [
        ("layers", layers), ("dim", cfg.dim), ("attention", attn), ("ffn", f"{cfg.ffn}, inner {cfg.ffn_dim}"),
        ("norm", f"{cfg.norm} ({cfg.norm_placement}-norm, eps {cfg.norm_eps:g})"),
        ("positions", cfg.position + (rope if cfg.position == "rope" else "")),
        ("vocab", cfg.vocab_size), ("max_seq_len", cfg.max_seq_len),
        ("embeddings", ("tied" if cfg.tie_embeddings else "untied")
         + (f", factorised {cfg.embed_dim}" if cfg.embed_dim else "")
         + (", scaled by sqrt(dim)" if cfg.scale_embeddings else "")
         + (f", {cfg.token_types} token types" if cfg.token_types else "")),
        ("head", cfg.head + (" + pooler" if cfg.pooler else "") + (" + NSP/SOP pair head" if cfg.pair_head else "")
         + (f", logits soft-capped at {cfg.logit_softcap:g}" if cfg.logit_softcap is not None and cfg.head == "lm"
            else "")
         + (", fixed logit bias" if cfg.logit_bias and cfg.head == "lm" else "")),
    ]
    for k, v in rows:
        print(f"  {k:<12} {v}")
    print("parameters:")
    for part, n in counts.items():
        if part != "total":
            print(f"  {part:<12} {n:>14,}")
    print(f"  {'total':<12} {counts['total']:>14,}  ({counts['total'] / 1e6:.1f}M)")
    if args.json:
        print(json.dumps({"config": cfg.to_dict(), "parameters": counts}, indent=2))
    return 0


DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB powers of 1024, a bare number bytes)."""
    from ..config import ConfigError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if m is None:
        raise ConfigError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def cmd_consolidate(args) -> int:
    from ..consolidate import consolidate
    from ..outputs import check_folder

    check_folder(args.out, overwrite=args.overwrite)
    out = consolidate(args.checkpoint, args.out, dtype=args.dtype)
    print(f"consolidated {args.checkpoint} -> {out}")
    return 0


def cmd_convert(args) -> int:
    from ..checkpoint import save
    from ..interop import TOKENIZER_FILES, to_hf
    from ..loading import folder_kind, load
    from ..outputs import check_folder

    if bool(args.from_hf) == bool(args.to_hf):
        from ..config import ConfigError

        raise ConfigError("give exactly one of --from-hf DIR or --to-hf DIR (got neither or both)")
    check_folder(args.out, overwrite=args.overwrite)
    if args.from_hf:
        src = Path(args.from_hf)
        kind = folder_kind(src)
        if kind != "transformers":
            from ..interop import InteropError

            raise InteropError(f"{src} is a {kind} folder, not a Hugging Face one (its config.json names no "
                               "model_type); --to-hf exports a pretune checkpoint")
        model = load(src)
        tok = src / "tokenizer.json"
        if not tok.is_file():  # a SentencePiece-only folder (ALBERT, T5, DeBERTa): its tokenizer, converted
            from ..spm import find_model
            from ..tokenization import Tokenizer

            tok = Tokenizer.load(src) if find_model(src) is not None else None
        save(model, args.out, tokenizer=tok)
        print(f"imported {src} -> {args.out} ({model.num_parameters():,} parameters)")
    else:
        src = Path(args.to_hf)
        kind = folder_kind(src)
        if kind == "transformers":
            from ..interop import InteropError

            raise InteropError(f"{src} is already a Hugging Face folder; --from-hf imports it")
        model = load(src, merge=True)  # an adapter folder exports as its base with the adapter folded in
        tok_dir = src if any((src / n).is_file() for n in TOKENIZER_FILES) else None
        import torch

        to_hf(model, args.out, tokenizer_dir=tok_dir, dtype=getattr(torch, DTYPES[args.dtype] or "float32"),
              max_shard_bytes=parse_size(args.max_shard_size))
        print(f"exported {src} -> {args.out} (loads with transformers.AutoModel*.from_pretrained)")
    return 0


def _worker() -> bool:
    """A process of a torchrun job other than the first: process 0 reports for all."""
    return int(os.environ.get("RANK", "0")) != 0


def cmd_pretrain(args) -> int:
    from ..pretrain import load_run_config, pretrain

    cfg = load_run_config(args.config, args.overrides, base=config_layer(args, PRETRAIN_FLAGS))
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
        return 0
    result = pretrain(cfg, resume=args.resume, overwrite=args.overwrite, show_progress=not args.quiet)
    return _report_run(result, "finetunable model")


def _report_run(result, what: str) -> int:
    """The closing lines of a pretraining-like run (process 0 only)."""
    if _worker():
        return 0
    if result.train_loss != result.train_loss:  # no step ran: the run had already finished
        print(f"nothing to do: {result.run_dir} already finished at step {result.steps}")
        return 0
    ev = ", ".join(f"{k} {v:.4g}" for k, v in result.eval.items())
    print(f"done: {result.steps} steps, train loss {result.train_loss:.4f}" + (f"; eval {ev}" if ev else ""))
    print(f"  {what}: {result.model_dir}   curves: {result.run_dir / 'loss.png'}")
    return 0


def cmd_distill(args) -> int:
    from ..distill import distill, load_distill_config

    cfg = load_distill_config(args.config, args.overrides, base=config_layer(args, DISTILL_FLAGS))
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
        return 0
    result = distill(cfg, resume=args.resume, overwrite=args.overwrite, show_progress=not args.quiet)
    return _report_run(result, "student")


def cmd_finetune(args) -> int:
    from ..config import ConfigError
    from ..finetune import finetune, load_finetune_config, resolved_yaml

    base = config_layer(args, FINETUNE_FLAGS)
    if {"init", "preset"} <= set(base.get("model", {})):
        raise ConfigError("give --model (start from a checkpoint) or --preset (train from scratch), not both")
    cfg = load_finetune_config(args.config, args.overrides, base=base)
    if args.print_config:
        print(resolved_yaml(cfg))
        return 0
    result = finetune(cfg, resume=args.resume, overwrite=args.overwrite, show_progress=not args.quiet)
    if not _worker():
        print(f"  results: {result.run_dir / 'results.json'}   model: {result.model_dir}")
    return 0


def _task_overrides(args) -> dict:
    out = {}
    if getattr(args, "task", None):
        out["name"] = args.task
    for item in getattr(args, "set", None) or []:
        key, _, value = item.partition("=")
        if not _ or not key:
            from ..config import ConfigError

            raise ConfigError(f"--set {item!r} must look like field=value (e.g. text_field=sentence)")
        out[key.removeprefix("task.")] = int(value) if value.isdigit() else value
    return out


def cmd_evaluate(args) -> int:
    from ..inference import evaluate, format_scores
    from ..outputs import check_file

    if args.json:
        check_file(args.json, overwrite=args.overwrite, what="metrics file")
    metrics = evaluate(args.model, args.data, task_overrides=_task_overrides(args), batch_size=args.batch_size,
                       precision=args.precision, show_progress=not args.quiet, base=args.base or "")
    print(format_scores(Path(args.data).name, metrics))
    if args.json:
        from ..outputs import write_atomic

        write_atomic(Path(args.json), json.dumps(metrics, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_predict(args) -> int:
    from ..inference import predict
    from ..outputs import check_file

    check_file(args.out, overwrite=args.overwrite, what="predictions file")
    n = predict(args.model, args.data, args.out, task_overrides=_task_overrides(args), batch_size=args.batch_size,
                precision=args.precision, show_progress=not args.quiet, base=args.base or "", scores=args.scores)
    print(f"wrote {n} predictions to {args.out}")
    return 0


def cmd_quickstart(args) -> int:
    from ..quickstart import run_quickstart

    run_quickstart(args.out, fast=args.fast, seed=args.seed, minilm=not args.no_minilm, show_progress=not args.quiet,
                   overwrite=args.overwrite)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretune", description="Pretrain once, finetune many times: "
                                "transformer language models end to end.", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from .. import __version__

    p.add_argument("--version", action="version", version=f"pretune {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("show", help="print a model's architecture and parameter counts",
                       description="Print the architecture and parameter counts (total and per part) of a "
                       "preset, a pretune checkpoint folder or a Hugging Face folder.")
    s.add_argument("target", metavar="PRESET_OR_DIR", help="preset name (see --list) or folder")
    s.add_argument("--json", action="store_true", help="also print the resolved config and counts as JSON")
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("presets", help="list the named model presets")
    s.set_defaults(func=lambda a: print("\n".join(__import__("pretune").preset_names())) or 0)

    s = sub.add_parser("convert", help="import from / export to Hugging Face transformers folders",
                       description="Convert between pretune checkpoints and Hugging Face transformers folders of "
                       "the families below. Outputs are written atomically.",
                       epilog=f"families (the model_type of config.json):\n{catalog.listing(catalog.FAMILIES)}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--from-hf", metavar="DIR", help="Hugging Face folder to import")
    s.add_argument("--to-hf", metavar="DIR", help="pretune checkpoint folder to export")
    s.add_argument("--out", metavar="DIR", required=True, help="destination folder (new or empty)")
    s.add_argument("--overwrite", action="store_true", help="write into a non-empty --out: pretune's earlier output "
                   "there is replaced, anything else in it stays untouched")
    s.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="--to-hf: the weights' dtype in the exported files (bf16 halves a large model; default fp32)")
    s.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="--to-hf: larger weights are split into files of at most SIZE (e.g. 2GB, 500MB) with "
                   "transformers' model.safetensors.index.json (default 5GB)")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("consolidate", help="a plain model folder from a training checkpoint (sharded FSDP ones too)",
                       description="Write the model a training checkpoint holds (<run>/checkpoints/step-N, plain or "
                       "sharded by an FSDP run of any number of processes) as a plain pretune model folder, in one "
                       "process; what the run's model/ holds at its end, from any step.")
    s.add_argument("checkpoint", help="a training checkpoint folder: <run>/checkpoints/step-NNNNNNNN")
    s.add_argument("--out", metavar="DIR", required=True, help="destination model folder (new or empty)")
    s.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights' dtype (default fp32)")
    s.add_argument("--overwrite", action="store_true", help="write into a non-empty --out: pretune's earlier output "
                   "there is replaced, anything else in it stays untouched")
    s.set_defaults(func=cmd_consolidate)

    from .bench import add_bench_parser
    from .data import add_data_parsers

    add_bench_parser(sub)
    add_data_parsers(sub)

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
    s.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. train.lr=1e-3")
    s.add_argument("--config", metavar="YAML", help="run config file")
    add_flags(s, PRETRAIN_FLAGS)
    s.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run folder")
    s.add_argument("--overwrite", action="store_true", help="start over in a folder that holds an earlier run (what "
                   "that run wrote is removed, nothing else)")
    s.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
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
    s.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. train.lr=1e-3")
    s.add_argument("--config", metavar="YAML", help="run config file")
    add_flags(s, DISTILL_FLAGS)
    s.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run folder")
    s.add_argument("--overwrite", action="store_true", help="start over in a folder that holds an earlier run (what "
                   "that run wrote is removed, nothing else)")
    s.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_distill)

    s = sub.add_parser("finetune", help=f"finetune a checkpoint on a downstream task ({catalog.names(catalog.TASKS)})",
                       description="Finetune a pretune checkpoint or Hugging Face folder (or a preset from scratch) "
                       "on labelled JSONL/CSV/TSV/Parquet data, with the task's standard metrics on dev (keep-best, "
                       "early stopping) and test. Settings: --config YAML, then the flags below, then "
                       "section.key=value overrides (sections: model, tokenizer, task, data, tune, peft, train; see "
                       "--print-config).",
                       epilog=FINETUNE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. task.max_len=64")
    s.add_argument("--config", metavar="YAML", help="finetuning config file")
    add_flags(s, FINETUNE_FLAGS)
    s.add_argument("--resume", action="store_true", help="continue the run in --out from its newest intact checkpoint "
                   "(bit for bit as if it had not stopped)")
    s.add_argument("--overwrite", action="store_true", help="start over in a folder that holds an earlier run (what "
                   "that run wrote is removed, nothing else)")
    s.add_argument("--print-config", action="store_true", help="print the config the run would use and exit: "
                   "values derived from the data (steps from epochs, warmup, evaluation interval, learning rate) "
                   "filled in and marked")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
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
        s.add_argument("--set", action="append", metavar="FIELD=VALUE",
                       help="task setting override, e.g. --set text_field=sentence (repeatable)")
        s.add_argument("--batch-size", type=int, default=64, help="examples per forward pass (default 64)")
        s.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="inference precision")
        s.add_argument("--quiet", action="store_true", help="no progress bars")
        s.set_defaults(func=cmd_evaluate if name == "evaluate" else cmd_predict)

    from .embed import add_embed_parser

    add_embed_parser(sub)

    from .peft import add_peft_parser

    add_peft_parser(sub)

    from .prompt import add_prompt_parser

    add_prompt_parser(sub)

    from .generate import add_generate_parser

    add_generate_parser(sub)

    from .sweep import add_sweep_parser

    add_sweep_parser(sub)

    from .experiment import add_experiment_parser

    add_experiment_parser(sub)

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
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the ``pretune`` command line. pretune's errors print one line, ``pretune CMD: message`` (exit 2); an
    interrupted run says how to continue it (exit 130 for Ctrl-C, 143 for SIGTERM); anything unexpected prints one
    line and asks for ``--debug`` (which shows the traceback instead)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    overrides: list[str] = []
    if argv and argv[0] in ("pretrain", "distill", "finetune"):  # section.key=value (or --section.key=value) anywhere
        overrides = [a.lstrip("-") for a in argv[1:] if OVERRIDE.match(a)]
        argv = [argv[0]] + [a for a in argv[1:] if not OVERRIDE.match(a)]
    args = parser.parse_args(argv)
    if args.command in ("pretrain", "distill", "finetune"):
        args.overrides = overrides
    try:
        return args.func(args) or 0
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line (or, with --debug, the traceback)
        if debug or isinstance(e, SystemExit):
            raise
        sub = getattr(args, "what", None) or getattr(args, "peft_command", None)
        return _report(f"{args.command} {sub}" if sub else args.command, e)


def _report(command: str, e: BaseException) -> int:
    """Print one line for ``e`` and return the exit code."""
    import errno

    from ..checkpoint import CheckpointError
    from ..config import ConfigError
    from ..data.readers import DataError
    from ..data.store import StoreError
    from ..interop import InteropError
    from ..tokenization import TokenizerError
    from ..train.loop import Interrupted, TrainingDiverged

    where = f"pretune {command}"
    if isinstance(e, BrokenPipeError):  # `pretune ... | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    if isinstance(e, Interrupted):
        print(f"{where}: {e}", file=sys.stderr)
        return e.exit_code
    if isinstance(e, KeyboardInterrupt):
        print(f"{where}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    if isinstance(e, TrainingDiverged):
        print(f"{where}: {e}", file=sys.stderr)
        return 3
    if isinstance(e, (ConfigError, CheckpointError, InteropError, DataError, StoreError, TokenizerError)):
        print(f"{where}: {e}", file=sys.stderr)
        return 2
    if isinstance(e, OSError):
        name = f" {e.filename}" if getattr(e, "filename", None) else ""
        if e.errno == errno.ENOSPC:
            print(f"{where}: no space left on the device while writing{name}; free some space (a checkpoint being "
                  "written was discarded, the ones before it are intact) and run again (--resume for a run)",
                  file=sys.stderr)
        else:
            print(f"{where}: {e.strerror or e}{':' + name if name else ''}", file=sys.stderr)
        return 2
    from ..checkpoint import disk_full

    full = disk_full(e, ".") if isinstance(e, Exception) else None  # safetensors' / torch's own words for it
    if full is not None:
        print(f"{where}: no space left on the device; free some space and run again (--resume for a run)",
              file=sys.stderr)
        return 2
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    print(f"{where}: unexpected {type(e).__name__}{': ' + first if first else ''}; run with --debug for the "
          "traceback", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
