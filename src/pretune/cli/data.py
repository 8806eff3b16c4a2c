"""``pretune tokenizer ...`` and ``pretune data ...``: train and inspect tokenizers; clean text, tokenize it into a
token store, list or copy the bundled real data."""

from __future__ import annotations

import json
from pathlib import Path


def cmd_tokenizer_train(args) -> int:
    from ..io.outputs import check_file
    from ..io.tokenization import train_tokenizer

    out = Path(args.out)
    check_file(out if out.suffix == ".json" and not out.is_dir() else out / "tokenizer.json",
               overwrite=args.overwrite, what="tokenizer file")
    lower = None if args.lowercase is None else args.lowercase == "yes"
    tok = train_tokenizer(args.files, kind=args.kind, vocab_size=args.vocab_size, specials=args.specials,
                          sentinels=args.sentinels, extra_specials=args.extra_specials, lowercase=lower,
                          min_frequency=args.min_frequency, show_progress=not args.quiet, errors=args.errors)
    path = tok.save(args.out)
    roles = {r: getattr(tok, f"{r}_id") for r in ("pad", "unk", "cls", "sep", "mask", "bos", "eos")}
    roles = ", ".join(f"{r}={tok.id_to_token(i)}({i})" for r, i in roles.items() if i is not None)
    print(f"{args.kind} tokenizer, {tok.vocab_size} tokens -> {path}")
    print(f"  special tokens: {roles}" + (f", {len(tok.sentinel_ids)} sentinels" if tok.sentinel_ids else ""))
    return 0


def cmd_tokenizer_encode(args) -> int:
    from ..io.tokenization import Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    for text in args.texts:
        ids = tok.encode(text)
        print(" ".join(tok.id_to_token(i) for i in ids))
        print(" ".join(str(i) for i in ids))
    return 0


def cmd_data_clean(args) -> int:
    from ..data.clean import RULES, CleanConfig, clean_files
    from ..io.outputs import check_file

    check_file(args.out, overwrite=args.overwrite, what="cleaned text file")
    if args.report:
        check_file(args.report, overwrite=args.overwrite, what="report file")
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
    from ..io.tokenization import Tokenizer, tokenizer_sha

    out = Path(args.out)
    is_store = (out / "progress.json").is_file() or (out / "meta.json").is_file()  # a store's own build resumes
    if not is_store:
        from ..io.outputs import check_folder

        check_folder(out, overwrite=args.overwrite, what="token store")
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


def add_data_parsers(sub) -> None:
    """Register ``tokenizer`` and ``data`` on the ``pretune`` subparsers."""
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
    t.add_argument("--out", required=True, help="tokenizer.json path or folder (a new file)")
    t.add_argument("--overwrite", action="store_true", help="replace the tokenizer file if it exists")
    t.add_argument("--specials", choices=["bert", "roberta", "t5"],
                   help="special-token set (default: bert for wordpiece, roberta for bpe, t5 for unigram)")
    t.add_argument("--sentinels", type=int, help="number of <extra_id_N> sentinels (default: 100 for t5, else 0)")
    t.add_argument("--extra-specials", nargs="*", default=[], metavar="TOKEN", help="more special tokens")
    t.add_argument("--lowercase", choices=["yes", "no"],
                   help="lowercase text (default: yes for wordpiece, no otherwise)")
    t.add_argument("--min-frequency", type=int, default=2, help="minimum pair frequency for a merge (default 2)")
    t.add_argument("--errors", default="strict", choices=["strict", "replace"],
                   help="non-UTF-8 bytes: stop with file and byte offset (strict) or replace with U+FFFD")
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
    d.add_argument("--out", required=True, help="output .jsonl/.jsonl.gz/.txt/.txt.gz (a new file, written atomically)")
    d.add_argument("--overwrite", action="store_true", help="replace --out (and --report) if they exist")
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
    d.add_argument("--out", required=True, help="store folder: new or empty, or a store (an interrupted build resumes, "
                   "a complete one is reused)")
    d.add_argument("--overwrite", action="store_true", help="write the store into a folder that holds other files "
                   "(they stay)")
    _reading(d)
    d.set_defaults(func=cmd_data_tokenize)
    d = dsub.add_parser("bundled", help="list the real corpus and task files that ship with pretune, or copy them",
                        description="The bundled real data (corpus/*.txt.gz for pretraining, tasks/<name>/"
                        "{train,dev,test}.jsonl for finetuning) with one line each; --copy DIR copies it, with the "
                        "README that states each file's provenance and licence.")
    d.add_argument("--copy", metavar="DIR", help="copy the files to DIR (DIR/corpus, DIR/tasks, DIR/README.md)")
    d.set_defaults(func=cmd_data_bundled)
