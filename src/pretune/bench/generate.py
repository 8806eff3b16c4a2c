"""``pretune bench generate``: greedy decoding tokens/s, pretune's ``generate`` vs transformers' ``generate``.

Both sides decode the same model (default: SmolLM2-135M-Instruct, ``pretune.realmodels.smollm2_dir()``; any
Hugging Face decoder folder with ``--model``) in fp32 on the CPU: ``batch`` prompts of ``prompt_len`` random
token ids (the same ids on both sides, drawn with ``seed``, no padding), ``new_tokens`` new tokens each,
greedy, with the KV cache. Both are given ``min_new_tokens = max_new_tokens = new_tokens`` so that neither
stops at EOS: every run produces exactly ``batch * new_tokens`` tokens (checked), and the two outputs are
compared token for token (``same_tokens``).

* pretune: ``pretune.load(folder)`` and :func:`pretune.generation.generate` (eager).
* pretune-compiled: the same with ``compile=True`` (a fixed-shape KV cache and a ``torch.compile``'d decoding
  step). Its warm-up generates the full ``new_tokens`` (so that the timed runs find the step compiled for their
  shape) and its time, compilation included, is reported as ``first_seconds``.
* transformers: ``AutoModelForCausalLM.from_pretrained(folder, dtype=float32)`` (its default attention, SDPA)
  and ``model.generate(..., do_sample=False, num_beams=1)``.

Each measurement is one Python process (:func:`pretune.bench.common.spawn_worker`); the implementations alternate
which goes first, for ``rounds`` rounds. In a process: one untimed warm-up generation of 8 tokens, then
``repeats`` timed generations (``time.perf_counter`` around the ``generate`` call: prefill + every decoding
step); the process reports its fastest. Tokens/s = batch * new_tokens / seconds; the table gives the median
over rounds of each side and the ratios pretune / transformers and pretune-compiled / transformers (targets at batch
1: >= 1.3 eager, >= 1.5 compiled).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .common import add_run_arguments, spawn_worker

IMPLS = ("pretune", "pretune-compiled", "transformers", "pretune-int8", "pretune-int4")
DEFAULT_IMPLS = IMPLS[:3]  # --quantize MODE adds pretune-MODE
OURS = {"pretune": "", "pretune-compiled": "compiled_"}  # our implementations -> prefix of their row keys
# pretune.quantize sides (issue 36): tokens/s against pretune's fp32 eager side at batch 1, and the perplexity bound
# scripts/quantized_perplexity.py checks
QUANTIZED = {"pretune-int8": ("int8", 1.8), "pretune-int4": ("int4", 2.5)}
# pretune tokens/s / transformers tokens/s at batch 1: compiled decoding's target (the generation issue) and eager
# decoding's (issue 17: without a compiler)
TARGETS = {"pretune": 1.3, "pretune-compiled": 1.5}


@dataclass
class Job:
    impl: str  # pretune | pretune-compiled | transformers
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

    if job.impl in OURS or job.impl in QUANTIZED:
        from ..generation import generate
        from ..loading import load

        model = load(job.model)
        if job.impl in QUANTIZED:  # int8 / int4 weights from the fp32 ones (pretune.quantize)
            from ..model import quantize

            quantize(model.eval().requires_grad_(False), QUANTIZED[job.impl][0])
        compile = job.impl == "pretune-compiled"

        def run(ids, n):
            return generate(model, ids, torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            pad_token_id=model.config.pad_token_id, compile=compile)
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
        tokens_per_s (fastest repeat), seconds (of that repeat), all_seconds, first_seconds (the warm-up call;
        pretune-compiled: compiling included), tokens (the new ids, to compare the sides), threads.
    """
    import torch

    from .finetune import default_threads

    if job.impl not in IMPLS:
        raise ValueError(f"impl ({job.impl!r}) must be one of {IMPLS}")
    torch.set_num_threads(job.threads or default_threads())
    model, run = _load(job)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(job.seed)
    ids = torch.randint(min(100, vocab - 1), vocab, (job.batch, job.prompt_len), generator=g)
    t0 = time.perf_counter()  # warm-up: first-call allocations, lazy init; compiling the step for this shape
    run(ids, job.new_tokens if job.impl == "pretune-compiled" else 8)
    first = time.perf_counter() - t0
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
            "first_seconds": first, "tokens": out[:, job.prompt_len:].tolist(), "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def bench_generate(*, model=None, batches=(1, 8), rounds: int = 3, prompt_len: int = 32, new_tokens: int = 128,
                   repeats: int = 2, threads: int = 0, seed: int = 0, impls=DEFAULT_IMPLS, show_progress: bool = True,
                   echo=print, spawn=spawn_worker) -> list[dict]:
    """Alternate pretune (eager, compiled) and transformers greedy generation, one process per run, ``rounds``
    times per batch size.

    Args:
        model: a Hugging Face decoder folder; None: SmolLM2-135M-Instruct (``pretune.realmodels.smollm2_dir``).
        batches: batch sizes to time.
        rounds: alternating rounds (who goes first alternates).
        prompt_len, new_tokens: prompt length and tokens generated per row.
        repeats: timed generations per process (its fastest counts).
        threads: torch threads of both sides; 0: every core.
        echo: where a line per finished run goes (None: nowhere).
        impls: which of IMPLS to run (transformers plus at least one of ours for the ratios; pretune-int8 /
            pretune-int4 with pretune for their speed-up over fp32 eager).
        spawn: runs one :class:`Job` and returns its result (default: in a fresh process).

    Returns:
        One row per batch size: the settings, ``<impl>_runs`` (tokens/s per round), ``<impl>_tokens_per_s``
        (median); for pretune ``ratio`` (pretune / transformers), ``same_tokens`` (the same ids as transformers)
        and, at batch 1, ``target_met`` (ratio >= 1.3); the same keys prefixed ``compiled_`` (target 1.5) for
        pretune-compiled, with ``compiled_first_seconds`` (median warm-up call, compiling included).
    """
    from ..io.progress import progress
    from .finetune import default_threads

    if rounds < 1:
        raise ValueError(f"rounds ({rounds}) must be >= 1")
    impls = tuple(impls)
    if not impls or any(i not in IMPLS for i in impls) or len(set(impls)) != len(impls):
        raise ValueError(f"impls ({impls}) must be distinct names from {IMPLS}")
    if new_tokens < 1 or prompt_len < 1:
        raise ValueError(f"prompt_len ({prompt_len}) and new_tokens ({new_tokens}) must be >= 1")
    if model is None:
        from ..io.realmodels import smollm2_dir

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
    for job in progress(plan, desc="bench generate", unit="run", disable=not show_progress):
        res = spawn(job, "pretune.bench.generate")
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
        for impl, (mode, target) in QUANTIZED.items():
            if impl in impls and "pretune" in impls:
                row[f"{mode}_speedup"] = row[f"{impl}_tokens_per_s"] / row["pretune_tokens_per_s"]
                if b == 1:
                    row[f"{mode}_target_met"] = bool(row[f"{mode}_speedup"] >= target)
        for impl, key in OURS.items():
            if impl not in impls:
                continue
            if impl == "pretune-compiled":
                row["compiled_first_seconds"] = statistics.median(r["first_seconds"] for r in samples[(b, impl)])
            if "transformers" not in impls:
                continue
            row[f"{key}ratio"] = row[f"{impl}_tokens_per_s"] / row["transformers_tokens_per_s"]
            row[f"{key}same_tokens"] = samples[(b, impl)][0]["tokens"] == samples[(b, "transformers")][0]["tokens"]
            if b == 1:
                row[f"{key}target_met"] = bool(row[f"{key}ratio"] >= TARGETS[impl])
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows of :func:`bench_generate` as a text table: every round, then the medians and the target."""
    rows = [r for r in rows if r.get("bench") == "generate"]
    if not rows:
        return ""
    r0 = rows[0]
    impls = [i for i in IMPLS if f"{i}_runs" in r0]
    ours = [i for i in impls if i in OURS and "transformers" in impls]
    model = Path(r0["model"]).name
    lines = [f"greedy generation, {model}, fp32 CPU, {r0['threads']} threads: {r0['new_tokens']} new tokens after a "
             f"{r0['prompt_len']}-token prompt; tokens/s = batch x new tokens / seconds (fastest of "
             f"{r0['repeats']} per process); ratio = ours / HF (medians over {r0['rounds']} rounds)"]
    names = {"pretune": "pretune", "pretune-compiled": "compiled", "transformers": "HF", "pretune-int8": "int8",
             "pretune-int4": "int4"}
    head = (f"{'batch':<7}{'round':<8}" + "".join(f"{names[i] + ' tok/s':>16}" for i in impls)
            + "".join(f"{names[i] + ' ratio':>16}" for i in ours))
    lines += [head, "-" * len(head)]
    for r in rows:
        hf = r.get("transformers_runs")
        for n in range(len(r[f"{impls[0]}_runs"])):
            line = f"{r['batch']:<7}{n + 1:<8}" + "".join(f"{r[f'{i}_runs'][n]:>16.1f}" for i in impls)
            lines.append(line + "".join(f"{r[f'{i}_runs'][n] / hf[n]:>16.2f}" for i in ours))
        lines.append(f"{r['batch']:<7}{'median':<8}" + "".join(f"{r[f'{i}_tokens_per_s']:>16.1f}" for i in impls)
                     + "".join(f"{r[OURS[i] + 'ratio']:>16.2f}" for i in ours))
        for i in ours:
            key = OURS[i]
            same = "same tokens as transformers" if r[f"{key}same_tokens"] else "tokens DIFFER from transformers"
            verdict = ""
            if f"{key}target_met" in r:
                verdict = (f"; target (>= {TARGETS[i]:g}x transformers' tokens/s): "
                           f"{'met' if r[f'{key}target_met'] else 'NOT met'} ({r[f'{key}ratio']:.2f}x)")
            lines.append(f"batch {r['batch']} {i}: {same}{verdict}")
        for impl, (mode, target) in QUANTIZED.items():
            if f"{mode}_speedup" in r:
                verdict = (f"; target (>= {target:g}x): {'met' if r[f'{mode}_target_met'] else 'NOT met'}"
                           if f"{mode}_target_met" in r else "")
                lines.append(f"batch {r['batch']} {impl}: {r[f'{mode}_speedup']:.2f}x pretune's fp32 eager "
                             f"tokens/s{verdict}")
        if "compiled_first_seconds" in r:
            lines.append(f"batch {r['batch']} pretune-compiled: first call (compiling included) "
                         f"{r['compiled_first_seconds']:.1f} s (median)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m pretune.bench.generate [--rounds 3 ...]``; with one JSON argument, the
    worker: run that :class:`Job` and print its result as JSON."""
    from .common import bench_main

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
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS), metavar="IMPL",
                   help=f"implementations to time, of {', '.join(IMPLS)} (default: {', '.join(DEFAULT_IMPLS)})")
    p.add_argument("--quantize", nargs="+", choices=[m for m, _ in QUANTIZED.values()], default=[], metavar="MODE",
                   help="also time pretune.quantize(model, MODE) (int8, int4) against pretune's fp32 eager side "
                        "(targets at batch 1: int8 >= 1.8x, int4 >= 2.5x)")


def run_cli(args) -> int:
    """Run the benchmark from parsed :func:`add_arguments` flags and print the table."""
    from tqdm import tqdm

    rows = bench_generate(model=args.model, batches=tuple(args.batches), rounds=args.rounds,
                          prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats,
                          threads=args.threads, echo=tqdm.write,
                          impls=tuple(dict.fromkeys([*args.impls, *(f"pretune-{m}" for m in args.quantize)])))
    from .common import report

    return report(rows, format_rows(rows), args.json)


if __name__ == "__main__":  # python -m pretune.bench.generate '{"impl": ...}' (worker) or flags (stand-alone)
    sys.exit(main())
