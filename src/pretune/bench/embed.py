"""``pretune bench embed``: sentence-embedding training and encoding with MiniLM, pretune against
sentence-transformers on the same pairs and texts.

The data is built once by the parent from the bundled WordNet set (``pretune/bundled/tasks/wordnet_defines``) by the
rule of ``scripts/embedding_wordnet.py`` (the learning measurement of docs/embeddings.md): each distinct 'defines'
gloss that has a usage example gives a pair, its definition (the gloss before the first quoted example) as the anchor
and its first usage example as the positive ("beyond a norm in views or actions" -> "an extreme conservative").
Training reads the train split's pairs; encoding embeds every distinct anchor and positive of the three splits.

Training (``--batch`` pairs a step, 32 by default): both sides load all-MiniLM-L6-v2 (``pretune.realmodels``), cut
texts to ``--max-len`` tokens (128), train every weight with MultipleNegativesRankingLoss (scale 20, mean pooling,
in-batch negatives) and AdamW (lr 5e-5, weight decay 0.01 off biases and norms, constant schedule, gradient clipping
at norm 1), at the same precision (fp32, or bf16 = fp32 weights under CPU autocast) and torch threads.

* pretune: ``pretune finetune --task embedding``'s run as ``prepare`` and ``build_trainer`` build it (the task's
  defaults: MiniLM's mean pooling, normalised, MNRL scale 20), timed per ``Trainer.train_step()`` (batching with
  the trainer's length buckets, collation, forward, loss, backward, clipping, AdamW);
* st: ``SentenceTransformer(folder)`` + ``losses.MultipleNegativesRankingLoss`` + ``SentenceTransformerTrainer`` (no
  evaluation, no saving, no logging; its default batch sampler and ``adamw_torch_fused``), timed between the
  trainer's consecutive step ends (data loading, tokenisation and callbacks included: what a user of the trainer
  waits for).

Encoding (``--batch`` texts a forward, 32): ``pretune.jobs.embed.embed_texts`` as ``pretune embed`` runs it (mean
pooling, normalised, texts sorted by length, a batch's texts packed end to end where that saves positions, one batch
per torch thread at once: ``streams``) against ``SentenceTransformer.encode(normalize_embeddings=True)`` (its batches
one after the other on every thread) on the same texts, fp32, the same torch threads; each times ``--passes`` whole
passes over the texts after one untimed pass and reports the median. Each also returns some of its vectors, so the
table says how far apart the two sides' embeddings are.

Each measurement runs in its own process, the sides alternate (the order reversed every other round), warmup steps
are untimed; step time and encode time are medians; pairs/s = batch / step time, texts/s = texts / pass time; peak
memory is the process's peak RSS (model loading included), as the other benchmarks take it. The row records the CPU
(``torch.backends.cpu.get_cpu_capability()`` and its name) and the load average before and after.
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .common import add_run_arguments, spawn_worker

IMPLS = ("pretune", "st")
KINDS = ("train", "encode")
TARGET_SPEED = 1.5  # issue 37: pretune's training pairs/s at least this many times sentence-transformers'
TARGET_MEMORY = 0.8  # at no more than this share of its peak RSS
TARGET_ENCODE = 1.5  # and pretune's texts/s embedding at least this many times SentenceTransformer.encode's
LR = 5e-5  # full finetuning's default in pretune (jobs/finetune/defaults.py), and sentence-transformers' docs'
SCALE = 20.0  # MNRL's scale on both sides (both libraries' default)


@dataclass
class Job:
    impl: str  # pretune | st
    kind: str  # train | encode
    dtype: str = "fp32"  # fp32 | bf16 (autocast)
    batch: int = 32  # train: pairs a step; encode: texts a forward
    max_len: int = 128  # tokens per text, special tokens included
    steps: int = 5  # train: timed steps
    warmup: int = 2  # train: untimed steps first
    passes: int = 3  # encode: timed passes over the texts (after one untimed)
    threads: int = 2
    model: str = ""  # a sentence-transformers folder; "" = all-MiniLM-L6-v2
    data_file: str = ""  # train: the pairs (JSONL of anchor, positive); encode: the texts (JSONL of text)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def wordnet_pairs(split: str) -> list[dict]:
    """``{"anchor": definition, "positive": first usage example}`` of every distinct 'defines' gloss of the bundled
    wordnet_defines ``split`` that has an example (both at least 3 words): scripts/embedding_wordnet.py's rule."""
    from .. import bundled

    return gloss_pairs(bundled.path(f"tasks/wordnet_defines/{split}.jsonl").read_text(encoding="utf-8"))


def gloss_pairs(jsonl: str) -> list[dict]:
    """The pairs of one wordnet_defines split's JSONL text (the bundled prefix or the whole set in ../shared/data)."""
    out, seen = [], set()
    for line in jsonl.splitlines():
        rec = json.loads(line)
        if rec["label"] != "defines" or '; "' not in rec["text_b"] or rec["text_b"] in seen:
            continue
        seen.add(rec["text_b"])
        definition, rest = rec["text_b"].split('; "', 1)
        example = re.match(r'([^"]+)"', rest)
        if example and len(example.group(1).split()) >= 3 and len(definition.split()) >= 3:
            out.append({"anchor": definition.strip(), "positive": example.group(1).strip()})
    return out


def encode_texts() -> list[str]:
    """Every distinct anchor and positive of the three splits' pairs, in order of first appearance."""
    return list(dict.fromkeys(t for split in ("train", "dev", "test") for r in wordnet_pairs(split)
                              for t in (r["anchor"], r["positive"])))


def model_folder(model: str = "") -> Path:
    from ..io.realmodels import minilm_dir

    return Path(model) if model else minilm_dir()


# ---------------------------------------------------------------------------------------------
# worker side (runs in a child process)
# ---------------------------------------------------------------------------------------------
def _peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def _read_jsonl(path: str) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text(encoding="utf-8").splitlines() if x]


def run_worker(job: Job) -> dict:
    """One measurement (see the module docstring); returns its times, peak RSS and what it computed."""
    import torch

    if job.impl not in IMPLS or job.kind not in KINDS:
        raise ValueError(f"impl ({job.impl!r}) must be one of {IMPLS} and kind ({job.kind!r}) one of {KINDS}")
    if job.threads:
        torch.set_num_threads(job.threads)
    torch.set_flush_denormal(True)  # as pretune finetune does; set for sentence-transformers too
    torch.manual_seed(0)
    folder = model_folder(job.model)
    work = {("pretune", "train"): _pretune_train, ("st", "train"): _st_train,
            ("pretune", "encode"): _pretune_encode, ("st", "encode"): _st_encode}[(job.impl, job.kind)]
    out = work(job, folder)
    return {**out, "peak_rss_mb": _peak_rss_mb(), "threads": torch.get_num_threads()}


def finetune_overrides(job: Job, folder, out) -> list[str]:
    """The ``pretune finetune`` config of the pretune training side: ``--task embedding`` (its defaults) with the
    bench's batch, length, optimizer and precision, the run folder ``out``."""
    return [f"model.init={folder}", "task.name=embedding", f"task.max_len={job.max_len}", f"task.scale={SCALE}",
            f"data.train={job.data_file}", f"data.dev={job.data_file}", f"train.batch_size={job.batch}",
            f"train.steps={job.warmup + job.steps}", "tune.epochs=0", f"train.lr={LR}", "train.schedule=constant",
            "train.warmup_steps=0", "tune.warmup_ratio=0.0", "train.weight_decay=0.01", "train.clip=1.0",
            f"train.precision={job.dtype}", f"train.threads={job.threads}", "train.seed=0", f"train.out={out}",
            "train.keep_last=0", "train.report_to=[]", "train.plot=false"]


def _pretune_train(job: Job, folder) -> dict:
    import tempfile

    from ..jobs.finetune import load_finetune_config, prepare
    from ..jobs.finetune.trainer import build_trainer

    def quiet(*args, **kwargs):
        pass

    times, cpu, losses, positions, tokens = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="pretune-bench-embed-") as tmp:
        cfg = load_finetune_config(None, finetune_overrides(job, folder, f"{tmp}/run"))
        prepared = prepare(cfg, show_progress=False, log=quiet)
        trainer = build_trainer(prepared, show_progress=False, log=quiet)
        layout = prepared.task.model_layout
        hidden_states = layout.hidden_states

        def counted(model, ids, mask, **kw):  # the positions the stack reads (packed rows), and the real tokens
            positions[-1] += int(ids.numel())
            tokens[-1] += int(mask.sum())
            return hidden_states(model, ids, mask, **kw)

        layout.hidden_states = counted
        for i in range(job.warmup + job.steps):
            positions.append(0)
            tokens.append(0)
            t0, c0 = time.perf_counter(), time.process_time()
            out = trainer.train_step()
            if i >= job.warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            losses.append(out["loss"])
    return {"step_s": statistics.median(times), "cpu_s": statistics.median(cpu), "first_loss": losses[0],
            "losses": losses, "positions": positions, "tokens": tokens, "precision": trainer.precision}


def _st_train(job: Job, folder) -> dict:
    import tempfile

    import datasets
    import sentence_transformers as st
    import torch
    import transformers
    from sentence_transformers.sentence_transformer import losses as st_losses

    ends: list[tuple[float, float]] = []
    losses: list[float] = []
    positions: list[int] = []
    tokens: list[int] = []

    class StepEnds(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kw):
            ends.append((time.perf_counter(), time.process_time()))

    class Trainer(st.SentenceTransformerTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            ids = [v for k, v in inputs.items() if k.endswith("input_ids")]
            positions.append(sum(int(x.numel()) for x in ids))  # anchors and positives, each padded to its longest
            tokens.append(sum(int(v.sum()) for k, v in inputs.items() if k.endswith("attention_mask")))
            out = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append(float((out[0] if isinstance(out, tuple) else out).detach()))
            return out

    model = st.SentenceTransformer(str(folder), device="cpu")
    model.max_seq_length = job.max_len
    pairs = _read_jsonl(job.data_file)
    rows = datasets.Dataset.from_dict({"anchor": [r["anchor"] for r in pairs],
                                       "positive": [r["positive"] for r in pairs]})
    with tempfile.TemporaryDirectory(prefix="pretune-bench-embed-st-") as out:
        args = st.SentenceTransformerTrainingArguments(
            output_dir=out, per_device_train_batch_size=job.batch, max_steps=job.warmup + job.steps,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0,
            bf16=job.dtype == "bf16", use_cpu=True, save_strategy="no", eval_strategy="no", report_to=[],
            logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, dataloader_drop_last=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=rows,
                          loss=st_losses.MultipleNegativesRankingLoss(model, scale=SCALE), callbacks=[StepEnds()])
        trainer.train()
    gaps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(ends, ends[1:])][job.warmup:]
    return {"step_s": statistics.median(g[0] for g in gaps), "cpu_s": statistics.median(g[1] for g in gaps),
            "first_loss": losses[0], "losses": losses, "positions": positions, "tokens": tokens,
            "precision": job.dtype, "optimizer": str(getattr(args.optim, "value", args.optim)),
            "threads_torch": torch.get_num_threads()}


SAMPLED = 8  # encode: vectors each side returns (spread over the texts), compared by the parent


def _timed_passes(job: Job, encode) -> dict:
    """``encode()`` once untimed (first-call allocations), then ``job.passes`` timed passes: the median seconds (wall
    and this process's CPU), and :data:`SAMPLED` of the vectors the last pass returned."""
    import numpy as np

    encode()
    wall, cpu, out = [], [], None
    for _ in range(job.passes):
        t0, c0 = time.perf_counter(), time.process_time()
        out = encode()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    picked = np.linspace(0, len(out) - 1, min(SAMPLED, len(out))).round().astype(int)
    return {"encode_s": statistics.median(wall), "encode_cpu_s": statistics.median(cpu), "texts": len(out),
            "sampled": picked.tolist(), "vectors": np.asarray(out)[picked].tolist()}


def _pretune_encode(job: Job, folder) -> dict:
    import torch

    from ..jobs.embed import embed_texts, load_encoder

    texts = [r["text"] for r in _read_jsonl(job.data_file)]
    model, tok = load_encoder(folder)
    streams = torch.get_num_threads()  # what pretune embed runs: a batch per thread at once
    return _timed_passes(job, lambda: embed_texts(model, tok, texts, pooling="mean", normalize=True,
                                                  batch_size=job.batch, max_len=job.max_len, streams=streams))


def _st_encode(job: Job, folder) -> dict:
    import sentence_transformers as st

    texts = [r["text"] for r in _read_jsonl(job.data_file)]
    model = st.SentenceTransformer(str(folder), device="cpu")
    model.max_seq_length = job.max_len
    return _timed_passes(job, lambda: model.encode(texts, batch_size=job.batch, normalize_embeddings=True,
                                                   convert_to_numpy=True, show_progress_bar=False))


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def cpu_line() -> str:
    """The CPU as the rows record it: its name, torch's kernel level and what it computes bf16 with."""
    from ..train.precision import describe_device

    return describe_device("cpu")


def summarize(train: dict[str, list[dict]], encode: dict[str, list[dict]], *, dtype: str, rounds: int,
              job_kw: dict) -> dict:
    """One precision's row from each side's worker results (``train[impl]``, ``encode[impl]``: one dict per round;
    ``encode`` empty for bf16, which is timed for training only): median pairs/s and texts/s (wall clock, and from
    the process's CPU time, which another load on the machine disturbs less), the largest peak RSS, the positions
    and tokens a step reads, the ratios and whether each meets the issue's target, and how far apart the two sides'
    vectors are."""
    import numpy as np

    B = job_kw["batch"]
    row = {"bench": "embed", "dtype": dtype, "rounds": rounds, **job_kw}
    for impl, runs in train.items():
        row[f"{impl}_pairs_per_s"] = statistics.median(B / x["step_s"] for x in runs)
        row[f"{impl}_cpu_pairs_per_s"] = statistics.median(B / x["cpu_s"] for x in runs)
        row[f"{impl}_runs"] = [round(B / x["step_s"], 2) for x in runs]
        row[f"{impl}_peak_rss_mb"] = max(x["peak_rss_mb"] for x in runs)
        row[f"{impl}_first_loss"] = runs[0]["first_loss"]
        row[f"{impl}_positions"] = round(statistics.mean(runs[0]["positions"]))  # a step's, mean over the steps
        row[f"{impl}_tokens"] = round(statistics.mean(runs[0]["tokens"]))
    for impl, runs in encode.items():
        row[f"{impl}_texts_per_s"] = statistics.median(x["texts"] / x["encode_s"] for x in runs)
        row[f"{impl}_cpu_texts_per_s"] = statistics.median(x["texts"] / x["encode_cpu_s"] for x in runs)
        row[f"{impl}_encode_runs"] = [round(x["texts"] / x["encode_s"], 1) for x in runs]
        row[f"{impl}_encode_peak_rss_mb"] = max(x["peak_rss_mb"] for x in runs)
        row["texts"] = runs[0]["texts"]
    if set(train) == set(IMPLS):
        speed = row["pretune_pairs_per_s"] / row["st_pairs_per_s"]
        memory = row["pretune_peak_rss_mb"] / row["st_peak_rss_mb"]
        row.update(speed_ratio=speed, cpu_speed_ratio=row["pretune_cpu_pairs_per_s"] / row["st_cpu_pairs_per_s"],
                   memory_ratio=memory, target_met=bool(speed >= TARGET_SPEED and memory <= TARGET_MEMORY))
    if set(encode) == set(IMPLS):
        ratio = row["pretune_texts_per_s"] / row["st_texts_per_s"]
        a, b = (np.array(encode[i][0]["vectors"]) for i in IMPLS)
        row.update(encode_ratio=ratio, cpu_encode_ratio=row["pretune_cpu_texts_per_s"] / row["st_cpu_texts_per_s"],
                   encode_target_met=bool(ratio >= TARGET_ENCODE), encode_max_abs_diff=float(np.abs(a - b).max()))
    return row


def bench_embed(*, dtypes=("fp32",), rounds: int = 3, impls=IMPLS, kinds=KINDS, **job_kw) -> list[dict]:
    """Time every side of ``impls`` for ``rounds`` alternating rounds: training per precision of ``dtypes``,
    encoding in fp32; one row per precision (see :func:`summarize`). ``job_kw``: the fields of :class:`Job`."""
    import tempfile

    from ..io.progress import progress

    impls, kinds = tuple(impls), tuple(kinds)
    if rounds < 1 or job_kw.get("steps", 1) < 1 or job_kw.get("warmup", 0) < 0 or job_kw.get("passes", 1) < 1:
        raise ValueError(f"rounds ({rounds}), steps ({job_kw.get('steps')}) and passes ({job_kw.get('passes')}) "
                         f"must be >= 1, warmup ({job_kw.get('warmup')}) >= 0")
    pairs = wordnet_pairs("train")
    batch = job_kw.get("batch", 32)
    if not 2 <= batch <= len(pairs):
        raise ValueError(f"batch ({batch}) must be between 2 and the {len(pairs)} training pairs")
    job_kw = {"batch": batch, **job_kw}
    load_before = os.getloadavg()
    samples: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pretune-bench-embed-") as tmp:
        files = {"train": Path(tmp) / "pairs.jsonl", "encode": Path(tmp) / "texts.jsonl"}
        files["train"].write_text("".join(json.dumps(r) + "\n" for r in pairs), encoding="utf-8")
        files["encode"].write_text("".join(json.dumps({"text": t}) + "\n" for t in encode_texts()), encoding="utf-8")
        plan = []
        for r in range(rounds):
            order = impls if r % 2 == 0 else tuple(reversed(impls))
            if "train" in kinds:
                plan += [Job(impl, "train", dt, data_file=str(files["train"]), **job_kw) for dt in dtypes
                         for impl in order]
            if "encode" in kinds:
                plan += [Job(impl, "encode", "fp32", data_file=str(files["encode"]), **job_kw) for impl in order]
        for job in progress(plan, desc="bench embed", unit="run"):
            samples.setdefault((job.kind, job.dtype, job.impl), []).append(spawn_worker(job, "pretune.bench.embed"))
    env = {"cpu": cpu_line(), "load_before": [round(x, 2) for x in load_before],
           "load_after": [round(x, 2) for x in os.getloadavg()]}
    rows = []
    for dt in dtypes if "train" in kinds else ("fp32",):
        train = {i: samples[("train", dt, i)] for i in impls if ("train", dt, i) in samples}
        encode = {i: samples[("encode", dt, i)] for i in impls if ("encode", dt, i) in samples}
        rows.append({**summarize(train, encode, dtype=dt, rounds=rounds, job_kw=job_kw), **env})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines.append(f"{r['dtype']}: MiniLM (all-MiniLM-L6-v2), MNRL scale {SCALE:g}, batch {r['batch']} pairs, "
                     f"max_len {r['max_len']}, {r['threads']} threads, {r['rounds']} round"
                     f"{'s' if r['rounds'] != 1 else ''}; {r.get('cpu', '')}; load average {r.get('load_before')} "
                     f"before, {r.get('load_after')} after")
        impls = [i for i in IMPLS if f"{i}_pairs_per_s" in r]
        if impls:
            head = (f"  {'training':<10}{'pairs/s':>9}{'s/step':>8}{'CPU p/s':>9}{'peak MB':>9}{'positions':>11}"
                    f"{'tokens':>8}{'first loss':>12}  rounds (pairs/s)")
            lines += [head, "  " + "-" * (len(head) + 10)]
            for impl in impls:
                pps = r[f"{impl}_pairs_per_s"]
                lines.append(f"  {impl:<10}{pps:>9.1f}{r['batch'] / pps:>8.3f}{r[f'{impl}_cpu_pairs_per_s']:>9.1f}"
                             f"{r[f'{impl}_peak_rss_mb']:>9.0f}{r[f'{impl}_positions']:>11}{r[f'{impl}_tokens']:>8}"
                             f"{r[f'{impl}_first_loss']:>12.4f}  {r[f'{impl}_runs']}")
            lines.append("  positions: token positions the model reads a step (padding included), tokens: the real "
                         "ones (means over the first run's steps); CPU p/s: pairs per second of process CPU time")
        if "speed_ratio" in r:
            lines.append(f"  pretune vs sentence-transformers fit: {r['speed_ratio']:.2f}x pairs/s "
                         f"({r['cpu_speed_ratio']:.2f}x by CPU time) at {r['memory_ratio']:.2f}x peak memory "
                         f"(target >= {TARGET_SPEED:g}x at <= {TARGET_MEMORY:g}x: "
                         f"{'met' if r['target_met'] else 'NOT met'})")
        impls = [i for i in IMPLS if f"{i}_texts_per_s" in r]
        if impls:
            head = f"  {'encoding':<10}{'texts/s':>9}{'CPU t/s':>9}{'peak MB':>9}  rounds (texts/s)"
            lines += [f"  encoding {r['texts']} texts, {r['batch']} a forward, fp32, normalised", head,
                      "  " + "-" * (len(head) + 10)]
            for impl in impls:
                lines.append(f"  {impl:<10}{r[f'{impl}_texts_per_s']:>9.1f}{r[f'{impl}_cpu_texts_per_s']:>9.1f}"
                             f"{r[f'{impl}_encode_peak_rss_mb']:>9.0f}  {r[f'{impl}_encode_runs']}")
        if "encode_ratio" in r:
            lines.append(f"  pretune embed vs SentenceTransformer.encode: {r['encode_ratio']:.2f}x texts/s "
                         f"({r['cpu_encode_ratio']:.2f}x by CPU time; target >= {TARGET_ENCODE:g}x: "
                         f"{'met' if r['encode_target_met'] else 'NOT met'}); the vectors differ by at most "
                         f"{r['encode_max_abs_diff']:.1e}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                   help="training precision on both sides (default fp32; encoding is fp32 always); bf16 = fp32 "
                        "weights under torch.autocast(bfloat16)")
    add_run_arguments(p, default_threads=2)  # the encode comparison: 2 threads on both sides
    p.add_argument("--batch", type=int, default=32,
                   help="pairs a training step, texts an encoding forward (default 32)")
    p.add_argument("--max-len", type=int, default=128, help="tokens per text (default 128)")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per run, median taken (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed training steps first (default 2)")
    p.add_argument("--passes", type=int, default=3, help="timed encoding passes over the texts (default 3)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="what to time (default both)")
    p.add_argument("--model", default="", metavar="DIR",
                   help="a sentence-transformers BERT folder both sides load (default: all-MiniLM-L6-v2)")


def run_cli(args) -> int:
    import importlib.util

    if importlib.util.find_spec("sentence_transformers") is None:
        print("pretune bench embed: it compares with sentence-transformers: pip install sentence-transformers",
              file=sys.stderr)
        return 2
    try:
        rows = bench_embed(dtypes=tuple(args.dtypes), rounds=args.rounds, kinds=tuple(args.kinds), batch=args.batch,
                           max_len=args.max_len, steps=args.steps, warmup=args.warmup, passes=args.passes,
                           threads=args.threads, model=args.model)
    except ValueError as e:
        print(f"pretune bench embed: {e}", file=sys.stderr)
        return 2
    from .common import report

    return report(rows, format_rows(rows), args.json)


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main(argv, prog="pretune bench embed", doc=__doc__, job_cls=Job, run_worker=run_worker,
                      add_arguments=add_arguments, run_cli=run_cli)


if __name__ == "__main__":  # python -m pretune.bench.embed '{"impl": ...}' (worker) or flags (stand-alone)
    sys.exit(main())
