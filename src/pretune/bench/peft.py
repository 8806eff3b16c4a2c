"""``pretune bench peft``: LoRA finetuning step time and peak memory, against full finetuning and
against ``peft`` + transformers on the same model and data.

Four implementations, each measurement in its own Python process, alternating, several rounds (the
pattern of :mod:`pretune.bench.model`):

* pretune-full: every weight of ``build_model("gpt2", 6 layers, dim 512, ...)`` trains;
* pretune-lora: ``pretune.peft`` LoRA r=8 on the attention q, k and v projections, the rest frozen;
* hf-full: ``transformers.GPT2LMHeadModel`` of the same shape (SDPA attention), every weight trains;
* peft-lora: the same HF model with ``peft`` LoRA r=8 on ``c_attn`` (its fused q, k, v projection).

One step = forward, causal-LM loss, backward, AdamW step and zeroing of the gradients, on a fixed
batch of random token ids (batch 8 x 256 tokens by default); bf16 = fp32 weights under
``torch.autocast("cpu", bfloat16)``. The step time is the median of the timed steps; peak memory is
the process's peak resident set size (model, optimizer state, activations).
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import dataclass

from .common import add_run_arguments, spawn_worker

IMPLS = ("pretune-full", "pretune-lora", "hf-full", "peft-lora")
SHAPE = dict(n_layers=6, dim=512, n_heads=8, ffn_dim=2048, vocab_size=8192)
TARGET = 1.15  # ours (LoRA) at least this many times faster per step than peft's LoRA


@dataclass
class Job:
    impl: str
    dtype: str = "fp32"
    batch: int = 8
    seq: int = 256
    r: int = 8
    steps: int = 10
    warmup: int = 3
    threads: int = 0
    dropout: float = 0.1


def _build(job: Job):
    import torch

    max_len = max(512, job.seq)
    if job.impl.startswith("pretune"):
        from ..model import build_model

        model = build_model("gpt2", **SHAPE, max_seq_len=max_len, dropout=job.dropout, attn_dropout=job.dropout)
        if job.impl == "pretune-lora":
            from .. import peft

            peft.inject(model, peft.PeftConfig(method="lora", r=job.r, alpha=2 * job.r,
                                               targets=["q_proj", "k_proj", "v_proj"]))
    else:
        import transformers as T

        cfg = T.GPT2Config(vocab_size=SHAPE["vocab_size"], n_embd=SHAPE["dim"], n_layer=SHAPE["n_layers"],
                           n_head=SHAPE["n_heads"], n_inner=SHAPE["ffn_dim"], n_positions=max_len,
                           resid_pdrop=job.dropout, embd_pdrop=job.dropout, attn_pdrop=job.dropout)
        cfg._attn_implementation = "sdpa"
        model = T.GPT2LMHeadModel(cfg)
        if job.impl == "peft-lora":
            import peft as hf_peft

            model = hf_peft.get_peft_model(model, hf_peft.LoraConfig(
                r=job.r, lora_alpha=2 * job.r, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0))
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE["vocab_size"], (job.batch, job.seq), generator=g)
    return model, ids


def run_worker(job: Job) -> dict:
    import torch

    if job.threads:
        torch.set_num_threads(job.threads)
    torch.manual_seed(0)
    model, ids = _build(job)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    if job.impl.startswith("pretune"):
        from ..objectives import causal_lm_loss

        def loss_fn():
            return causal_lm_loss(model, ids)
    else:
        def loss_fn():
            return model(input_ids=ids, labels=ids).loss
    times = []
    for i in range(job.warmup + job.steps):
        t0 = time.perf_counter()
        if job.dtype == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn()
        else:
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= job.warmup:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "loss": float(loss.detach()),
            "trainable": sum(p.numel() for p in params),
            "total": sum(p.numel() for p in model.parameters()),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "threads": torch.get_num_threads()}


def bench_peft(*, dtypes=("fp32", "bf16"), rounds: int = 3, impls=IMPLS, echo=print, **job_kw) -> list[dict]:
    """Alternate the implementations (the order reversed every other round), one process each."""
    from ..io.progress import progress

    plan = []
    for r in range(rounds):
        for dt in dtypes:
            order = impls if r % 2 == 0 else tuple(reversed(impls))
            plan += [Job(impl, dt, **job_kw) for impl in order]
    samples: dict[tuple, list[dict]] = {}
    for job in progress(plan, desc="bench peft", unit="run"):
        samples.setdefault((job.dtype, job.impl), []).append(spawn_worker(job, "pretune.bench.peft"))
    rows = []
    for dt in dtypes:
        row = {"bench": "peft", "dtype": dt, **job_kw}
        for impl in impls:
            runs = samples[(dt, impl)]
            row[f"{impl}_step_s"] = statistics.median(x["step_s"] for x in runs)
            row[f"{impl}_runs"] = [round(x["step_s"], 4) for x in runs]
            row[f"{impl}_peak_rss_mb"] = max(x["peak_rss_mb"] for x in runs)
            row[f"{impl}_trainable"] = runs[0]["trainable"]
            row[f"{impl}_total"] = runs[0]["total"]
        if set(impls) == set(IMPLS):
            row["pretune_lora_speedup"] = row["pretune-full_step_s"] / row["pretune-lora_step_s"]
            row["peft_lora_speedup"] = row["hf-full_step_s"] / row["peft-lora_step_s"]
            row["lora_ratio"] = row["peft-lora_step_s"] / row["pretune-lora_step_s"]
            row["target_met"] = bool(row["lora_ratio"] >= TARGET)
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines.append(f"{r['dtype']}: step time (median of rounds) and peak RSS")
        head = f"  {'implementation':<14}{'step s':>9}{'peak MB':>9}{'trainable':>12}  rounds"
        lines += [head, "  " + "-" * (len(head) + 20)]
        for impl in IMPLS:
            if f"{impl}_step_s" in r:
                lines.append(f"  {impl:<14}{r[f'{impl}_step_s']:>9.3f}{r[f'{impl}_peak_rss_mb']:>9.0f}"
                             f"{r[f'{impl}_trainable']:>12,}  {r[f'{impl}_runs']}")
        if "lora_ratio" in r:
            lines.append(f"  LoRA vs full: pretune {r['pretune_lora_speedup']:.2f}x, peft {r['peft_lora_speedup']:.2f}x"
                         f" | pretune LoRA vs peft LoRA: {r['lora_ratio']:.2f}x (target >= {TARGET:g}x: "
                         f"{'met' if r['target_met'] else 'NOT met'})")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    add_run_arguments(p)
    p.add_argument("--batch", type=int, default=8, help="(default 8)")
    p.add_argument("--seq", type=int, default=256, help="(default 256)")
    p.add_argument("--r", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")


def run_cli(args) -> int:
    from tqdm import tqdm

    rows = bench_peft(dtypes=tuple(args.dtypes), rounds=args.rounds, echo=tqdm.write, batch=args.batch,
                      seq=args.seq, r=args.r, steps=args.steps, warmup=args.warmup, threads=args.threads)
    from .common import report

    return report(rows, format_rows(rows), args.json)


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main(argv, prog="pretune bench peft", doc=__doc__, job_cls=Job, run_worker=run_worker,
                      add_arguments=add_arguments, run_cli=run_cli)


if __name__ == "__main__":  # python -m pretune.bench.peft '{"impl": ...}' (worker) or flags (stand-alone)
    sys.exit(main())
