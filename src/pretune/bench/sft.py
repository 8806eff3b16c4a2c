"""``pretune bench sft``: a LoRA SFT training step of SmolLM2-135M-Instruct, pretune against transformers + peft on
identical token ids and labels; and how fast the SFT task scores test examples by generation.

The batch (8 rows x 256 tokens by default) is built once, the same way for every side: sms_spam messages as a
multi-turn chat ("Is this SMS message spam? Answer ham or spam." / "ham"), rendered with SmolLM2's chat template by
pretune's SFT task, labels on the assistant turns only (-100 elsewhere: about 1 token in 12 is a target), each
row cut at 256 tokens. Both sides train LoRA r=8 (alpha 16, no dropout) on q_proj and v_proj of the same
checkpoint, AdamW on the adapter weights; one step = forward, loss, backward, optimizer step.

* pretune: ``load_pretrained`` + ``pretune.peft`` LoRA; the loss is the SFT task's (the LM head runs only on the
  labelled rows, fused with the cross-entropy);
* peft: ``AutoModelForCausalLM`` (SDPA) + ``peft.get_peft_model``; ``model(input_ids, attention_mask,
  labels).loss`` and ``torch.optim.AdamW``, the loop a transformers user writes;
* trl (when ``trl`` is installed: ``pip install "pretune[trl]"``): TRL's ``SFTTrainer`` on the same model, LoRA
  config and rows (a pre-tokenised dataset of ``input_ids`` and ``labels``, so TRL tokenises nothing and masks
  nothing itself), with its defaults otherwise: its chunked LM head (per-token log-probabilities without the full
  logits), the entropy and token-accuracy metrics it computes every step, ``Trainer``'s AdamW and gradient
  clipping, and its activation checkpointing (``gradient_checkpointing=True`` is ``SFTConfig``'s default). Its
  step time is the time between the trainer's consecutive step ends (data loading and callbacks included: what a
  user of the trainer waits for);
* pretune-ac: pretune with activation checkpointing of every block (``train.activation_checkpointing=blocks``,
  ``model.checkpoint_blocks()``), the memory-for-time trade TRL makes by default: it is compared with TRL like
  for like, as the plain pretune side is with peft (neither of which recomputes).

Each measurement runs in its own process, the sides alternate (the order reversed every other round); the step
time is the median of the timed steps, tokens/s = batch x seq / step time, peak memory is the process's peak RSS.
``--eval N`` also times the evaluation of N sms_spam test records by the SFT task (batched greedy generation
through ``generate()`` with the KV cache, stopping at the end of turn) in its own process.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import dataclass

from .common import add_run_arguments, chosen_impls, spawn_worker, without_missing_trl

IMPLS = ("pretune", "pretune-ac", "peft", "trl")
TARGET_SPEED = 1.5  # pretune tokens/s at least this many times peft's
TARGET_MEMORY = 0.8  # at no more than this share of peft's peak RSS
# (pretune side, reference, key prefix): the pairs whose ratios are reported. Each pair makes the same
# memory-for-time choice: pretune and peft keep every activation, pretune-ac and TRL (by its default) recompute
# them block by block; pretune (as shipped) against TRL (as shipped) is reported too.
COMPARISONS = (("pretune", "peft", ""), ("pretune", "trl", "trl_"), ("pretune-ac", "trl", "trl_ac_"))
PROMPT = "Is this SMS message spam? Answer ham or spam.\n\n{text}"


@dataclass
class Job:
    impl: str
    dtype: str = "fp32"
    batch: int = 8
    seq: int = 256
    r: int = 8
    steps: int = 5
    warmup: int = 2
    threads: int = 0
    eval_records: int = 0  # impl "eval": score this many test records
    batch_file: str = ""  # the batch (.npz of input_ids, attention_mask, labels), built once by the parent


def build_batch(folder, batch: int, seq: int) -> dict:
    """(input_ids, attention_mask, labels) numpy arrays of ``batch`` rows of ``seq`` tokens: each row one chat of
    as many sms_spam exchanges as fit, labels on the assistant turns."""
    import json

    import numpy as np

    from .. import bundled
    from ..loading import load_pretrained
    from ..tasks import TaskConfig, build_task
    from ..tasks.base import Record

    loaded = load_pretrained(folder)
    task = build_task(TaskConfig(name="sft", max_len=seq + 64), loaded.model.config, loaded.tokenizer)
    lines = bundled.path("tasks/sms_spam/train.jsonl").read_text(encoding="utf-8").splitlines()
    recs = iter(json.loads(x) for x in lines if x)
    rows = []
    while len(rows) < batch:
        msgs: list[dict] = []
        ids = None
        while ids is None or len(ids) < seq:
            r = next(recs)
            msgs += [{"role": "user", "content": PROMPT.format(text=r["text"])},
                     {"role": "assistant", "content": r["label"]}]
            feat = task.encode(Record(f"train.jsonl:{len(rows)}", {"messages": msgs}))[0]
            ids, labels = feat["input_ids"], feat["labels"]
        rows.append((ids[:seq], labels[:seq]))
    input_ids = np.stack([r[0] for r in rows])
    return {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids),
            "labels": np.stack([r[1] for r in rows])}


def _train_step_fn(job: Job, folder, batch):
    import torch

    if job.impl.startswith("pretune"):
        from .. import peft
        from ..loading import load_pretrained
        from ..tasks import TaskConfig, build_task

        loaded = load_pretrained(folder)
        model = loaded.model.checkpoint_blocks(job.impl == "pretune-ac")
        peft.inject(model, peft.PeftConfig(method="lora", r=job.r, alpha=2 * job.r, dropout=0.0,
                                           targets=["q_proj", "v_proj"]))
        task = build_task(TaskConfig(name="sft", max_len=job.seq), model.config, loaded.tokenizer)
        b = {k: torch.from_numpy(v) for k, v in batch.items()}
        n = task.counts(b)

        def loss_fn():
            return task.loss(model, b, n)[0]
    else:
        import transformers

        import peft as hf_peft

        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
        model = hf_peft.get_peft_model(model, hf_peft.LoraConfig(r=job.r, lora_alpha=2 * job.r, lora_dropout=0.0,
                                                                 target_modules=["q_proj", "v_proj"]))
        b = {k: torch.from_numpy(v) for k, v in batch.items()}

        def loss_fn():
            return model(**b).loss
    model.train()
    return model, loss_fn


def run_worker(job: Job) -> dict:
    import torch

    from ..io.realmodels import smollm2_dir

    if job.threads:
        torch.set_num_threads(job.threads)
    torch.manual_seed(0)
    folder = smollm2_dir()
    if job.impl == "eval":
        return _eval_worker(job, folder)
    import numpy as np

    with np.load(job.batch_file) as f:
        batch = {k: f[k] for k in ("input_ids", "attention_mask", "labels")}
    if job.impl == "trl":
        return _trl_worker(job, folder, batch)
    model, loss_fn = _train_step_fn(job, folder, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    times, losses = [], []
    for i in range(job.warmup + job.steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=job.dtype == "bf16"):
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= job.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    step = statistics.median(times)
    return {"step_s": step, "tokens_per_s": job.batch * job.seq / step, "first_loss": losses[0],
            "targets": int((batch["labels"][:, 1:] != -100).sum()), "trainable": sum(p.numel() for p in params),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "threads": torch.get_num_threads()}


def _trl_worker(job: Job, folder, batch: dict) -> dict:
    """TRL's ``SFTTrainer`` for ``warmup + steps`` optimizer steps over the same rows (every step the same batch,
    as on the other sides); the step times are the gaps between the trainer's step ends."""
    import tempfile

    import datasets
    import torch
    import transformers
    import trl

    import peft as hf_peft

    ends: list[float] = []
    losses: list[float] = []

    class StepEnds(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    class Trainer(trl.SFTTrainer):
        def compute_loss(self, *args, **kwargs):
            out = super().compute_loss(*args, **kwargs)
            if self.model.training:
                losses.append(float((out[0] if isinstance(out, tuple) else out).detach()))
            return out

    rows = datasets.Dataset.from_dict({"input_ids": batch["input_ids"].tolist(), "labels": batch["labels"].tolist()})
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with tempfile.TemporaryDirectory(prefix="pretune-bench-trl-") as out:
        args = trl.SFTConfig(
            output_dir=out, per_device_train_batch_size=job.batch, max_steps=job.warmup + job.steps,
            learning_rate=1e-4, lr_scheduler_type="constant", max_length=job.seq, packing=False,
            bf16=job.dtype == "bf16", use_cpu=True, save_strategy="no", report_to=[], logging_steps=10**6,
            disable_tqdm=True, dataloader_num_workers=0, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                          peft_config=hf_peft.LoraConfig(r=job.r, lora_alpha=2 * job.r, lora_dropout=0.0,
                                                         target_modules=["q_proj", "v_proj"]),
                          callbacks=[StepEnds()])
        trainer.train()
    gaps = [b - a for a, b in zip(ends, ends[1:])][job.warmup:]
    step = statistics.median(gaps)
    return {"step_s": step, "tokens_per_s": job.batch * job.seq / step, "first_loss": losses[0],
            "targets": int((batch["labels"][:, 1:] != -100).sum()),
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "threads": torch.get_num_threads(), "trl_version": trl.__version__,
            "optimizer": getattr(trainer.args.optim, "value", trainer.args.optim)}


def _eval_worker(job: Job, folder) -> dict:
    import json

    from .. import bundled
    from ..loading import load_pretrained
    from ..tasks import TaskConfig, build_task
    from ..tasks.base import Record
    from ..tasks.run import evaluate_task

    loaded = load_pretrained(folder)
    task = build_task(TaskConfig(name="sft", chat=True, prompt_template=PROMPT, completion_field="label",
                                 max_len=192, max_target_len=4), loaded.model.config, loaded.tokenizer)
    lines = bundled.path("tasks/sms_spam/test.jsonl").read_text(encoding="utf-8").splitlines()
    recs = [Record(f"test.jsonl:{i + 1}", json.loads(x)) for i, x in enumerate(lines[: job.eval_records])]
    t0 = time.perf_counter()
    metrics, _ = evaluate_task(task, loaded.model, recs, batch_size=16, precision=job.dtype)
    seconds = time.perf_counter() - t0
    return {"eval_s": seconds, "records_per_s": len(recs) / seconds, "accuracy": metrics.get("accuracy"),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def available_impls(impls=IMPLS) -> tuple[str, ...]:
    """``impls`` less TRL when it is not installed."""
    return without_missing_trl(impls)


def bench_sft(*, dtypes=("fp32", "bf16"), rounds: int = 3, eval_records: int = 0, impls=IMPLS,
              **job_kw) -> list[dict]:
    import tempfile
    from pathlib import Path

    import numpy as np

    from ..io.progress import progress
    from ..io.realmodels import smollm2_dir

    impls = tuple(impls)
    samples: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pretune-bench-sft-") as tmp:
        batch_file = str(Path(tmp) / "batch.npz")
        np.savez(batch_file, **build_batch(smollm2_dir(), job_kw.get("batch", 8), job_kw.get("seq", 256)))
        plan = []
        for r in range(rounds):
            for dt in dtypes:
                order = impls if r % 2 == 0 else tuple(reversed(impls))
                plan += [Job(impl, dt, batch_file=batch_file, **job_kw) for impl in order]
        if eval_records:
            plan += [Job("eval", dt, eval_records=eval_records, threads=job_kw.get("threads", 0)) for dt in dtypes]
        for job in progress(plan, desc="bench sft", unit="run"):
            samples.setdefault((job.dtype, job.impl), []).append(spawn_worker(job, "pretune.bench.sft"))
    rows = []
    for dt in dtypes:
        row = {"bench": "sft", "dtype": dt, "impls": list(impls), **job_kw}
        for impl in impls:
            runs = samples[(dt, impl)]
            row[f"{impl}_tokens_per_s"] = statistics.median(x["tokens_per_s"] for x in runs)
            row[f"{impl}_runs"] = [round(x["tokens_per_s"], 1) for x in runs]
            row[f"{impl}_peak_rss_mb"] = max(x["peak_rss_mb"] for x in runs)
            row[f"{impl}_first_loss"] = runs[0]["first_loss"]
            row[f"{impl}_trainable"] = runs[0]["trainable"]
        row["targets"] = samples[(dt, impls[0])][0]["targets"]
        for side, ref, pre in COMPARISONS:  # the reference (peft) keeps the plain names
            if side in impls and ref in impls:
                speed = row[f"{side}_tokens_per_s"] / row[f"{ref}_tokens_per_s"]
                memory = row[f"{side}_peak_rss_mb"] / row[f"{ref}_peak_rss_mb"]
                row.update({f"{pre}speed_ratio": speed, f"{pre}memory_ratio": memory,
                            f"{pre}target_met": bool(speed >= TARGET_SPEED and memory <= TARGET_MEMORY)})
        if (dt, "eval") in samples:
            e = samples[(dt, "eval")][0]
            row.update(eval_records=eval_records, eval_s=e["eval_s"], eval_records_per_s=e["records_per_s"],
                       eval_accuracy=e["accuracy"])
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        impls = r.get("impls", ("pretune", "peft"))  # rows written before TRL was a side
        lines.append(f"{r['dtype']}: LoRA SFT step, SmolLM2-135M, batch {r['batch']} x {r['seq']} "
                     f"({r['targets']} labelled targets)")
        head = f"  {'side':<11}{'tokens/s':>10}{'peak MB':>9}{'first loss':>12}  rounds"
        lines += [head, "  " + "-" * (len(head) + 20)]
        for impl in impls:
            lines.append(f"  {impl:<11}{r[f'{impl}_tokens_per_s']:>10.0f}{r[f'{impl}_peak_rss_mb']:>9.0f}"
                         f"{r[f'{impl}_first_loss']:>12.4f}  {r[f'{impl}_runs']}")
        for side, ref, pre in COMPARISONS:
            if f"{pre}speed_ratio" in r:
                lines.append(f"  {side} vs {ref}: {r[f'{pre}speed_ratio']:.2f}x tokens/s at "
                             f"{r[f'{pre}memory_ratio']:.2f}x peak memory (target >= {TARGET_SPEED:g}x at <= "
                             f"{TARGET_MEMORY:g}x: {'met' if r[f'{pre}target_met'] else 'NOT met'})")
        if "eval_s" in r:
            lines.append(f"  evaluation: {r['eval_records']} test records in {r['eval_s']:.1f} s "
                         f"({r['eval_records_per_s']:.2f} records/s), zero-shot accuracy {r['eval_accuracy']:.4f}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                   help="bf16 = fp32 weights under torch.autocast(bfloat16); slow without native bf16")
    add_run_arguments(p)
    p.add_argument("--batch", type=int, default=8, help="(default 8)")
    p.add_argument("--seq", type=int, default=256, help="(default 256)")
    p.add_argument("--r", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--eval", type=int, default=100, metavar="N",
                   help="also time scoring N sms_spam test records by generation (default 100; 0: skip)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, metavar="IMPL",
                   help=f"sides to time (default: {', '.join(IMPLS)}; trl only when it is installed: "
                        "pip install 'pretune[trl]'; pretune-ac is pretune with activation checkpointing, as TRL "
                        "does by default)")


def run_cli(args) -> int:
    impls = chosen_impls(args.impls, IMPLS, bench="sft", trainer="SFTTrainer")
    if impls is None:
        return 2
    rows = bench_sft(dtypes=tuple(args.dtypes), rounds=args.rounds, eval_records=args.eval, impls=impls,
                     batch=args.batch, seq=args.seq, r=args.r, steps=args.steps, warmup=args.warmup,
                     threads=args.threads)
    from .common import report

    return report(rows, format_rows(rows), args.json)


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main(argv, prog="pretune bench sft", doc=__doc__, job_cls=Job, run_worker=run_worker,
                      add_arguments=add_arguments, run_cli=run_cli)


if __name__ == "__main__":  # python -m pretune.bench.sft '{"impl": ...}' (worker) or flags (stand-alone)
    sys.exit(main())
