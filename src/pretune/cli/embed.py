"""``pretune embed``: embed the texts of a file (.npy / .jsonl), or rank pairs of them by cosine (--similarity).
The embedding itself is :mod:`pretune.jobs.embed`."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

from ..config import ConfigError
from ..data.readers import DataError
from ..io.outputs import write_atomic


def _write_jsonl(path: Path, rows) -> None:
    def write(fh):
        for row in rows:
            fh.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))

    write_atomic(path, write)


def _out_kind(out: str | None, similarity: bool) -> str | None:
    if out is None:
        if not similarity:
            raise ConfigError("--out FILE is required (.npy for a matrix, .jsonl for text + embedding lines)")
        return None
    name = out.lower()
    if similarity:
        if not name.endswith(".jsonl"):
            raise ConfigError(f"--out {out}: with --similarity the ranked pairs are written as JSONL; "
                              f"expected a .jsonl file")
        return "jsonl"
    if name.endswith(".npy"):
        return "npy"
    if name.endswith(".jsonl"):
        return "jsonl"
    raise ConfigError(f"--out {out}: unknown output type; expected .npy (matrix) or .jsonl (text + embedding)")


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def cmd_embed(args) -> int:
    """``pretune embed``: embed the texts of a file, or rank pairs of them by cosine (``--similarity``)."""
    import numpy as np

    from ..interop.st_folder import read_st_modules
    from ..io.outputs import check_file
    from ..jobs.embed import (
        _MAX_ALL_PAIRS,
        _PROGRESS_MIN,
        _check_pooling,
        embed_texts,
        load_encoder,
        rank_all_pairs,
        rank_pairs,
        read_pairs,
        read_texts,
    )

    kind = _out_kind(args.out, args.similarity)
    if args.out:
        check_file(args.out, overwrite=args.overwrite, what="output file")
    if args.top is not None and args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    if args.similarity:
        texts, pairs = read_pairs(args.input, field=args.field, field_a=args.field_a, field_b=args.field_b)
        if pairs is None and len(texts) < 2:
            raise DataError(f"{args.input}: --similarity needs at least two texts (or pairs), got {len(texts)}")
        if pairs is None and args.top is None and len(texts) * (len(texts) - 1) // 2 > _MAX_ALL_PAIRS:
            raise ConfigError(f"{args.input}: {len(texts):,} texts make {len(texts) * (len(texts) - 1) // 2:,} "
                              f"pairs; keep the most similar with --top N")
    else:
        texts, pairs = read_texts(args.input, field=args.field), None
    # a sentence-transformers folder's modules: its pooling, Normalize and max length, unless a flag says otherwise
    st = read_st_modules(args.model) if Path(args.model).is_dir() else None
    model, tok = load_encoder(args.model, tokenizer=args.tokenizer)
    pooling = args.pooling or (st.pooling if st else "mean")
    _check_pooling(pooling, model)  # before any work
    normalize = args.normalize or (st is not None and st.normalize)
    max_len = args.max_len or (st.max_seq_length if st else None)
    unique = list(dict.fromkeys(texts if pairs is None else [t for p in pairs for t in p]))
    show = not args.quiet and len(unique) >= _PROGRESS_MIN
    if args.streams < 0:
        raise ConfigError(f"--streams must be >= 0 (0: one per torch thread), got {args.streams}")
    import torch

    emb = embed_texts(model, tok, unique, pooling=pooling, normalize=normalize, batch_size=args.batch_size,
                      max_len=max_len, show_progress=show, streams=args.streams or torch.get_num_threads())
    how = f"{pooling} pooling" + (", normalized" if normalize else "")

    if not args.similarity:
        out = Path(args.out)
        if len(unique) != len(texts):  # repeated texts were embedded once
            row = {t: k for k, t in enumerate(unique)}
            emb = emb[[row[t] for t in texts]]
        if kind == "npy":
            write_atomic(out, lambda fh: np.save(fh, emb))
        else:
            _write_jsonl(out, ({"text": t, "embedding": e.tolist()} for t, e in zip(texts, emb)))
        print(f"embedded {len(texts):,} texts -> {out} ({emb.shape[0]} x {emb.shape[1]} float32, {how})")
        return 0

    row = {t: k for k, t in enumerate(unique)}
    if pairs is not None:
        ea = emb[[row[a] for a, _ in pairs]]
        eb = emb[[row[b] for _, b in pairs]]
        ranked = rank_pairs(ea, eb)
        if args.top is not None:
            ranked = ranked[:args.top]
        results = [{"rank": r, "cosine": round(s, 6), "pair": k, "text_a": pairs[k][0], "text_b": pairs[k][1]}
                   for r, (k, s) in enumerate(ranked, start=1)]
        total = len(pairs)
        what = f"{total:,} pairs"
    else:
        ranked = rank_all_pairs(emb[[row[t] for t in texts]], top=args.top)
        results = [{"rank": r, "cosine": round(s, 6), "i": i, "j": j, "text_a": texts[i], "text_b": texts[j]}
                   for r, (i, j, s) in enumerate(ranked, start=1)]
        total = len(texts) * (len(texts) - 1) // 2
        what = f"all {total:,} pairs of {len(texts):,} texts"
    shown = f"top {len(results):,} of " if len(results) < total else ""
    print(f"cosine similarity ({how}), {shown}{what}, highest first:")
    for res in results:
        print(f"  {res['rank']:>4}  {res['cosine']:+.4f}  {_short(res['text_a'], 48):<48} | "
              f"{_short(res['text_b'], 48)}")
    if kind == "jsonl":
        _write_jsonl(Path(args.out), results)
        print(f"ranked pairs -> {args.out}")
    return 0


EMBED_DESCRIPTION = (
    "Embed texts with a pretrained model (a pretune checkpoint folder or a Hugging Face folder): the last hidden "
    "states of each text, pooled into one vector (mean over real tokens, the [CLS] token, or a decoder's last "
    "token). INPUT is a .txt file (one text per line, blank lines skipped) or a .jsonl/.csv/.tsv/.parquet file "
    "(text in --field). --out .npy writes the (N, dim) float32 matrix, .jsonl one {\"text\", \"embedding\"} "
    "object per line. With --similarity, pairs are ranked by cosine instead: explicit pairs (.txt lines "
    "'a<TAB>b', or records with --field-a/--field-b) or all pairs of a list of texts.")
EMBED_EPILOG = """examples:
  pretune embed MODEL_DIR sentences.txt --out emb.npy             one text per line -> (N, dim) matrix
  pretune embed MODEL_DIR docs.jsonl --field body --out emb.jsonl  {"text": ..., "embedding": [...]} lines
  pretune embed MODEL_DIR pairs.txt --similarity                   "a<TAB>b" lines, ranked by cosine
  pretune embed MODEL_DIR sentences.txt --similarity --top 10      the 10 most similar of all pairs
"""


def add_embed_parser(sub) -> argparse.ArgumentParser:
    """Register ``embed`` on an argparse subparsers object (``func=cmd_embed``); returns its parser."""
    s = sub.add_parser("embed", help="contextual sentence embeddings and cosine similarity of texts",
                       description=textwrap.fill(EMBED_DESCRIPTION, 100), epilog=EMBED_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", metavar="MODEL", help="pretune checkpoint folder or Hugging Face model folder")
    s.add_argument("input", metavar="INPUT", help=".txt, .jsonl, .csv, .tsv or .parquet file")
    s.add_argument("--out", metavar="FILE", help=".npy or .jsonl (required unless --similarity; a new file, written "
                   "atomically)")
    s.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    s.add_argument("--pooling", choices=["mean", "cls", "last"],
                   help="mean (default; over real tokens), cls (first token; encoders), last (last token; decoders); "
                   "default for a sentence-transformers folder: its Pooling module's")
    s.add_argument("--normalize", action="store_true", help="scale every embedding to unit length (a "
                   "sentence-transformers folder with a Normalize module: always)")
    s.add_argument("--batch-size", type=int, default=32, metavar="N", help="texts per forward pass (default 32)")
    s.add_argument("--streams", type=int, default=0, metavar="N",
                   help="CPU: batches embedded at once, one thread each (default 0: one per torch thread; 1: one "
                        "batch at a time on every thread)")
    s.add_argument("--max-len", type=int, metavar="N",
                   help="most tokens per text, special tokens included (default: the model's maximum)")
    s.add_argument("--field", default="text", metavar="NAME",
                   help="JSONL/CSV/Parquet column with the text (default text)")
    s.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json or folder, if MODEL holds none")
    s.add_argument("--similarity", action="store_true",
                   help="rank pairs by cosine (highest first) instead of writing embeddings; --out gets JSONL")
    s.add_argument("--field-a", default="text_a", metavar="NAME",
                   help="with --similarity: first text of a pair (default text_a)")
    s.add_argument("--field-b", default="text_b", metavar="NAME",
                   help="with --similarity: second text of a pair (default text_b)")
    s.add_argument("--top", type=int, metavar="N", help="with --similarity: keep only the N most similar pairs")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_embed)
    return s
