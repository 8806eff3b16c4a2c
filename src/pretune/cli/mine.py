"""``pretune mine``: hard negatives for (anchor, positive) pairs, mined with a model into a triplet file that
``pretune finetune --task embedding`` trains on. The mining itself is :mod:`pretune.jobs.mine`."""

from __future__ import annotations

import argparse
import textwrap

MINE_DESCRIPTION = (
    "Mine hard negatives for contrastive embedding training. MODEL (a pretune checkpoint, Hugging Face or "
    "sentence-transformers folder; a --task embedding run's model/) embeds every anchor and the corpus: every "
    "distinct positive of --data, plus the texts of --corpus files. For each anchor the corpus is ranked by cosine "
    "without the anchor's own positives (all of them, when the anchor occurs in several records) and without the "
    "anchor's own text; rank 1 is the closest. Ranks up to --range-min are skipped (the very top is often an "
    "unlabelled positive), ranks past --range-max are not looked at, and a candidate n of a record whose positive "
    "p scored s(a,p) is kept only if s(a,n) <= s(a,p) - MARGIN (--margin), s(a,n) <= s(a,p) - |s(a,p)| * R "
    "(--relative-margin), s(a,n) <= --max-score and s(a,n) >= --min-score (each when given). The first "
    "--num-negatives kept candidates by rank (or a random draw of them, --sampling random) become the record's "
    "\"negative\" list. Every record is written with all its fields (negatives it already had stay, the mined ones "
    "after them); a record left with no negative is dropped unless --keep-unmined. The output is JSONL, written to "
    "a temporary file renamed into place.")
MINE_EPILOG = """examples:
  pretune mine MODEL_DIR --data pairs.jsonl --out triplets.jsonl                 3 negatives per pair, the top ranks
  pretune mine runs/embed/model --data train.jsonl --out hard.jsonl --corpus docs.txt \\
      --range-min 10 --range-max 50 --relative-margin 0.05 --num-negatives 5 --sampling random
  pretune mine MODEL_DIR --data qa.csv --anchor-field question --positive-field answer --out qa_hard.jsonl
  pretune finetune --model MODEL_DIR --task embedding --train triplets.jsonl ...   train on the result
"""


def cmd_mine(args) -> int:
    """``pretune mine``: mine hard negatives into a triplet file (:func:`pretune.jobs.mine.mine_file`)."""
    from ..jobs.mine import MineSettings, mine_file

    given = {} if args.num_negatives is None else {"num_negatives": args.num_negatives}
    settings = MineSettings(**given, range_min=args.range_min, range_max=args.range_max, margin=args.margin,
                            relative_margin=args.relative_margin, max_score=args.max_score,
                            min_score=args.min_score, sampling=args.sampling, seed=args.seed)
    report = mine_file(args.model, args.data, args.out, corpus=args.corpus or (), corpus_field=args.corpus_field,
                       anchor_field=args.anchor_field, positive_field=args.positive_field,
                       negative_field=args.negative_field, settings=settings, pooling=args.pooling,
                       batch_size=args.batch_size, max_len=args.max_len, tokenizer=args.tokenizer, device=args.device,
                       keep_unmined=args.keep_unmined, overwrite=args.overwrite, show_progress=not args.quiet)
    print(report.summary())
    return 0


def add_mine_parser(sub) -> argparse.ArgumentParser:
    """Register ``mine`` on an argparse subparsers object (``func=cmd_mine``); returns its parser."""
    s = sub.add_parser("mine", help="hard negatives for (anchor, positive) pairs, mined with a model into triplets "
                       "for --task embedding", description=textwrap.fill(MINE_DESCRIPTION, 100),
                       epilog=MINE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", metavar="MODEL", help="pretune checkpoint, Hugging Face or sentence-transformers folder")
    s.add_argument("--data", required=True, metavar="FILE",
                   help="pairs: .jsonl, .csv, .tsv or .parquet records with an anchor and a positive text")
    s.add_argument("--out", required=True, metavar="FILE", help="the triplets, .jsonl or .jsonl.gz (a new file)")
    s.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    s.add_argument("--corpus", action="append", metavar="FILE",
                   help="more candidate texts besides the positives: .txt (one per line) or records (--corpus-field); "
                   "repeat for several files")
    s.add_argument("--corpus-field", default="text", metavar="NAME",
                   help="the text column of --corpus record files (default text)")
    g = s.add_argument_group("what becomes a negative")
    g.add_argument("--num-negatives", type=int, metavar="N",  # default: jobs.mine.DEFAULT_NUM_NEGATIVES (--help
                   # imports no numpy)
                   help="negatives mined per record (default 3, as sentence-transformers' "
                   "mine_hard_negatives; MNRL puts every anchor's negatives in the batch, so B pairs cost 5B rows a "
                   "step; 1: 3B)")
    g.add_argument("--range-min", type=int, default=0, metavar="K",
                   help="skip the K top-ranked candidates, often unlabelled positives (default 0)")
    g.add_argument("--range-max", type=int, metavar="M", help="look no further than rank M (default: all)")
    g.add_argument("--margin", type=float, metavar="M",
                   help="keep a candidate only if its cosine is at least M below the positive's (0: never closer than "
                   "the positive)")
    g.add_argument("--relative-margin", type=float, metavar="R",
                   help="keep a candidate only if its cosine <= the positive's - |positive's| x R (0.05: below 95%% "
                   "of it, NV-Retriever's best)")
    g.add_argument("--max-score", type=float, metavar="S", help="keep candidates with cosine <= S")
    g.add_argument("--min-score", type=float, metavar="S", help="keep candidates with cosine >= S")
    g.add_argument("--sampling", choices=["top", "random"], default="top",
                   help="top (default): the best-ranked kept candidates; random: drawn among all kept ones")
    g.add_argument("--seed", type=int, default=0, help="the draw of --sampling random (default 0)")
    g.add_argument("--keep-unmined", action="store_true",
                   help="write records left with no negative as they are (default: drop them)")
    f = s.add_argument_group("record fields (as --task embedding's task.anchor_field / positive_field / "
                             "negative_field)")
    f.add_argument("--anchor-field", default="anchor", metavar="NAME", help="the query text (default anchor)")
    f.add_argument("--positive-field", default="positive", metavar="NAME",
                   help="the text that answers it (default positive)")
    f.add_argument("--negative-field", default="negative", metavar="NAME",
                   help="where the negatives go, a list (default negative)")
    e = s.add_argument_group("embedding (scores are cosines, so unit-length vectors change nothing)")
    e.add_argument("--pooling", choices=["mean", "cls", "last"],
                   help="default: a sentence-transformers folder's Pooling, else the model's own, else its family's "
                   "first (what --task embedding trains with)")
    e.add_argument("--batch-size", type=int, default=32, metavar="N", help="texts per forward pass (default 32)")
    e.add_argument("--max-len", type=int, metavar="N", help="most tokens per text, special tokens included "
                   "(default: a sentence-transformers folder's max_seq_length, else the model's maximum)")
    e.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json or folder, if MODEL holds none")
    e.add_argument("--device", default="auto", help="where the model embeds: auto (cuda when available), cpu, cuda, "
                   "cuda:1, ...; the ranking runs on the CPU")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_mine)
    return s
