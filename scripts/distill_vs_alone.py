"""Distillation against training alone: a half-depth student distilled from a pretune-pretrained teacher, against the
same student trained on its own for the same steps on the same data (the figure in docs/distill.md).

    .venv/bin/python scripts/distill_vs_alone.py --out runs/distill-vs-alone     # ~3 min, 2.5 CPU-min (1 thread)
    .venv/bin/python scripts/distill_vs_alone.py --out runs/x --teacher-steps 2000 --student-steps 1000

1. a WordPiece tokenizer (4000 tokens) on the bundled corpus (Austen, Wikipedia, Moby Dick, the gospels);
2. the teacher: a BERT-shaped encoder (4 layers, 64 wide, 4 heads, FFN 256) pretrained with dynamic MLM;
3. three 2-layer students of the teacher's width, each --student-steps steps with the same batches, masks and
   learning rate: `alone` (MLM, random init), `kd` (distilled, random init) and `kd+init` (distilled, layers 0 and 2
   of the teacher, DistilBERT's recipe: init_from_teacher=every_other, alpha_kl 5, alpha_hard 2, alpha_cos 1, T 2).
Every run holds out the same blocks (data.eval_fraction, the same seed) masked the same way; the script prints the
held-out MLM loss (the hard loss, on the true tokens) of the teacher and of each student, then finetunes the teacher
and the students on the bundled sms_spam task (--finetune-seeds seeds, 2 epochs of its training set, lr 1e-3) and
prints their test accuracy and macro-F1 (mean +- std over seeds); everything goes to <out>/results.json. A finished
run is not run again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SHAPE = ["model.dim=64", "model.n_heads=4", "model.ffn_dim=256", "model.max_seq_len=128"]


def common(args, out: Path, steps: int) -> list[str]:
    return [f"tokenizer={out / 'tokenizer.json'}", f"data.train=[{','.join(map(str, args.data))}]",
            "data.block_size=62", "data.eval_fraction=0.05", "data.eval_max=256", f"data.store={out / 'store'}",
            f"train.steps={steps}", f"train.batch_size={args.batch_size}", f"train.lr={args.lr}",
            f"train.warmup_steps={steps // 20}", "train.eval_every=0", "train.save_every=0", "train.keep_last=0",
            "train.tensorboard=false", "train.plot=false", f"train.threads={args.threads}", "train.seed=0"]


def run(name: str, out: Path, overrides: list[str], *, distil: bool) -> dict:
    from pretune.jobs.distill import distill, load_distill_config
    from pretune.jobs.pretrain import load_run_config, pretrain

    done = out / name / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    overrides = overrides + [f"train.out={out / name}"]
    t0 = time.perf_counter()
    if distil:
        result = distill(load_distill_config(None, overrides), show_progress=False, log=lambda *a: None)
    else:
        result = pretrain(load_run_config(None, overrides), show_progress=False, log=lambda *a: None)
    row = {"run": name, "eval": result.eval, "steps": result.steps, "seconds": round(time.perf_counter() - t0, 1)}
    done.write_text(json.dumps(row, indent=2) + "\n")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/distill-vs-alone"))
    p.add_argument("--teacher-steps", type=int, default=1000)
    p.add_argument("--student-steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--finetune-seeds", type=int, default=3, help="finetuning seeds per model on sms_spam (0: skip)")
    p.add_argument("--data", nargs="+", type=Path, default=None, help="pretraining text (default: the bundled corpus)")
    args = p.parse_args()
    from pretune import bundled
    from pretune.io.tokenization import train_tokenizer

    args.data = args.data or bundled.corpus()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").is_file():
        train_tokenizer(args.data, kind="wordpiece", vocab_size=4000, show_progress=False).save(out / "tokenizer.json")

    rows = [run("teacher", out, common(args, out, args.teacher_steps) + SHAPE
                + ["model.preset=tiny-bert-base", "model.n_layers=4", "objective.name=mlm"], distil=False)]
    teacher = out / "teacher" / "model"
    student = common(args, out, args.student_steps) + SHAPE + ["model.preset=tiny-bert-base", "model.n_layers=2"]
    kd = [f"objective.teacher={teacher}", "objective.alpha_kl=5.0", "objective.alpha_hard=2.0",
          "objective.alpha_cos=1.0", "objective.temperature=2.0"]
    rows.append(run("alone", out, student + ["objective.name=mlm"], distil=False))
    rows.append(run("kd", out, student + kd, distil=True))
    rows.append(run("kd+init", out, student + kd + ["objective.init_from_teacher=every_other"], distil=True))

    print(f"{'run':<10} {'layers':>6} {'steps':>6} {'eval mlm_loss':>14} {'mlm_ppl':>9} {'mlm_acc':>8} {'seconds':>8}")
    for r in rows:
        e = r["eval"]
        layers = 4 if r["run"] == "teacher" else 2
        print(f"{r['run']:<10} {layers:>6} {r['steps']:>6} {e['mlm_loss']:>14.4f} {e['mlm_ppl']:>9.2f} "
              f"{e.get('mlm_acc', float('nan')):>8.3f} {r['seconds']:>8.1f}")
    alone, best = rows[1]["eval"]["mlm_loss"], rows[3]["eval"]["mlm_loss"]
    print(f"distilled (kd+init) - alone: {best - alone:+.4f} held-out MLM loss")
    print(f"\nfinetuned on sms_spam ({args.finetune_seeds} seeds): test accuracy and macro-F1, mean +- std")
    for r in rows:
        scores = [finetune_on_spam(out, r["run"], seed, args.threads) for seed in range(args.finetune_seeds)]
        r["sms_spam"] = scores
        acc = [x["accuracy"] for x in scores]
        f1 = [x["macro_f1"] for x in scores]
        print(f"{r['run']:<10} accuracy {statistics.fmean(acc):.4f} +- {_sd(acc):.4f}   macro-F1 "
              f"{statistics.fmean(f1):.4f} +- {_sd(f1):.4f}")
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def finetune_on_spam(out: Path, name: str, seed: int, threads: int) -> dict:
    """Test scores of ``out/name/model`` finetuned on the bundled sms_spam task (cached in its folder)."""
    from pretune import bundled
    from pretune.jobs.finetune import finetune, load_finetune_config

    run = out / f"{name}-sms_spam-seed{seed}"
    if (run / "results.json").is_file():
        return json.loads((run / "results.json").read_text())["test"]
    data = bundled.task("sms_spam")
    cfg = load_finetune_config(None, [f"model.init={out / name / 'model'}", "task.name=classification",
                                      f"data.train={data['train']}", f"data.dev={data['dev']}",
                                      f"data.test={data['test']}", f"train.out={run}", "tune.epochs=2",
                                      "train.batch_size=32", "train.lr=1e-3", f"train.seed={seed}",
                                      f"train.threads={threads}", "train.tensorboard=false", "train.plot=false"])
    return finetune(cfg, show_progress=False, log=lambda *a: None).test


if __name__ == "__main__":
    main()
