"""``pretune bench generate``: greedy decoding tokens/s, pretune's ``generate`` vs transformers' ``generate``.

Both sides decode the same model (default: SmolLM2-135M-Instruct, ``pretune.realmodels.smollm2_dir()``; any
Hugging Face decoder folder with ``--model``) in fp32 on the CPU: ``batch`` prompts of ``prompt_len`` random
token ids (the same ids on both sides, drawn with ``seed``, no padding), ``new_tokens`` new tokens each,
greedy, with the KV cache. Both are given ``min_new_tokens = max_new_tokens = new_tokens`` so that neither
stops at EOS: every run produces exactly ``batch * new_tokens`` tokens (checked), and the two outputs are
compared token for token (``same_tokens``).

* pretune: ``pretune.from_hf(folder)`` and :func:`pretune.generation.generate`.
* transformers: ``AutoModelForCausalLM.from_pretrained(folder, dtype=float32)`` (its default attention, SDPA)
  and ``model.generate(..., do_sample=False, num_beams=1)``.

Each measurement is one Python process (:func:`pretune.bench.spawn_worker`); the implementations alternate
which goes first, for ``rounds`` rounds. In a process: one untimed warm-up generation of 8 tokens, then
``repeats`` timed generations (``time.perf_counter`` around the ``generate`` call: prefill + every decoding
step); the process reports its fastest. Tokens/s = batch * new_tokens / seconds; the table gives the median
over rounds of each side and the ratio pretune / transformers (target: >= 1.5 at batch 1).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .bench import add_run_arguments, spawn_worker

IMPLS = ("pretune", "transformers")
TARGET_RATIO = 1.5  # pretune tokens/s / transformers tokens/s at batch 1


@dataclass
class Job:
    impl: str  # pretune | transformers
    model: str  # Hugging Face decoder folder
    batch: int = 1
    prompt_len: int = 32
    new_tokens: int = 128
    repeats: int = 2  # timed generations per process (the fastest is reported)
    threads: int = 0  # torch threads; 0: every core
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# worker side (runs in a child process)
# ---------------------------------------------------------------------------------------------
def _load(job: Job):
    import torch

    if job.impl == "pretune":
        from . import from_hf
        from .generation import generate

        model = from_hf(job.model)

        def run(ids, n):
            return generate(model, ids, torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            pad_token_id=model.config.pad_token_id)
    else:
        import transformers as T

        model = T.AutoModelForCausalLM.from_pretrained(job.model, dtype=torch.float32).eval()
        pad = model.generation_config.pad_token_id
        pad = pad if pad is not None else model.config.pad_token_id if model.config.pad_token_id is not None else 0

        def run(ids, n):
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, num_beams=1, pad_token_id=pad)
    return model, run


def run_worker(job: Job) -> dict:
    """Time greedy generation with one implementation (see the module docstring).

    Returns:
        tokens_per_s (fastest repeat), seconds (of that repeat), all_seconds, tokens (of row 0: the new ids,
        to compare the two sides), threads.
    """
    import torch

    from .bench_finetune import default_threads

    if job.impl not in IMPLS:
        raise ValueError(f"impl ({job.impl!r}) must be one of {IMPLS}")
    torch.set_num_threads(job.threads or default_threads())
    model, run = _load(job)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(job.seed)
    ids = torch.randint(min(100, vocab - 1), vocab, (job.batch, job.prompt_len), generator=g)
    run(ids, 8)  # warm-up: first-call allocations, lazy init
    seconds = []
    for _ in range(job.repeats):
        t0 = time.perf_counter()
        out = run(ids, job.new_tokens)
        seconds.append(time.perf_counter() - t0)
    if out.shape != (job.batch, job.prompt_len + job.new_tokens):
        raise RuntimeError(f"{job.impl} generated {tuple(out.shape)}, expected "
                           f"{(job.batch, job.prompt_len + job.new_tokens)}")
    best = min(seconds)
    return {"tokens_per_s": job.batch * job.new_tokens / best, "seconds": best, "all_seconds": seconds,
            "tokens": out[:, job.prompt_len:].tolist(), "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def bench_generate(*, model=None, batches=(1, 8), rounds: int = 3, prompt_len: int = 32, new_tokens: int = 128,
                   repeats: int = 2, threads: int = 0, seed: int = 0, impls=IMPLS, show_progress: bool = True,
                   echo=print, spawn=spawn_worker) -> list[dict]:
    """Alternate pretune and transformers greedy generation, one process per run, ``rounds`` times per batch size.

    Args:
        model: a Hugging Face decoder folder; None: SmolLM2-135M-Instruct (``pretune.realmodels.smollm2_dir``).
        batches: batch sizes to time.
        rounds: alternating rounds (who goes first alternates).
        prompt_len, new_tokens: prompt length and tokens generated per row.
        repeats: timed generations per process (its fastest counts).
        threads: torch threads of both sides; 0: every core.
        echo: where a line per finished run goes (None: nowhere).
        spawn: runs one :class:`Job` and returns its result (default: in a fresh process).

    Returns:
        One row per batch size: the settings, ``<impl>_runs`` (tokens/s per round), ``<impl>_tokens_per_s``
        (median), ``ratio`` (pretune / transformers), ``same_tokens`` (both sides generated the same ids) and,
        at batch 1, ``target_met`` (ratio >= 1.5).
    """
    from tqdm import tqdm

    from .bench_finetune import default_threads

    if rounds < 1:
        raise ValueError(f"rounds ({rounds}) must be >= 1")
    if new_tokens < 1 or prompt_len < 1:
        raise ValueError(f"prompt_len ({prompt_len}) and new_tokens ({new_tokens}) must be >= 1")
    if model is None:
        from .realmodels import smollm2_dir

        model = smollm2_dir()
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"{model}: no config.json; --model must be a Hugging Face decoder folder")
    threads = threads or default_threads()
    plan = []
    for r in range(rounds):
        for b in batches:
            order = impls if r % 2 == 0 else tuple(reversed(impls))  # alternate who goes first
            plan += [Job(impl, str(model), batch=b, prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats,
                         threads=threads, seed=seed) for impl in order]
    samples: dict[tuple, list[dict]] = {}
    for job in tqdm(plan, desc="bench generate", unit="run", disable=not show_progress):
        res = spawn(job, "pretune.bench_generate")
        samples.setdefault((job.batch, job.impl), []).append(res)
        if echo is not None:
            echo(f"batch {job.batch} {job.impl}: {res['tokens_per_s']:.1f} tokens/s")
    rows = []
    for b in batches:
        row = {"bench": "generate", "model": str(model), "dtype": "fp32", "batch": b, "prompt_len": prompt_len,
               "new_tokens": new_tokens, "rounds": rounds, "repeats": repeats, "threads": threads}
        for impl in impls:
            runs = samples[(b, impl)]
            row[f"{impl}_runs"] = [round(r["tokens_per_s"], 2) for r in runs]
            row[f"{impl}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
        if set(impls) == set(IMPLS):
            row["ratio"] = row["pretune_tokens_per_s"] / row["transformers_tokens_per_s"]
            row["same_tokens"] = samples[(b, "pretune")][0]["tokens"] == samples[(b, "transformers")][0]["tokens"]
            if b == 1:
                row["target_met"] = bool(row["ratio"] >= TARGET_RATIO)
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows of :func:`bench_generate` as a text table: every round, then the medians and the target."""
    rows = [r for r in rows if r.get("bench") == "generate"]
    if not rows:
        return ""
    r0 = rows[0]
    model = Path(r0["model"]).name
    lines = [f"greedy generation, {model}, fp32 CPU, {r0['threads']} threads: {r0['new_tokens']} new tokens after a "
             f"{r0['prompt_len']}-token prompt; tokens/s = batch x new tokens / seconds (fastest of "
             f"{r0['repeats']} per process); ratio = pretune / HF (medians over {r0['rounds']} rounds)"]
    head = f"{'batch':<7}{'round':<8}{'pretune tok/s':>14}{'HF tok/s':>10}{'ratio':>8}{'same tokens':>13}"
    lines += [head, "-" * len(head)]
    for r in rows:
        for i, (a, b) in enumerate(zip(r["pretune_runs"], r["transformers_runs"]), 1):
            lines.append(f"{r['batch']:<7}{i:<8}{a:>14.1f}{b:>10.1f}{a / b:>8.2f}")
        lines.append(f"{r['batch']:<7}{'median':<8}{r['pretune_tokens_per_s']:>14.1f}"
                     f"{r['transformers_tokens_per_s']:>10.1f}{r['ratio']:>8.2f}{str(r['same_tokens']):>13}")
        if "target_met" in r:
            verdict = "met" if r["target_met"] else "NOT met"
            lines.append(f"batch {r['batch']}: target (>= {TARGET_RATIO:g}x transformers' tokens/s): {verdict} "
                         f"({r['ratio']:.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m pretune.bench_generate [--rounds 3 ...]``; with one JSON argument, the
    worker: run that :class:`Job` and print its result as JSON."""
    from .bench import bench_main

    return bench_main(argv, prog="pretune bench generate", doc=__doc__, job_cls=Job, run_worker=run_worker,
                      add_arguments=add_arguments, run_cli=run_cli)


def add_arguments(p) -> None:
    """The ``pretune bench generate`` flags, for cli.py's subparser."""
    p.add_argument("--model", metavar="DIR", help="Hugging Face decoder folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8], metavar="B", help="batch sizes (default 1 8)")
    add_run_arguments(p)
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per row (default 32)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default 128)")
    p.add_argument("--repeats", type=int, default=2, help="timed generations per process, fastest kept (default 2)")


def run_cli(args) -> int:
    """Run the benchmark from parsed :func:`add_arguments` flags and print the table."""
    from tqdm import tqdm

    rows = bench_generate(model=args.model, batches=tuple(args.batches), rounds=args.rounds,
                          prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats,
                          threads=args.threads, echo=tqdm.write)
    from .bench import report

    return report(rows, format_rows(rows), args.json)


if __name__ == "__main__":  # python -m pretune.bench_generate '{"impl": ...}' (worker) or flags (stand-alone)
    sys.exit(main())
