"""``pretune show``, ``presets``, ``convert`` and ``consolidate``: a model's architecture and size, the presets,
Hugging Face folders both ways, a plain model folder from a training checkpoint."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .. import catalog


def add_model_parsers(sub) -> None:
    s = sub.add_parser("show", help="print a model's architecture and parameter counts",
                       description="Print the architecture and parameter counts (total and per part) of a "
                       "preset, a pretune checkpoint folder or a Hugging Face folder.")
    s.add_argument("target", metavar="PRESET_OR_DIR", help="preset name (see --list) or folder")
    s.add_argument("--json", action="store_true", help="also print the resolved config and counts as JSON")
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("presets", help="list the named model presets")
    s.set_defaults(func=lambda a: print("\n".join(__import__("pretune").preset_names())) or 0)

    s = sub.add_parser("convert", help="import from / export to Hugging Face transformers folders and GGUF files",
                       description="Convert between pretune checkpoints and Hugging Face transformers folders of "
                       "the families below, or write / read GGUF files (llama.cpp, Ollama) of the decoder families "
                       "llama.cpp runs (llama, mistral, qwen2, qwen3, gemma, gemma2, gpt2). Outputs are written "
                       "atomically.",
                       epilog=f"families (the model_type of config.json):\n{catalog.listing(catalog.FAMILIES)}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--from-hf", metavar="DIR", help="Hugging Face folder to import")
    s.add_argument("--to-hf", metavar="DIR", help="pretune checkpoint folder to export")
    s.add_argument("--from-gguf", metavar="FILE", help="GGUF file to import (quantised tensors are de-quantised)")
    s.add_argument("--to-gguf", metavar="MODEL", help="any model folder (pretune, Hugging Face, adapter) or GGUF file "
                   "to write as one GGUF file with its tokenizer and chat template; an adapter folder writes a GGUF "
                   "LoRA (llama.cpp --lora) unless --merged")
    s.add_argument("--out", metavar="DIR", required=True, help="destination folder (new or empty); with --to-gguf "
                   "the .gguf file (an existing one is replaced only with --overwrite)")
    s.add_argument("--type", choices=["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"], default="f32",
                   help="--to-gguf: the tensors' type, llama.cpp's names (norms stay f32; default f32)")
    s.add_argument("--base", metavar="DIR", help="--to-gguf of an adapter folder: its base model (default: the one "
                   "it recorded)")
    s.add_argument("--tokenizer", metavar="PATH", help="--to-gguf: the tokenizer to write into the file (a "
                   "tokenizer.json or a folder holding one; default: the model's own)")
    s.add_argument("--merged", action="store_true", help="--to-gguf of an adapter folder: write its base with the "
                   "adapter folded in, as one model, instead of a GGUF LoRA")
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


def _load_any(spec: str):
    """A preset name, or any model folder (pretune, Hugging Face, adapter) -> (config, model or None)."""
    from ..loading import load
    from ..presets import PRESETS, get_preset

    if spec in PRESETS:
        return get_preset(spec), None
    if Path(spec).is_dir() or Path(spec).is_file():  # a folder, or a GGUF file
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
    ffn = f"{cfg.ffn}, inner {cfg.ffn_dim}"
    dec = cfg.decoder_config
    if dec is not cfg:  # an encoder-decoder whose decoder is sized apart (BART may be)
        attn += f"; decoder {dec.n_heads} heads x {dec.dh}"
        ffn += f"; decoder inner {dec.ffn_dim}"
    rope = f" (base {cfg.rope_base:g}" + (f", sliding-window layers {cfg.rope_local_base:g}"
                                           if cfg.rope_local_base is not None else "") + (
        f", {cfg.rope_scaling} scaling x{cfg.rope_factor:g}" if cfg.rope_scaling != "none" else "") + ")"
    rows = [
        ("layers", layers), ("dim", cfg.dim), ("attention", attn), ("ffn", ffn),
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
    from ..io.outputs import check_folder
    from ..jobs.consolidate import consolidate

    check_folder(args.out, overwrite=args.overwrite)
    out = consolidate(args.checkpoint, args.out, dtype=args.dtype)
    print(f"consolidated {args.checkpoint} -> {out}")
    return 0


def cmd_convert(args) -> int:
    from ..interop import TOKENIZER_FILES, to_hf
    from ..io.checkpoint import save
    from ..io.outputs import check_folder
    from ..loading import folder_kind, load

    given = [flag for flag in ("from_hf", "to_hf", "from_gguf", "to_gguf") if getattr(args, flag)]
    if len(given) != 1:
        from ..config import ConfigError

        raise ConfigError("give exactly one of --from-hf DIR, --to-hf DIR, --from-gguf FILE or --to-gguf MODEL (got "
                          f"{', '.join('--' + g.replace('_', '-') for g in given) or 'none'})")
    if args.to_gguf:
        from ..jobs.gguf import export_gguf

        out, what = export_gguf(args.to_gguf, args.out, type=args.type, base=args.base, tokenizer=args.tokenizer,
                                merged=args.merged, overwrite=args.overwrite)
        print(f"exported {args.to_gguf} -> {out}: {what}")
        return 0
    check_folder(args.out, overwrite=args.overwrite)
    if args.from_gguf:
        from ..jobs.gguf import import_gguf

        out = import_gguf(args.from_gguf, args.out)
        print(f"imported {args.from_gguf} -> {out}")
        return 0
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
            from ..io.spm import find_model
            from ..io.tokenization import Tokenizer

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
