"""``pretune bench pretrain``: MLM pretraining throughput of pretune vs transformers on the same data.

The parent tokenizes the corpus once into a token store (timed: the tokenize-to-store MB/s), packs it
into ``[CLS] block [SEP]`` examples of ``seq`` tokens and starts one Python process per measurement,
alternating the implementations for several rounds (the pattern of :mod:`pretune.bench.model`):

* pretune: the real pretraining loop, ``Trainer.train_step()`` (batch plan, dynamic MLM masking and
  collation, forward, loss on the masked positions, backward, clipping, AdamW, schedule) of
  ``build_model("bert-base", 6 layers, dim 512, ...)`` with the ``mlm`` objective.
* transformers: ``BertForMaskedLM`` of the same shape, ``DataCollatorForLanguageModeling`` (15%,
  80/10/10) on the same blocks in the same batch order, ``torch.optim.AdamW``, ``clip_grad_norm_``.

Both sides: the MiniLM BERT tokenizer (vocab 30522), dropout 0.1, lr 1e-4, clip 1.0, bf16 = fp32
weights under ``torch.autocast("cpu", bfloat16)`` around the forward pass, ``torch.set_flush_denormal``
on (``pretune pretrain`` sets it; it is set for transformers too, which can only help that side).

tokens/s = real (non-pad) input tokens of the timed steps / their summed wall time (blocks vary in
length, so a total is fairer than a median step); each configuration reports the median over rounds.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .common import add_run_arguments, spawn_worker

if TYPE_CHECKING:
    import torch

IMPLS = ("pretune", "transformers")
# the model of the issue: BERT-style, 6 layers, dim 512, 8 heads, FFN 2048, BERT's WordPiece vocabulary
SHAPE = dict(n_layers=6, dim=512, n_heads=8, ffn_dim=2048, vocab_size=30522)
# the corpus the figures in BENCHMARKS.md were measured on (../shared/data/corpus beside a checkout, 13.2 MB); in an
# installed package without it, the (smaller) corpus shipped with pretune
_SHARED_CORPUS = Path(__file__).resolve().parents[4] / "shared" / "data" / "corpus"
_BUNDLED_CORPUS = Path(__file__).resolve().parents[1] / "bundled" / "corpus"
DEFAULT_CORPUS = _SHARED_CORPUS if _SHARED_CORPUS.is_dir() else _BUNDLED_CORPUS
DEFAULT_CACHE = Path("~/.cache/pretune/bench")


@dataclass
class Job:
    impl: str  # pretune | transformers
    dtype: str  # fp32 | bf16 (autocast)
    store: str  # token store folder built by the parent
    tokenizer: str  # Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json)
    seq: int = 128  # tokens per example, [CLS] and [SEP] included
    batch: int = 32  # examples per optimizer step
    steps: int = 8  # timed steps
    warmup: int = 2  # untimed steps first
    threads: int = 0  # torch threads; 0: torch's default
    dropout: float = 0.1  # hidden and attention dropout, both models
    lr: float = 1e-4  # AdamW learning rate (constant)
    seed: int = 0  # model init, batch plan, masking
    shape: dict = field(default_factory=lambda: dict(SHAPE))  # n_layers, dim, n_heads, ffn_dim, vocab_size

    @property
    def max_seq_len(self) -> int:
        return max(512, self.seq)


# ---------------------------------------------------------------------------------------------
# data: the same blocks, in the same batch order, for both sides
# ---------------------------------------------------------------------------------------------
def open_blocks(store: str | os.PathLike, *, seq: int, sep_id: int):
    """The store's FULL-SENTENCES blocks of ``seq - 2`` tokens (room for [CLS] and [SEP])."""
    from ..data.packing import pack_blocks
    from ..data.store import TokenStore

    return pack_blocks(TokenStore.open(store), block_size=seq - 2, mode="full", doc_sep_id=sep_id)


def _n_examples(job: Job, n_blocks: int) -> int:
    """Example ids 0..n-1: the first blocks of the store, enough for one epoch of the run."""
    need = job.batch * (job.warmup + job.steps)
    if n_blocks < job.batch:
        raise ValueError(f"the token store packs into {n_blocks} blocks of {job.seq - 2} tokens, fewer than one "
                         f"batch ({job.batch}): use more text, a smaller --batch or a smaller --seq")
    return min(need, n_blocks)


def _batch_ids(n: int, *, batch: int, seed: int):
    """The example ids of each step, epoch after epoch: the plan ``Trainer`` follows (no bucketing)."""
    import numpy as np

    from ..data.packing import batch_plan

    ids = np.arange(n, dtype=np.int64)
    epoch = 0
    while True:
        yield from batch_plan(ids, batch_size=batch, epoch=epoch, seed=seed)
        epoch += 1


def unmasked_ids(batch: dict) -> torch.Tensor:
    """(B, T) input ids before masking, pads included: the labels where a target is set, else the inputs.

    Works for both sides' batches (``input_ids`` and ``labels`` with -100 at non-targets)."""
    import torch

    return torch.where(batch["labels"] != -100, batch["labels"], batch["input_ids"])


# ---------------------------------------------------------------------------------------------
# worker side (runs in a child process)
# ---------------------------------------------------------------------------------------------
class _PretuneRun:
    """Our pretraining loop: a Trainer over the first blocks of the store; one call = train_step()."""

    def __init__(self, job: Job, run_dir: str, record: list | None):
        import numpy as np

        from ..io.tokenization import Tokenizer
        from ..model import build_model
        from ..objectives import build_objective, objective_settings
        from ..runconfig import TrainConfig
        from ..train.loop import ExampleSet, Trainer

        tok = Tokenizer.load(job.tokenizer)
        blocks = open_blocks(job.store, seq=job.seq, sep_id=tok.sep_id)
        n = _n_examples(job, len(blocks))
        model = build_model("bert-base", **job.shape, max_seq_len=job.max_seq_len, dropout=job.dropout,
                            attn_dropout=job.dropout, pad_token_id=tok.pad_id)
        objective = build_objective(objective_settings(name="mlm"), model, tok)
        data = ExampleSet(get=blocks.__getitem__, train_ids=np.arange(n, dtype=np.int64),
                          eval_ids=np.zeros(0, dtype=np.int64), lengths=blocks.lengths)
        cfg = TrainConfig(out=run_dir, steps=job.warmup + job.steps, batch_size=job.batch, grad_accum=1, lr=job.lr,
                          schedule="constant", clip=1.0, precision=job.dtype, eval_every=0, save_every=0,
                          seed=job.seed, threads=job.threads, tensorboard=False, plot=False)
        self.trainer = Trainer(model=model, objective=objective, data=data, cfg=cfg, run_dir=run_dir, tokenizer=tok,
                               bucket=False, show_progress=False)
        if record is not None:  # keep every collated batch (tests): wraps the method train_step calls
            make_batch = self.trainer.make_batch

            def recording(ids, epoch):
                batch = make_batch(ids, epoch)
                record.append(batch)
                return batch

            self.trainer.make_batch = recording

    def __call__(self) -> tuple[int, float]:
        out = self.trainer.train_step()
        return out["tokens"], out["loss"]


class _TransformersRun:
    """BertForMaskedLM + DataCollatorForLanguageModeling + AdamW on the same blocks in the same order."""

    def __init__(self, job: Job, record: list | None):
        import torch
        import transformers as T

        from ..io.tokenization import Tokenizer

        tok = Tokenizer.load(job.tokenizer)  # the store's ids; only [CLS]/[SEP] are needed here
        hf_tok = T.AutoTokenizer.from_pretrained(job.tokenizer)
        self.blocks = open_blocks(job.store, seq=job.seq, sep_id=tok.sep_id)
        self.cls, self.sep = tok.cls_id, tok.sep_id
        self.plan = _batch_ids(_n_examples(job, len(self.blocks)), batch=job.batch, seed=job.seed)
        s = job.shape
        cfg = T.BertConfig(vocab_size=s["vocab_size"], hidden_size=s["dim"], num_hidden_layers=s["n_layers"],
                           num_attention_heads=s["n_heads"], intermediate_size=s["ffn_dim"],
                           max_position_embeddings=job.max_seq_len, hidden_dropout_prob=job.dropout,
                           attention_probs_dropout_prob=job.dropout, pad_token_id=hf_tok.pad_token_id)
        self.model = T.BertForMaskedLM(cfg)
        self.model.config._attn_implementation = "sdpa"
        self.model.train()
        self.collator = T.DataCollatorForLanguageModeling(tokenizer=hf_tok, mlm_probability=0.15, seed=job.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=job.lr)
        self.bf16 = job.dtype == "bf16"
        self.record = record

    def __call__(self) -> tuple[int, float]:
        import contextlib

        import torch

        ids = next(self.plan)
        features = [{"input_ids": [self.cls, *self.blocks[int(i)].tokens.tolist(), self.sep]} for i in ids]
        batch = self.collator(features)  # pads, masks 15% (80/10/10), labels -100 elsewhere
        if self.record is not None:
            self.record.append(batch)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with ctx:
            loss = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return int(batch["attention_mask"].sum()), float(loss.detach())


def _peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def run_worker(job: Job, *, record: list | None = None) -> dict:
    """Build one side, run ``warmup + steps`` optimizer steps, time the last ``steps``.

    Args:
        job: what to run (see :class:`Job`).
        record: if a list, every step's collated batch (dict of (B, T) tensors) is appended to it.

    Returns:
        tokens_per_s (non-pad input tokens / seconds over the timed steps), step_s (median), tokens
        (timed), seconds (timed), loss (last step), peak_rss_mb, threads.
    """
    import torch

    if job.impl not in IMPLS:
        raise ValueError(f"impl ({job.impl!r}) must be one of {IMPLS}")
    if job.dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype ({job.dtype!r}) must be fp32 or bf16")
    if job.threads:
        torch.set_num_threads(job.threads)
    torch.set_flush_denormal(True)  # as `pretune pretrain` does; denormal softmax grads slow CPU matmuls
    torch.manual_seed(job.seed)
    with tempfile.TemporaryDirectory(prefix="pretune-bench-") as run_dir:
        step = _PretuneRun(job, run_dir, record) if job.impl == "pretune" else _TransformersRun(job, record)
        times, tokens, loss = [], 0, float("nan")
        for i in range(job.warmup + job.steps):
            t0 = time.perf_counter()
            n, loss = step()
            if i >= job.warmup:
                times.append(time.perf_counter() - t0)
                tokens += n
    seconds = sum(times)
    return {"tokens_per_s": tokens / seconds, "step_s": statistics.median(times), "tokens": tokens,
            "seconds": seconds, "loss": loss, "peak_rss_mb": _peak_rss_mb(), "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def build_bench_store(sources, tokenizer_dir, cache_dir, *, fresh: bool = True, show_progress: bool = True) -> dict:
    """Tokenize ``sources`` with the tokenizer in ``tokenizer_dir`` into a token store under ``cache_dir``.

    Args:
        sources: files, folders or globs (see ``pretune.data.readers.expand_sources``).
        tokenizer_dir: a tokenizer folder or tokenizer.json.
        cache_dir: the store goes to ``cache_dir/store-<hash of tokenizer and files>``.
        fresh: rebuild from scratch (``resume=False``) and time it; False: reuse a complete store and
            report the build time recorded when it was made.

    Returns:
        path, text_bytes (UTF-8 bytes handed to the tokenizer), file_bytes (on disk, compressed for .gz),
        seconds, mb_per_s (text MB / s), tokens, tokens_per_s, docs, files, cached.
    """
    from ..data.readers import count_bytes, expand_sources, iter_documents
    from ..data.store import build_store
    from ..io.tokenization import Tokenizer, tokenizer_sha

    tok = Tokenizer.load(tokenizer_dir)
    paths = expand_sources(sources)
    sha = tokenizer_sha(tok)
    desc = json.dumps({"tok": sha, "files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns]
                                             for p in paths]}, sort_keys=True)
    key = hashlib.sha256(desc.encode()).hexdigest()[:16]
    out = Path(cache_dir).expanduser() / f"store-{key}"
    file_bytes = count_bytes(paths)
    t0 = time.perf_counter()
    store = build_store(iter_documents(paths), tok.tk, out, tokenizer_sha=sha, source_desc=key,
                        total_bytes=count_bytes(paths, uncompressed=True), show_progress=show_progress,
                        resume=not fresh)
    seconds = time.perf_counter() - t0
    cached = not fresh
    if cached:  # opened an earlier build (or finished one): its own clock
        seconds = float(store.meta.get("build_seconds", seconds))
    text_bytes = int(store.meta["n_bytes_text"])
    return {"bench": "tokenize", "path": str(out), "text_bytes": text_bytes, "file_bytes": file_bytes,
            "seconds": seconds, "mb_per_s": text_bytes / 1e6 / seconds, "tokens": store.n_tokens,
            "tokens_per_s": store.n_tokens / seconds, "docs": store.n_docs, "files": len(paths), "cached": cached}


def bench_pretrain(*, corpus=None, tokenizer=None, cache_dir=DEFAULT_CACHE, dtypes=("bf16", "fp32"),
                   rounds: int = 3, steps: int = 8, warmup: int = 2, batch: int = 32, seq: int = 128,
                   threads: int = 0, dropout: float = 0.1, shape: dict | None = None, impls=IMPLS,
                   fresh_store: bool = True, show_progress: bool = True, echo=print) -> list[dict]:
    """Tokenize the corpus (timed), then alternate pretune and transformers MLM pretraining runs.

    Args:
        corpus: text files, folders or globs; None: the bundled corpus (``DEFAULT_CORPUS``).
        tokenizer: tokenizer folder; None: the MiniLM BERT tokenizer (``pretune.realmodels.minilm_dir``).
        cache_dir: where the token store is kept.
        dtypes, rounds, steps, warmup, batch, seq, threads, dropout: see :class:`Job`; every
            (dtype, impl) runs ``rounds`` times, one process each, the first impl alternating.
        shape: model size overrides of ``SHAPE`` (n_layers, dim, n_heads, ffn_dim, vocab_size).
        fresh_store: rebuild the store to time tokenization; False: reuse a cached one.

    Returns:
        The tokenize row (see :func:`build_bench_store`), then one row per dtype: per-impl median
        tokens/s, per-round tokens/s, median peak RSS (MB), and ratio (first impl / second).
    """
    from ..io.progress import progress

    if seq < 4:
        raise ValueError(f"seq ({seq}) must be >= 4 ([CLS] + at least 2 tokens + [SEP])")
    if tokenizer is None:
        from ..io.realmodels import minilm_dir

        tokenizer = minilm_dir()
    if corpus is None:
        if not DEFAULT_CORPUS.is_dir():
            raise FileNotFoundError(f"the bundled corpus {DEFAULT_CORPUS} is missing: pass --corpus FILES")
        corpus = [DEFAULT_CORPUS]
    tok_row = build_bench_store(corpus, tokenizer, cache_dir, fresh=fresh_store, show_progress=show_progress)
    echo(format_tokenize(tok_row))
    shape = dict(SHAPE, **(shape or {}))
    plan = []
    for r in range(rounds):
        for dt in dtypes:
            order = impls if r % 2 == 0 else tuple(reversed(impls))  # alternate who goes first
            for impl in order:
                plan.append(Job(impl, dt, store=tok_row["path"], tokenizer=str(tokenizer), seq=seq, batch=batch,
                                steps=steps, warmup=warmup, threads=threads, dropout=dropout, shape=shape))
    samples: dict[tuple, list[dict]] = {}
    for job in progress(plan, desc="bench pretrain", unit="run", disable=not show_progress):
        samples.setdefault((job.dtype, job.impl), []).append(spawn_worker(job, "pretune.bench.pretrain"))
    rows = [tok_row]
    for dt in dtypes:
        row = {"bench": "mlm", "dtype": dt, "seq": seq, "batch": batch, "steps": steps, **shape}
        for impl in impls:
            runs = samples[(dt, impl)]
            row[f"{impl}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
            row[f"{impl}_runs"] = [round(r["tokens_per_s"], 1) for r in runs]
            row[f"{impl}_rss_mb"] = statistics.median(r["peak_rss_mb"] for r in runs)
            row[f"{impl}_loss"] = runs[-1]["loss"]
            row["threads"] = runs[0]["threads"]
        tokens = {impl: {r["tokens"] for r in samples[(dt, impl)]} for impl in impls}
        if len(set.union(*tokens.values())) != 1:  # same blocks, same plan: the same non-pad tokens per run
            raise RuntimeError(f"{dt}: the implementations timed different numbers of tokens {tokens}: "
                               "they did not see the same data")
        row["timed_tokens"] = next(iter(tokens[impls[0]]))
        if len(impls) == 2:
            row["ratio"] = row[f"{impls[0]}_tokens_per_s"] / row[f"{impls[1]}_tokens_per_s"]
        rows.append(row)
    return rows


def format_tokenize(row: dict) -> str:
    how = "recorded build time of the cached store" if row["cached"] else "fresh build"
    return (f"tokenize-to-store: {row['text_bytes'] / 1e6:.1f} MB of text ({row['files']} files, {row['docs']:,} "
            f"docs) -> {row['tokens']:,} tokens in {row['seconds']:.2f} s: {row['mb_per_s']:.2f} MB/s, "
            f"{row['tokens_per_s'] / 1e6:.2f}M tokens/s ({how})")


def format_rows(rows: list[dict]) -> str:
    """The rows of :func:`bench_pretrain` as a text table (training) plus the tokenize line."""
    lines = []
    train = [r for r in rows if r.get("bench") == "mlm"]
    if train:
        r0 = train[0]
        lines.append(f"MLM pretraining, BERT-style {r0['n_layers']} layers x dim {r0['dim']} ({r0['n_heads']} heads, "
                     f"FFN {r0['ffn_dim']}, vocab {r0['vocab_size']}), seq {r0['seq']}, batch {r0['batch']}, "
                     f"{r0['threads']} threads; tokens/s = non-pad tokens / s, median over rounds")
        head = (f"{'dtype':<6}{'pretune tok/s':>14}{'HF tok/s':>10}{'ratio':>7}{'pretune MB':>12}{'HF MB':>8}"
                f"  {'pretune runs':<24}{'HF runs'}")
        lines += [head, "-" * len(head)]
        for r in train:
            runs = [" ".join(f"{v:.0f}" for v in r[f"{impl}_runs"]) for impl in IMPLS]
            lines.append(f"{r['dtype']:<6}{r['pretune_tokens_per_s']:>14.0f}{r['transformers_tokens_per_s']:>10.0f}"
                         f"{r['ratio']:>7.2f}{r['pretune_rss_mb']:>12.0f}{r['transformers_rss_mb']:>8.0f}"
                         f"  {runs[0]:<24}{runs[1]}")
    lines += [format_tokenize(r) for r in rows if r.get("bench") == "tokenize"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m pretune.bench.pretrain [--rounds 3 ...]``; with one JSON argument,
    the worker: run that :class:`Job` and print its result as JSON."""
    from .common import bench_main

    return bench_main(argv, prog="pretune bench pretrain", doc=__doc__, job_cls=Job, run_worker=run_worker,
                      add_arguments=add_arguments, run_cli=run_cli)


def add_arguments(p) -> None:
    """The ``pretune bench pretrain`` flags, for cli.py's subparser."""
    p.add_argument("--corpus", nargs="+", metavar="SRC", help=f"text files/folders/globs (default: {DEFAULT_CORPUS})")
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="where the token store is kept (%(default)s)")
    p.add_argument("--reuse-store", action="store_true",
                   help="reuse a cached token store instead of re-tokenizing (reports its recorded build time)")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                   help="bf16 = fp32 weights under torch.autocast(bfloat16)")
    add_run_arguments(p, threads="torch's default")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128, help="tokens per example incl. [CLS]/[SEP] (default 128)")


def run_cli(args) -> int:
    """Run the benchmark from parsed :func:`add_arguments` flags and print the table."""
    rows = bench_pretrain(corpus=args.corpus, cache_dir=args.cache_dir, dtypes=tuple(args.dtypes),
                          rounds=args.rounds, steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq,
                          threads=args.threads, fresh_store=not args.reuse_store)
    from .common import report

    return report(rows, format_rows(rows), args.json)


if __name__ == "__main__":  # python -m pretune.bench.pretrain '{"impl": ...}' (worker) or flags (stand-alone)
    sys.exit(main())
