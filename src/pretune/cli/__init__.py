"""The ``pretune`` command: subcommands that call plain functions; no logic of its own."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

from .flags import FINETUNE_FLAGS, PRETRAIN_FLAGS, add_flags, config_layer

EPILOG = """examples:
  pretune tokenizer train CORPUS/*.txt.gz --kind wordpiece --vocab-size 8000 --out tok/tokenizer.json
  pretune data clean raw/*.jsonl.gz --out clean.jsonl.gz      C4-style cleaning with a per-rule report
  pretune data tokenize CORPUS/*.txt.gz --tokenizer tok/tokenizer.json --out store/
  pretune pretrain --preset tiny-bert-base --objective mlm --tokenizer tok/tokenizer.json --data CORPUS/*.txt.gz
  pretune pretrain --config configs/pretrain/bert-mlm.yaml train.lr=1e-3 --resume
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
  pretune data bundled --copy data       the bundled real corpus and task files (list them, or copy them to data/)
"""


FINETUNE_EPILOG = """tasks and their data fields (rename with task.<x>_field=NAME):
  classification  text, label           single text -> label ([CLS]/mean pooling; decoders: last token)
  pair            text_a, text_b, label BERT [CLS] a [SEP] b [SEP] or GPT [START] a [DELIM] b [EXTRACT]
  regression      text (or text_a, text_b), label (a number)   STS-B style, MSE
  tagging         tokens, tags          one tag per word (BIO for NER), scored with seqeval
  qa              context, question, answers   extractive spans, sliding window (task.stride), SQuAD 2.0
  seq2seq         source, target        text-to-text with task.prefix; greedy generation
  choice          text, label           classification by the LM's likelihood of each label's answer text
  multilabel      text, label (a list)  a set of labels per text: a sigmoid each, micro/macro F1, subset accuracy
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
    layers = cfg.layers_text
    attn = f"{cfg.n_heads} heads x {cfg.dh}"
    if cfg.kv_heads != cfg.n_heads:
        attn += f", {cfg.kv_heads} kv heads (GQA)"
    rows = [
        ("layers", layers), ("dim", cfg.dim), ("attention", attn), ("ffn", f"{cfg.ffn}, inner {cfg.ffn_dim}"),
        ("norm", f"{cfg.norm} ({cfg.norm_placement}-norm, eps {cfg.norm_eps:g})"),
        ("positions", cfg.position + (f" (base {cfg.rope_base:g})" if cfg.position == "rope" else "")),
        ("vocab", cfg.vocab_size), ("max_seq_len", cfg.max_seq_len),
        ("embeddings", ("tied" if cfg.tie_embeddings else "untied")
         + (f", factorised {cfg.embed_dim}" if cfg.embed_dim else "")
         + (f", {cfg.token_types} token types" if cfg.token_types else "")),
        ("head", cfg.head + (" + pooler" if cfg.pooler else "")),
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


def cmd_convert(args) -> int:
    from ..checkpoint import save
    from ..interop import TOKENIZER_FILES, to_hf
    from ..loading import folder_kind, load

    if bool(args.from_hf) == bool(args.to_hf):
        raise SystemExit("pretune convert: give exactly one of --from-hf DIR or --to-hf DIR")
    if args.from_hf:
        src = Path(args.from_hf)
        kind = folder_kind(src)
        if kind != "transformers":
            from ..interop import InteropError

            raise InteropError(f"{src} is a {kind} folder, not a Hugging Face one (its config.json names no "
                               "model_type); --to-hf exports a pretune checkpoint")
        model = load(src)
        tok = src / "tokenizer.json"
        save(model, args.out, tokenizer=tok if tok.is_file() else None)
        print(f"imported {src} -> {args.out} ({model.num_parameters():,} parameters)")
    else:
        src = Path(args.to_hf)
        kind = folder_kind(src)
        if kind == "transformers":
            from ..interop import InteropError

            raise InteropError(f"{src} is already a Hugging Face folder; --from-hf imports it")
        model = load(src, merge=True)  # an adapter folder exports as its base with the adapter folded in
        tok_dir = src if any((src / n).is_file() for n in TOKENIZER_FILES) else None
        to_hf(model, args.out, tokenizer_dir=tok_dir)
        print(f"exported {src} -> {args.out} (loads with transformers.AutoModel*.from_pretrained)")
    return 0


def cmd_bench(args) -> int:
    from ..bench.model import bench_model, format_rows

    rows = bench_model(families=args.models, dtypes=args.dtypes, rounds=args.rounds, steps=args.steps,
                       warmup=args.warmup, batch=args.batch, seq=args.seq, threads=args.threads,
                       dropout=args.dropout)
    from ..bench.common import report

    return report(rows, format_rows(rows), args.json)


def cmd_bench_pretrain(args) -> int:
    from ..bench.pretrain import run_cli

    return run_cli(args)


def cmd_tokenizer_train(args) -> int:
    from ..tokenization import train_tokenizer

    lower = None if args.lowercase is None else args.lowercase == "yes"
    tok = train_tokenizer(args.files, kind=args.kind, vocab_size=args.vocab_size, specials=args.specials,
                          sentinels=args.sentinels, extra_specials=args.extra_specials, lowercase=lower,
                          min_frequency=args.min_frequency, show_progress=not args.quiet)
    path = tok.save(args.out)
    roles = {r: getattr(tok, f"{r}_id") for r in ("pad", "unk", "cls", "sep", "mask", "bos", "eos")}
    roles = ", ".join(f"{r}={tok.id_to_token(i)}({i})" for r, i in roles.items() if i is not None)
    print(f"{args.kind} tokenizer, {tok.vocab_size} tokens -> {path}")
    print(f"  special tokens: {roles}" + (f", {len(tok.sentinel_ids)} sentinels" if tok.sentinel_ids else ""))
    return 0


def cmd_tokenizer_encode(args) -> int:
    from ..tokenization import Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    for text in args.texts:
        ids = tok.encode(text)
        print(" ".join(tok.id_to_token(i) for i in ids))
        print(" ".join(str(i) for i in ids))
    return 0


def cmd_data_clean(args) -> int:
    from ..data.clean import RULES, CleanConfig, clean_files

    off = set(args.no or [])
    cfg = CleanConfig(bad_words_file=args.bad_words, min_words=args.min_words, min_sentences=args.min_sentences,
                      unwrap=not args.no_unwrap, **{r: False for r in RULES if r in off})
    report = clean_files(args.sources, args.out, cfg, field=args.field, doc_split=args.doc_split, errors=args.errors,
                         show_progress=not args.quiet)
    print(report.format())
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"report -> {args.report}")
    print(f"cleaned text -> {args.out}")
    return 0


def cmd_data_tokenize(args) -> int:
    import time

    from ..data.readers import count_bytes, expand_sources, iter_documents
    from ..data.store import build_store, store_stats
    from ..tokenization import Tokenizer, tokenizer_sha

    tok = Tokenizer.load(args.tokenizer)
    paths = expand_sources(args.sources)
    n_bytes = count_bytes(paths, uncompressed=True)
    t0 = time.perf_counter()
    docs = iter_documents(paths, field=args.field, doc_split=args.doc_split, errors=args.errors)
    store = build_store(docs, tok.tk, args.out, tokenizer_sha=tokenizer_sha(tok),
                        source_desc=json.dumps([str(p) for p in paths]), total_bytes=n_bytes,
                        show_progress=not args.quiet)
    dt = time.perf_counter() - t0
    stats = store_stats(store)
    shown = {k: v for k, v in stats.items() if k in ("tokens", "docs", "sents", "mean_doc_len", "mean_sent_len",
                                                     "vocab_size", "dtype", "bytes_per_token")}
    print(f"token store -> {args.out}: " + ", ".join(
        f"{k} {v:,}" if isinstance(v, int) else f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
        for k, v in shown.items()))
    print(f"  {n_bytes / 1e6:.1f} MB on disk in {dt:.1f}s")
    return 0


def cmd_pretrain(args) -> int:
    from ..pretrain import load_run_config, pretrain

    cfg = load_run_config(args.config, args.overrides, base=config_layer(args, PRETRAIN_FLAGS))
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
        return 0
    result = pretrain(cfg, resume=args.resume, show_progress=not args.quiet)
    if result.train_loss != result.train_loss:  # no step ran: the run had already finished
        print(f"nothing to do: {result.run_dir} already finished at step {result.steps}")
        return 0
    ev = ", ".join(f"{k} {v:.4g}" for k, v in result.eval.items())
    print(f"done: {result.steps} steps, train loss {result.train_loss:.4f}" + (f"; eval {ev}" if ev else ""))
    print(f"  finetunable model: {result.model_dir}   curves: {result.run_dir / 'loss.png'}")
    return 0


def cmd_finetune(args) -> int:
    from ..config import ConfigError
    from ..finetune import finetune, load_finetune_config

    base = config_layer(args, FINETUNE_FLAGS)
    if {"init", "preset"} <= set(base.get("model", {})):
        raise ConfigError("give --model (start from a checkpoint) or --preset (train from scratch), not both")
    cfg = load_finetune_config(args.config, args.overrides, base=base)
    if args.print_config:
        print(resolved_finetune_config(cfg))
        return 0
    result = finetune(cfg, show_progress=not args.quiet)
    print(f"  results: {result.run_dir / 'results.json'}   model: {result.model_dir}")
    return 0


def resolved_finetune_config(cfg) -> str:
    """The config a finetuning run would use, as YAML: the data is read and the model built (nothing is
    trained or written), so the values derived from them appear, each marked with how it was derived."""
    from omegaconf import OmegaConf

    from ..finetune import prepare

    if not cfg.data.train or not (cfg.model.get("init") or cfg.model.get("preset")):
        note = ("# train.steps, warmup_steps, eval_every and lr are derived from the data and the model when the run "
                "starts:\n# give data.train and model.init (or model.preset) to see the values it will use\n")
        return note + OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict()))
    job = prepare(cfg, show_progress=False, log=lambda *a: None)
    lines = OmegaConf.to_yaml(OmegaConf.create(job.cfg.to_dict())).splitlines()
    section = ""
    for i, line in enumerate(lines):
        if line and not line.startswith(" "):
            section = line.rstrip(":")
        elif line.startswith("  ") and not line.startswith("   "):
            key = f"{section}.{line.strip().split(':', 1)[0]}"
            if key in job.derived:
                lines[i] = f"{line}  # derived: {job.derived[key]}"
    return "\n".join(lines)


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

    metrics = evaluate(args.model, args.data, task_overrides=_task_overrides(args), batch_size=args.batch_size,
                       precision=args.precision, show_progress=not args.quiet, base=args.base or "")
    print(format_scores(Path(args.data).name, metrics))
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_predict(args) -> int:
    from ..inference import predict

    n = predict(args.model, args.data, args.out, task_overrides=_task_overrides(args), batch_size=args.batch_size,
                precision=args.precision, show_progress=not args.quiet, base=args.base or "")
    print(f"wrote {n} predictions to {args.out}")
    return 0


def cmd_quickstart(args) -> int:
    from ..quickstart import run_quickstart

    run_quickstart(args.out, fast=args.fast, seed=args.seed, minilm=not args.no_minilm, show_progress=not args.quiet)
    return 0


def cmd_data_bundled(args) -> int:
    from .. import bundled

    if args.copy:
        copied = bundled.copy_to(args.copy)
        print(f"copied {len(copied)} files to {args.copy}/ (corpus/, tasks/, README.md with the licences)")
        return 0
    print(f"bundled real data in {bundled.ROOT} (provenance and licences: README.md there)")
    for name, what in bundled.DESCRIPTIONS.items():
        path = bundled.path(name)
        size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.glob("*.jsonl")))
        print(f"  {name:<34} {size / 1e3:>5.0f} kB  {what}")
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
                       description="Convert between pretune checkpoints and Hugging Face transformers folders "
                       "(BERT, RoBERTa, GPT-2, T5 v1.0/v1.1, Llama). Outputs are written atomically.")
    s.add_argument("--from-hf", metavar="DIR", help="Hugging Face folder to import")
    s.add_argument("--to-hf", metavar="DIR", help="pretune checkpoint folder to export")
    s.add_argument("--out", metavar="DIR", required=True, help="destination folder (replaced if it exists)")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("bench", help="benchmarks against the reference implementations")
    from ..bench.common import add_run_arguments

    bsub = s.add_subparsers(dest="what", metavar="WHAT", required=True)
    b = bsub.add_parser("model", help="forward+backward tokens/s and MFU: pretune vs transformers",
                        description="Times a training step (forward + backward) of a GPT-2-style and a "
                        "BERT-style model (6 layers, dim 512, 8 heads, vocab 8192) against transformers' "
                        "GPT2LMHeadModel / BertForMaskedLM. Every measurement runs in its own process, "
                        "implementations alternate, medians over --rounds are reported.")
    b.add_argument("--models", nargs="+", default=["gpt", "bert"], choices=["gpt", "bert"])
    b.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                   help="bf16 = fp32 weights under torch.autocast(bfloat16)")
    add_run_arguments(b, threads="torch's default")
    b.add_argument("--steps", type=int, default=8, help="timed steps per run (median taken)")
    b.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--seq", type=int, default=256)
    b.add_argument("--dropout", type=float, default=0.1, help="dropout in both models (default 0.1, as GPT-2/BERT)")
    b.set_defaults(func=cmd_bench)
    b = bsub.add_parser("pretrain", help="MLM pretraining tokens/s vs transformers + tokenize-to-store MB/s",
                        description="Times MLM pretraining steps of a BERT-style model (6 layers, dim 512, vocab "
                        "30522: the real MiniLM tokenizer) with pretune's trainer against transformers' "
                        "BertForMaskedLM + DataCollatorForLanguageModeling on the same blocks of the bundled "
                        "corpus, each run in its own process, alternating; also times tokenizing the corpus "
                        "into a token store.")
    from ..bench.pretrain import add_arguments

    add_arguments(b)
    b.set_defaults(func=cmd_bench_pretrain)
    for name, help_, description in (  # each bench.NAME module brings its flags and its run_cli
        ("finetune", "finetuning MiniLM on sms_spam: wall time and test accuracy vs transformers",
         "Finetunes MiniLM (all-MiniLM-L6-v2) on sms_spam for one epoch with pretune "
         "finetune and with transformers' Trainer (same hyperparameters, each run in its own process, "
         "alternating) and reports the wall time of training + one dev evaluation, the test "
         "accuracy of each, their ratio and whether pretune is >= 1.3x faster at equal accuracy "
         "(+- 0.5 points)."),
        ("generate", "greedy decoding tokens/s (batch 1 and 8) vs transformers' generate",
         "Times greedy generation of 128 new tokens after a 32-token prompt with "
         "SmolLM2-135M (fp32, CPU) by pretune's generate (eager, and with compile=True) and "
         "transformers' generate (EOS ignored on every side), each run in its own process, "
         "alternating, and reports tokens/s, the ratios, the compiled side's first-call (compile) "
         "time and whether pretune is >= 1.5x faster at batch 1."),
        ("peft", "LoRA step time and peak memory vs full finetuning and vs peft + transformers",
         "GPT-2 shape (6 layers, dim 512, batch 8 x 256): pretune full finetuning, "
         "pretune LoRA r=8 (q, k, v), transformers full finetuning and peft LoRA r=8 (c_attn), each "
         "run in its own process, alternating; reports the median step time (forward, backward, "
         "AdamW), peak RSS, and whether pretune's LoRA step is >= 1.15x faster than peft's."),
    ):
        module = importlib.import_module(f"pretune.bench.{name}")
        b = bsub.add_parser(name, help=help_, description=description)
        module.add_arguments(b)
        b.set_defaults(func=module.run_cli)

    s = sub.add_parser("tokenizer", help="train or inspect subword tokenizers (BPE, WordPiece, Unigram)")
    tsub = s.add_subparsers(dest="what", metavar="WHAT", required=True)
    t = tsub.add_parser("train", help="train a tokenizer on text files and save tokenizer.json",
                        description="Train a byte-level BPE (GPT-2/RoBERTa), WordPiece (BERT) or Unigram (T5) "
                        "tokenizer with the Hugging Face tokenizers library on text files (plain or .gz, folders, "
                        "globs), with the special tokens of the family (bert: [PAD] [UNK] [CLS] [SEP] [MASK]; "
                        "roberta: <s> <pad> </s> <unk> <mask>; t5: <pad> </s> <unk> + <extra_id_N> sentinels).")
    t.add_argument("files", nargs="+", metavar="FILE", help="text files, folders or glob patterns")
    t.add_argument("--kind", required=True, choices=["bpe", "wordpiece", "unigram"])
    t.add_argument("--vocab-size", type=int, required=True, help="final vocabulary size, special tokens included")
    t.add_argument("--out", required=True, help="tokenizer.json path or folder")
    t.add_argument("--specials", choices=["bert", "roberta", "t5"],
                   help="special-token set (default: bert for wordpiece, roberta for bpe, t5 for unigram)")
    t.add_argument("--sentinels", type=int, help="number of <extra_id_N> sentinels (default: 100 for t5, else 0)")
    t.add_argument("--extra-specials", nargs="*", default=[], metavar="TOKEN", help="more special tokens")
    t.add_argument("--lowercase", choices=["yes", "no"],
                   help="lowercase text (default: yes for wordpiece, no otherwise)")
    t.add_argument("--min-frequency", type=int, default=2, help="minimum pair frequency for a merge (default 2)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_tokenizer_train)
    t = tsub.add_parser("encode", help="show how a tokenizer splits text")
    t.add_argument("tokenizer", help="tokenizer.json or a folder holding one")
    t.add_argument("texts", nargs="+", metavar="TEXT")
    t.set_defaults(func=cmd_tokenizer_encode)

    s = sub.add_parser("data", help="clean text (C4 rules), tokenize it into a memory-mapped token store; the "
                       "bundled real data")
    dsub = s.add_subparsers(dest="what", metavar="WHAT", required=True)

    def _reading(p):
        p.add_argument("--field", default="text", help="JSONL/CSV/Parquet column with the text (default text)")
        p.add_argument("--doc-split", default="blank_line", choices=["blank_line", "line", "file"],
                       help="what a document is in plain text files (default: blank-line separated paragraphs)")
        p.add_argument("--errors", default="strict", choices=["strict", "replace"],
                       help="non-UTF-8 bytes: stop with file and byte offset (strict) or replace with U+FFFD")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    from ..data.clean import RULES

    d = dsub.add_parser("clean", help="C4-style cleaning with a report of what each rule removed",
                        description="Apply the C4 cleaning rules (Raffel et al. 2019 §2.2), each switchable with "
                        "--no RULE, and print how many pages/lines each rule removed.")
    d.add_argument("sources", nargs="+", metavar="SOURCE", help="files, folders or globs")
    d.add_argument("--out", required=True, help="output .jsonl/.jsonl.gz/.txt/.txt.gz (written atomically)")
    d.add_argument("--no", nargs="+", choices=list(RULES), metavar="RULE",
                   help=f"rules to switch off: {', '.join(RULES)}")
    d.add_argument("--min-words", type=int, default=5, help="words a line needs (default 5)")
    d.add_argument("--min-sentences", type=int, default=3, help="sentences a page needs (default 3)")
    d.add_argument("--bad-words", metavar="FILE", help="bad-words list (one per line) instead of the built-in one")
    d.add_argument("--no-unwrap", action="store_true", help="don't join hard-wrapped paragraph lines first")
    d.add_argument("--report", metavar="FILE", help="also write the report as JSON")
    _reading(d)
    d.set_defaults(func=cmd_data_clean)
    d = dsub.add_parser("tokenize", help="tokenize text once into a memory-mapped token store (resumable)")
    d.add_argument("sources", nargs="+", metavar="SOURCE", help="files, folders or globs")
    d.add_argument("--tokenizer", required=True, help="tokenizer.json or a folder holding one")
    d.add_argument("--out", required=True, help="store folder (an interrupted build resumes)")
    _reading(d)
    d.set_defaults(func=cmd_data_tokenize)
    d = dsub.add_parser("bundled", help="list the real corpus and task files that ship with pretune, or copy them",
                        description="The bundled real data (corpus/*.txt.gz for pretraining, tasks/<name>/"
                        "{train,dev,test}.jsonl for finetuning) with one line each; --copy DIR copies it, with the "
                        "README that states each file's provenance and licence.")
    d.add_argument("--copy", metavar="DIR", help="copy the files to DIR (DIR/corpus, DIR/tasks, DIR/README.md)")
    d.set_defaults(func=cmd_data_bundled)

    s = sub.add_parser("pretrain", help="pretrain a model with any objective (clm, mlm, electra, span, denoise, ...)",
                       description="Pretrain from raw text: tokenizer -> token store -> packed blocks -> objective "
                       "-> checkpoints. Settings come from a preset, then --config YAML, then the flags below, then "
                       "section.key=value overrides (sections: model, tokenizer, data, objective, train; see "
                       "--print-config). "
                       "Under `torchrun --nproc_per_node N` the same command trains with DDP.",
                       epilog="objectives: clm, prefix_lm (decoders); mlm, nsp, sop, electra (encoders); span, "
                       "iid_spans, bert_style, iid_mask, drop_tokens, deshuffle, denoise, prefix_lm (encoder-decoders "
                       "and decoders).\nexample: pretune pretrain --preset tiny-bert-base --objective mlm --tokenizer "
                       "tok.json --data corpus/*.txt.gz train.steps=200 objective.whole_word=true",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. train.lr=1e-3")
    s.add_argument("--config", metavar="YAML", help="run config file")
    add_flags(s, PRETRAIN_FLAGS)
    s.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run folder")
    s.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_pretrain)

    s = sub.add_parser("finetune", help="finetune a checkpoint on a downstream task (classification, pair, "
                       "regression, tagging, qa, seq2seq)",
                       description="Finetune a pretune checkpoint or Hugging Face folder (or a preset from scratch) "
                       "on labelled JSONL/CSV/TSV/Parquet data, with the task's standard metrics on dev (keep-best, "
                       "early stopping) and test. Settings: --config YAML, then the flags below, then "
                       "section.key=value overrides (sections: model, tokenizer, task, data, tune, train; see "
                       "--print-config).",
                       epilog=FINETUNE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. task.max_len=64")
    s.add_argument("--config", metavar="YAML", help="finetuning config file")
    add_flags(s, FINETUNE_FLAGS)
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
            s.add_argument("--out", required=True, help="predictions JSONL")
        else:
            s.add_argument("--json", help="also write the metrics to this JSON file")
        s.add_argument("--task", help="task name when the model has no task.json")
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

    s = sub.add_parser("quickstart", aliases=["demo"], help="the whole paradigm on bundled data: tokenizer -> "
                       "MLM pretraining -> finetuning vs from scratch vs MiniLM, with a table and a plot",
                       description="Trains a WordPiece tokenizer on the bundled corpus, pretrains a small BERT-style "
                       "encoder with dynamic masked LM, finetunes it on the bundled sms_spam task, finetunes the same "
                       "architecture from random weights the same way, and the real all-MiniLM-L6-v2 checkpoint when "
                       "its package is installed; prints test accuracy, macro-F1 and training time of each and draws "
                       "quickstart.png (pretraining loss, dev accuracy over finetuning steps). About 6 minutes on 2 "
                       "CPU cores; every artefact lands in --out.")
    s.add_argument("--out", default="runs/quickstart", help="run folder (default runs/quickstart)")
    s.add_argument("--fast", action="store_true", help="a one-minute version with a tiny model (used by the tests)")
    s.add_argument("--seed", type=int, default=0, help="initialisation, data order and masking (default 0)")
    s.add_argument("--no-minilm", action="store_true", help="skip finetuning the real MiniLM checkpoint")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_quickstart)
    return p


def main(argv: list[str] | None = None) -> int:
    from ..checkpoint import CheckpointError
    from ..config import ConfigError
    from ..interop import InteropError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: list[str] = []
    if argv and argv[0] in ("pretrain", "finetune"):  # section.key=value (or --section.key=value) anywhere
        overrides = [a.lstrip("-") for a in argv[1:] if OVERRIDE.match(a)]
        argv = [argv[0]] + [a for a in argv[1:] if not OVERRIDE.match(a)]
    args = parser.parse_args(argv)
    if args.command in ("pretrain", "finetune"):
        args.overrides = overrides
    from ..data.readers import DataError
    from ..data.store import StoreError
    from ..tokenization import TokenizerError
    from ..train.loop import TrainingDiverged

    try:
        return args.func(args) or 0
    except TrainingDiverged as e:
        print(f"pretune {args.command}: {e}", file=sys.stderr)
        return 3
    except (ConfigError, CheckpointError, InteropError, FileNotFoundError, DataError, StoreError,
            TokenizerError) as e:
        print(f"pretune {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
