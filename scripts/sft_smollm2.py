"""LoRA SFT of the real SmolLM2-135M-Instruct on sms_spam phrased as an instruction: zero-shot against finetuned,
over seeds (the figures of BENCHMARKS.md, "Instruction finetuning (SFT) of SmolLM2").

    .venv/bin/python scripts/sft_smollm2.py --out runs/sft-smollm2                 # seeds 0 1 2
    .venv/bin/python scripts/sft_smollm2.py --out runs/x --seeds 0 --train 300 --epochs 1

Each record becomes a chat: the user asks "Is this SMS message spam? Answer ham or spam." followed by the message,
the assistant answers the label (``task.chat=true``, ``task.prompt_template``, ``task.completion_field=label``); the
loss falls on the answer and its end-of-turn token. Reported: the zero-shot dev/test metrics of the base model with
the same prompts (generation through the same task; also read leniently: 16 tokens, the label word anywhere in
the answer), the loss transformers computes on the training set (per
token) against pretune's first logged step, and per seed the dev/test metrics after training and the wall time.
Writes <out>/results.json and prints a markdown table. Not a timed benchmark.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

PROMPT = "Is this SMS message spam? Answer ham or spam.\n\n{text}"


def split_files(out: Path, n_train: int, n_dev: int, n_test: int) -> dict[str, Path]:
    from pretune import bundled

    files = {}
    for split, n in (("train", n_train), ("dev", n_dev), ("test", n_test)):
        lines = bundled.path(f"tasks/sms_spam/{split}.jsonl").read_text(encoding="utf-8").splitlines()[:n]
        files[split] = out / f"{split}.jsonl"
        files[split].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return files


def overrides(files: dict[str, Path], **kw) -> list[str]:
    return [f"task.prompt_template={PROMPT}", "task.completion_field=label", "task.chat=true",
            "task.max_target_len=4", "task.max_len=192", "task.metric=macro_f1", "task.name=sft",
            f"data.train={files['train']}", f"data.dev={files['dev']}", f"data.test={files['test']}",
            *[f"{k}={v}" for k, v in kw.items()]]


def zero_shot(folder: Path, files: dict[str, Path]) -> dict:
    """The base model's dev and test metrics with the training prompts, and transformers' loss on the first batch."""
    import torch
    import transformers

    from pretune.jobs.finetune import load_finetune_config, prepare
    from pretune.tasks.metrics import compute
    from pretune.tasks.run import evaluate_task

    cfg = load_finetune_config(None, overrides(files, **{"model.init": folder, "train.out": "/nonexistent",
                                                        "train.batch_size": 8}))
    job = prepare(cfg, show_progress=False, log=lambda *a, **k: None)
    out = {}
    for split in ("dev", "test"):
        metrics, _ = evaluate_task(job.task, job.model, job.records[split], batch_size=16, show_progress=False)
        out[split] = metrics
    # read leniently: 16 tokens, "spam" anywhere in the answer (and not "not (a) spam") is spam, else ham
    long = prepare(load_finetune_config(None, overrides(files, **{"model.init": folder, "train.out": "/nonexistent",
                                                                  "task.max_target_len": 16})),
                   show_progress=False, log=lambda *a, **k: None)
    _, preds = evaluate_task(long.task, long.model, long.records["test"], batch_size=16, show_progress=False)
    lenient = ["spam" if "spam" in p.lower() and not re.search(r"\bnot (a |an )?spam", p.lower()) else "ham"
               for p in preds]
    out["test_lenient"] = compute(["accuracy", "macro_f1"], lenient, [long.task.reference(r)
                                                                     for r in long.records["test"]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total = n = 0.0
    feats = job.features["train"]
    with torch.no_grad():  # the per-token loss of the whole training set (the first step's batch is one sample)
        for i in range(0, len(feats), 16):
            batch = job.task.collate(feats[i:i + 16])
            k = int((batch["labels"][:, 1:] != -100).sum())
            total += k * float(hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  labels=batch["labels"]).loss)
            n += k
    out["hf_train_loss"] = total / n
    return out


def train(folder: Path, files: dict[str, Path], out: Path, seed: int, epochs: float, lr: float) -> dict:
    from pretune.jobs.finetune import finetune, load_finetune_config

    cfg = load_finetune_config(None, overrides(files, **{
        "model.init": folder, "peft.method": "lora", "train.out": out / f"seed{seed}", "train.seed": seed,
        "train.batch_size": 8, "tune.epochs": epochs, "train.lr": lr, "train.log_every": 1}))
    t0 = time.perf_counter()
    result = finetune(cfg, show_progress=False, log=lambda *a, **k: None)
    seconds = time.perf_counter() - t0
    first = json.loads((out / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()[0])
    return {"seed": seed, "dev": result.dev, "test": result.test, "seconds": seconds, "steps": result.steps,
            "first_loss": first["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--train", type=int, default=600)
    p.add_argument("--dev", type=int, default=200)
    p.add_argument("--test", type=int, default=454)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    from pretune import realmodels

    folder = realmodels.smollm2_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    files = split_files(args.out, args.train, args.dev, args.test)
    res = {"zero_shot": zero_shot(folder, files), "runs": []}
    for seed in args.seeds:
        res["runs"].append(train(folder, files, args.out, seed, args.epochs, args.lr))
        (args.out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    zs = res["zero_shot"]
    print(f"zero-shot: dev {zs['dev']}, test {zs['test']}; transformers' mean loss on the training set "
          f"{zs['hf_train_loss']:.3f}; zero-shot read leniently (test): {zs['test_lenient']}")
    print("| seed | first step loss | dev acc | dev macro-F1 | test acc | test macro-F1 | steps | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["runs"]:
        print(f"| {r['seed']} | {r['first_loss']:.3f} | {r['dev']['accuracy']:.4f} | {r['dev']['macro_f1']:.4f} | "
              f"{r['test']['accuracy']:.4f} | {r['test']['macro_f1']:.4f} | {r['steps']} | {r['seconds']:.0f} |")
    if len(res["runs"]) > 1:
        for split in ("dev", "test"):
            f1 = [r[split]["macro_f1"] for r in res["runs"]]
            print(f"{split} macro-F1: mean {statistics.mean(f1):.4f}, std {statistics.stdev(f1):.4f}; zero-shot "
                  f"{zs[split].get('macro_f1', float('nan')):.4f}")


if __name__ == "__main__":
    main()
