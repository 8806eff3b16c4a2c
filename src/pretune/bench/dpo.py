"""``pretune bench dpo``: a LoRA DPO training step of SmolLM2-135M-Instruct, pretune's dpo task against TRL's
``DPOTrainer`` on the same preference pairs; and how much of pretune's step the reference pass takes.

The pairs (4 by default) are built once by the parent, from the bundled WordNet reverse dictionary, as TRL's
conversational records: the user asks for the word of each of several glosses ("Give the word for each definition,
one per line." and a numbered list), ``chosen`` answers with the right words, ``rejected`` with the same words moved
one line down (every line wrong). Each pair takes as many glosses as fit in ``--seq`` tokens (256), prompt and longer
completion together, rendered with SmolLM2's chat template; every side reads the same JSON records and tokenizes
them its own way, and each reports the tokens it trained on, which must agree. Both sides train LoRA r=8 (alpha 16,
no dropout) on q_proj and v_proj of the same checkpoint with the sigmoid DPO loss at the same beta (0.1); the
reference is the base with the adapter switched off (no second model) on both. One step = the policy's forward on
the 2B chosen and rejected sequences, the reference's forward without gradients, the loss, backward, gradient
clipping at norm 1 and AdamW on the adapter weights (lr 1e-4, constant).

* pretune: ``load_pretrained`` + ``pretune.peft`` LoRA + the dpo task's loss, the reference being
  ``pretune finetune --peft``'s (``AdapterMethod.reference``: the adapter switched off, eval mode);
* pretune-pre: the same with ``task.precompute_reference=true``: the reference's log-probabilities of the pairs
  computed once before the first step (the function ``pretune finetune`` calls, in fp32 as it does; its time
  reported apart), so a step runs no reference pass;
* pretune-ac (not run unless asked for): pretune recomputing each block's activations in the backward
  (``model.checkpoint_blocks()``), the memory-for-time trade TRL makes by default;
* trl (when ``trl`` is installed: ``pip install "pretune[trl]"``): ``DPOTrainer`` on ``AutoModelForCausalLM`` (SDPA)
  with the same ``peft.LoraConfig`` and no ``ref_model`` (so its reference is the adapter disabled, as pretune's),
  ``DPOConfig`` set to the same beta, lengths, learning rate, clipping and precision, its defaults otherwise
  (activation checkpointing on, the metrics it logs every step). Its step time is the time between the trainer's
  consecutive step ends (data collation and callbacks included: what a user of the trainer waits for);
* trl-pre (not run unless asked for): the same with ``precompute_ref_log_probs=True`` (computed in the trainer's
  constructor, untimed).

Precision is set on every side: ``fp32``, or ``bf16`` = fp32 weights under ``torch.autocast(bfloat16)`` (TRL's
``bf16=True``, its default on a CPU; pretune's ``train.precision=bf16`` with the base kept in fp32). Each measurement
runs in its own process, the sides alternate (the order reversed every other round), warmup steps are untimed; the
step time is the median of the timed steps, pairs/s = pairs / step time, peak memory is the process's peak RSS
(model loading included). On the pretune sides, the time spent in the task's reference log-probabilities is measured
inside each timed step: its share of the step (with a precomputed reference, reading them from the batch).
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import dataclass

from .common import add_run_arguments, chosen_impls, spawn_worker

IMPLS = ("pretune", "pretune-pre", "pretune-ac", "trl", "trl-pre")
DEFAULT_IMPLS = ("pretune", "pretune-pre", "trl")
TARGET_SPEED = 1.5  # issue 33: pretune's pairs/s at least this many times TRL's
TARGET_MEMORY = 0.8  # at no more than this share of TRL's peak RSS
# (side, reference, key prefix): the pairs whose ratios are reported. pretune as shipped against TRL as shipped keeps
# the plain names (the target); pretune-ac and TRL both recompute activations; with the reference precomputed
# on both; and what precomputing the reference buys pretune.
COMPARISONS = (("pretune", "trl", ""), ("pretune-ac", "trl", "ac_"), ("pretune-pre", "trl-pre", "pre_"),
               ("pretune-pre", "pretune", "pre_vs_pretune_"))
TARGETED = ("", "ac_", "pre_")  # the comparisons with TRL, held to the target
TARGETS = ("q_proj", "v_proj")
INSTRUCTION = "Give the word for each definition, one per line."
LR = 1e-4


@dataclass
class Job:
    impl: str
    dtype: str = "fp32"
    batch: int = 4
    seq: int = 256
    r: int = 8
    beta: float = 0.1
    steps: int = 5
    warmup: int = 2
    threads: int = 0
    model: str = ""  # a Hugging Face Llama-family folder; "" = SmolLM2-135M-Instruct
    pairs_file: str = ""  # the pairs (JSON list of TRL conversational records), built once by the parent


def model_folder(model: str = ""):
    from pathlib import Path

    from ..io.realmodels import smollm2_dir

    return Path(model) if model else smollm2_dir()


def build_pairs(folder, pairs: int, seq: int) -> list[dict]:
    """``pairs`` TRL conversational records {prompt, chosen, rejected} from WordNet glosses, each with as many
    glosses as fit in ``seq`` tokens (prompt + the longer completion, as pretune's dpo task tokenizes them)."""
    import json

    from .. import bundled
    from ..loading import load_pretrained
    from ..tasks import TaskConfig, build_task
    from ..tasks.base import Record

    loaded = load_pretrained(folder)
    task = build_task(TaskConfig(name="dpo", max_len=seq), loaded.model.config, loaded.tokenizer)
    lines = bundled.path("tasks/wordnet_reverse_dictionary/train.jsonl").read_text(encoding="utf-8").splitlines()
    entries = iter(json.loads(x) for x in lines if x)

    def record(items):
        glosses = "\n".join(f"{i + 1}. {e['source']}" for i, e in enumerate(items))
        words = [e["target"] for e in items]
        wrong = words[-1:] + words[:-1]  # every word moved one line down: each line answers another gloss
        return {"prompt": [{"role": "user", "content": f"{INSTRUCTION}\n{glosses}"}],
                "chosen": [{"role": "assistant", "content": "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words))}],
                "rejected": [{"role": "assistant",
                              "content": "\n".join(f"{i + 1}. {w}" for i, w in enumerate(wrong))}]}

    def length(rec):
        p, c, r = task.pair_ids(Record("bench", rec))
        return len(p) + max(len(c), len(r))

    out = []
    for _ in range(pairs):
        items = [next(entries), next(entries)]  # two glosses at least, so that rejected differs from chosen
        if length(record(items)) > seq:
            raise ValueError(f"--seq {seq}: a pair of two glosses already takes {length(record(items))} tokens; "
                             "give a longer --seq")
        while True:
            e = next(entries)
            if e["target"] in (x["target"] for x in items) or length(record(items + [e])) > seq:
                break
            items.append(e)
        out.append(record(items))
    return out


def run_worker(job: Job) -> dict:
    import json
    from pathlib import Path

    import torch

    if job.threads:
        torch.set_num_threads(job.threads)
    torch.manual_seed(0)
    folder = model_folder(job.model)
    pairs = json.loads(Path(job.pairs_file).read_text(encoding="utf-8"))
    if job.impl.startswith("trl"):
        return _trl_worker(job, folder, pairs)
    return _pretune_worker(job, folder, pairs)


def _pretune_worker(job: Job, folder, pairs: list[dict]) -> dict:
    import torch

    from .. import peft
    from ..jobs.finetune.methods import AdapterMethod
    from ..jobs.finetune.reference import _compute as precompute
    from ..loading import load_pretrained
    from ..tasks import TaskConfig, build_task
    from ..tasks.base import Record

    loaded = load_pretrained(folder)
    model = loaded.model.checkpoint_blocks(job.impl == "pretune-ac")
    lora = peft.PeftConfig(method="lora", r=job.r, alpha=2 * job.r, dropout=0.0, targets=list(TARGETS),
                           base_dtype="fp32")
    peft.inject(model, lora)
    task = build_task(TaskConfig(name="dpo", max_len=job.seq, beta=job.beta,
                                 precompute_reference=job.impl == "pretune-pre"), model.config, loaded.tokenizer)
    task.reference_model = AdapterMethod(lora).reference(model)  # what pretune finetune --peft lora gives the task
    feats = [task.encode(Record(f"pairs.json:{i + 1}", p))[0] for i, p in enumerate(pairs)]

    def autocast():  # train.precision=bf16: fp32 weights, bf16 matmuls
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=job.dtype == "bf16")

    precompute_s = None
    if task.cfg.precompute_reference:  # as pretune finetune does before its first step (jobs/finetune/reference.py:
        t0 = time.perf_counter()  # in fp32 whatever train.precision, with batches of 2 x train.batch_size examples)
        refs = precompute(task, model, feats, batch_size=2 * len(feats), show_progress=False)
        precompute_s = time.perf_counter() - t0
        for f, ref in zip(feats, refs.numpy()):
            f["ref_logps"] = ref
    batch = task.collate(feats)
    totals = {k: float(v) for k, v in task.counts(batch).items()}

    ref_s: list[float] = []
    reference_logps = task.reference_logps

    def timed_reference(model, batch):  # the reference's share of the step, measured inside it
        t0 = time.perf_counter()
        out = reference_logps(model, batch)
        ref_s.append(time.perf_counter() - t0)
        return out

    task.reference_logps = timed_reference
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    times, losses = [], []
    for i in range(job.warmup + job.steps):
        t0 = time.perf_counter()
        with autocast():
            loss, _ = task.loss(model, batch, totals)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # train.clip's default, TRL's max_grad_norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= job.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    step = statistics.median(times)
    timed_ref = ref_s[job.warmup:]
    return {"step_s": step, "pairs_per_s": len(pairs) / step, "first_loss": losses[0],
            "tokens": int(batch["attention_mask"].sum()), "sequences": int(batch["input_ids"].shape[0]),
            "trainable": sum(p.numel() for p in params), "ref_fraction": sum(timed_ref) / sum(times),
            "precompute_s": precompute_s, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "threads": torch.get_num_threads()}


def _trl_worker(job: Job, folder, pairs: list[dict]) -> dict:
    """TRL's ``DPOTrainer`` for ``warmup + steps`` optimizer steps over the same pairs (every step the whole set, as
    on the other sides); the step times are the gaps between the trainer's step ends."""
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

    class Trainer(trl.DPOTrainer):
        def compute_loss(self, *args, **kwargs):
            out = super().compute_loss(*args, **kwargs)
            if self.model.training:
                losses.append(float((out[0] if isinstance(out, tuple) else out).detach()))
            return out

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with tempfile.TemporaryDirectory(prefix="pretune-bench-trl-") as out:
        args = trl.DPOConfig(
            output_dir=out, per_device_train_batch_size=len(pairs), max_steps=job.warmup + job.steps,
            learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, beta=job.beta, loss_type=["sigmoid"],
            max_length=job.seq, precompute_ref_log_probs=job.impl == "trl-pre", bf16=job.dtype == "bf16", fp16=False,
            use_cpu=True, save_strategy="no", report_to=[], logging_steps=10**6, disable_tqdm=True,
            dataloader_num_workers=0, dataset_num_proc=None, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs),
                          processing_class=tokenizer, callbacks=[StepEnds()],
                          peft_config=hf_peft.LoraConfig(r=job.r, lora_alpha=2 * job.r, lora_dropout=0.0,
                                                         target_modules=list(TARGETS), task_type="CAUSAL_LM"))
        rows = trainer.train_dataset
        tokens = sum(2 * len(x["prompt_ids"]) + len(x["chosen_ids"]) + len(x["rejected_ids"]) for x in rows)
        trainer.train()
    gaps = [b - a for a, b in zip(ends, ends[1:])][job.warmup:]
    step = statistics.median(gaps)
    return {"step_s": step, "pairs_per_s": len(pairs) / step, "first_loss": losses[0], "tokens": tokens,
            "sequences": 2 * len(rows),
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "gradient_checkpointing": bool(args.gradient_checkpointing),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "threads": torch.get_num_threads(), "trl_version": trl.__version__}


def bench_dpo(*, dtypes=("fp32",), rounds: int = 3, impls=DEFAULT_IMPLS, **job_kw) -> list[dict]:
    """Time every side of ``impls`` for ``rounds`` alternating rounds per precision of ``dtypes``; one row per
    precision with each side's median pairs/s, its runs, peak RSS, first loss, tokens and (pretune sides) the
    reference's share of the step, and the ratios of :data:`COMPARISONS`. ``job_kw``: the fields of :class:`Job`."""
    import json
    import tempfile
    from pathlib import Path

    from ..io.progress import progress

    impls = tuple(impls)
    if rounds < 1 or job_kw.get("steps", 1) < 1 or job_kw.get("warmup", 0) < 0:
        raise ValueError(f"rounds ({rounds}) and steps ({job_kw.get('steps')}) must be >= 1, warmup "
                         f"({job_kw.get('warmup')}) >= 0")
    samples: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pretune-bench-dpo-") as tmp:
        pairs = build_pairs(model_folder(job_kw.get("model", "")), job_kw.get("batch", 4), job_kw.get("seq", 256))
        pairs_file = Path(tmp) / "pairs.json"
        pairs_file.write_text(json.dumps(pairs), encoding="utf-8")
        plan = []
        for r in range(rounds):
            for dt in dtypes:
                order = impls if r % 2 == 0 else tuple(reversed(impls))
                plan += [Job(impl, dt, pairs_file=str(pairs_file), **job_kw) for impl in order]
        for job in progress(plan, desc="bench dpo", unit="run"):
            samples.setdefault((job.dtype, job.impl), []).append(spawn_worker(job, "pretune.bench.dpo"))
    rows = []
    for dt in dtypes:
        row = {"bench": "dpo", "dtype": dt, "impls": list(impls), "rounds": rounds, **job_kw}
        for impl in impls:
            runs = samples[(dt, impl)]
            row[f"{impl}_pairs_per_s"] = statistics.median(x["pairs_per_s"] for x in runs)
            row[f"{impl}_runs"] = [round(x["pairs_per_s"], 3) for x in runs]
            row[f"{impl}_peak_rss_mb"] = max(x["peak_rss_mb"] for x in runs)
            row[f"{impl}_first_loss"] = runs[0]["first_loss"]
            row[f"{impl}_tokens"] = runs[0]["tokens"]
            row[f"{impl}_trainable"] = runs[0]["trainable"]
            if "ref_fraction" in runs[0]:
                row[f"{impl}_ref_fraction"] = statistics.median(x["ref_fraction"] for x in runs)
            if "gradient_checkpointing" in runs[0]:
                row[f"{impl}_gradient_checkpointing"] = runs[0]["gradient_checkpointing"]
            if runs[0].get("precompute_s") is not None:
                row[f"{impl}_precompute_s"] = statistics.median(x["precompute_s"] for x in runs)
        row["sequences"] = samples[(dt, impls[0])][0]["sequences"]
        row["same_tokens"] = len({row[f"{impl}_tokens"] for impl in impls}) == 1
        for side, ref, pre in COMPARISONS:
            if side in impls and ref in impls:
                speed = row[f"{side}_pairs_per_s"] / row[f"{ref}_pairs_per_s"]
                memory = row[f"{side}_peak_rss_mb"] / row[f"{ref}_peak_rss_mb"]
                row.update({f"{pre}speed_ratio": speed, f"{pre}memory_ratio": memory})
                if pre in TARGETED:
                    row[f"{pre}target_met"] = bool(speed >= TARGET_SPEED and memory <= TARGET_MEMORY)
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        impls = r["impls"]
        tokens = r[f"{impls[0]}_tokens"]
        lines.append(f"{r['dtype']}: LoRA DPO step (r={r.get('r', 8)}, {', '.join(TARGETS)}; sigmoid, beta "
                     f"{r.get('beta', 0.1):g}), {r['batch']} pairs = {r['sequences']} sequences of <= {r['seq']} "
                     f"tokens ({tokens} tokens, {tokens / r['sequences']:.0f} a sequence), {r['rounds']} "
                     f"round{'s' if r['rounds'] != 1 else ''}")
        head = f"  {'side':<13}{'pairs/s':>9}{'peak MB':>9}{'first loss':>12}{'reference':>11}  rounds"
        lines += [head, "  " + "-" * (len(head) + 20)]
        for impl in impls:
            frac = r.get(f"{impl}_ref_fraction")
            lines.append(f"  {impl:<13}{r[f'{impl}_pairs_per_s']:>9.3f}{r[f'{impl}_peak_rss_mb']:>9.0f}"
                         f"{r[f'{impl}_first_loss']:>12.4f}{'-' if frac is None else f'{frac:.1%}':>11}"
                         f"  {r[f'{impl}_runs']}")
        if not r.get("same_tokens", True):
            lines.append("  WARNING: the sides trained on different numbers of tokens: "
                         + ", ".join(f"{i} {r[f'{i}_tokens']}" for i in impls))
        for side, ref, pre in COMPARISONS:
            if f"{pre}speed_ratio" in r:
                line = (f"  {side} vs {ref}: {r[f'{pre}speed_ratio']:.2f}x pairs/s at "
                        f"{r[f'{pre}memory_ratio']:.2f}x peak memory")
                if pre in TARGETED:
                    line += (f" (target >= {TARGET_SPEED:g}x at <= {TARGET_MEMORY:g}x: "
                             f"{'met' if r[f'{pre}target_met'] else 'NOT met'})")
                lines.append(line)
        for impl in impls:
            if f"{impl}_ref_fraction" in r:
                what = ("reading the precomputed log-probabilities" if f"{impl}_precompute_s" in r
                        else "the reference pass (adapter off, no gradients)")
                lines.append(f"  {impl}: {r[f'{impl}_ref_fraction']:.1%} of the step in {what}")
            if f"{impl}_gradient_checkpointing" in r:
                on = "on" if r[f"{impl}_gradient_checkpointing"] else "off"
                lines.append(f"  {impl}: activation checkpointing {on} (DPOConfig's default)")
            if f"{impl}_precompute_s" in r:
                lines.append(f"  {impl}: the reference precomputed once in {r[f'{impl}_precompute_s']:.2f} s for "
                             f"{r['batch']} pairs (fp32, as pretune finetune does), before the first step (untimed)")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                   help="set on every side (default fp32; TRL's own default on a CPU is bf16); bf16 = fp32 weights "
                        "under torch.autocast(bfloat16), slow without native bf16; both: --precision fp32 bf16")
    add_run_arguments(p)
    p.add_argument("--batch", type=int, default=4, help="preference pairs per step (default 4)")
    p.add_argument("--seq", type=int, default=256,
                   help="tokens of a pair's prompt and longer completion, at most (default 256)")
    p.add_argument("--r", type=int, default=8, help="LoRA rank, alpha = 2r (default 8)")
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta on every side (default 0.1, TRL's)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run, median taken (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--model", default="", metavar="DIR",
                   help="a Hugging Face Llama-family folder both sides load (default: SmolLM2-135M-Instruct)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, metavar="IMPL",
                   help=f"sides to time, of {', '.join(IMPLS)} (default: {', '.join(DEFAULT_IMPLS)}, TRL's only "
                        "when it is installed: pip install 'pretune[trl]'). pretune-pre: task.precompute_reference="
                        "true; pretune-ac: pretune recomputing activations, as TRL does by default; trl-pre: "
                        "DPOConfig(precompute_ref_log_probs=True)")


def run_cli(args) -> int:
    impls = chosen_impls(args.impls, DEFAULT_IMPLS, bench="dpo", trainer="DPOTrainer")
    if impls is None:
        return 2
    rows = bench_dpo(dtypes=tuple(args.precision), rounds=args.rounds, impls=impls, batch=args.batch, seq=args.seq,
                     r=args.r, beta=args.beta, steps=args.steps, warmup=args.warmup, threads=args.threads,
                     model=args.model)
    from .common import report

    return report(rows, format_rows(rows), args.json)


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main(argv, prog="pretune bench dpo", doc=__doc__, job_cls=Job, run_worker=run_worker,
                      add_arguments=add_arguments, run_cli=run_cli)


if __name__ == "__main__":  # python -m pretune.bench.dpo '{"impl": ...}' (worker) or flags (stand-alone)
    sys.exit(main())
