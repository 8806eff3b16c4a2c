"""``pretune experiment pretrained-vs-scratch``: the same architecture finetuned from a pretrained checkpoint and
from random weights, with the same recipe, on the bundled WordNet supersense task (a gloss -> one of 41
supersenses). The pretrained model is the real all-MiniLM-L6-v2; from scratch is ``tune.from_scratch``: its
architecture with a fresh initialisation. Lecture 004 ("Pretrain vs. Random Initialization"); Hao et al. 2019,
Visualizing and Understanding the Effectiveness of BERT; Devlin et al. 2019.
"""

from __future__ import annotations

import json
from pathlib import Path

from .base import (
    CONFIRMED,
    NOT_CONFIRMED,
    Claim,
    Experiment,
    Finding,
    Results,
    Sweep,
    beats,
    fmt_stats,
    head_records,
    realmodel,
)

TASK = "tasks/wordnet_supersense"
METRIC = "test.macro_f1"
# size -> the recipe: records (fast: the first training records), dev/test records (0: all 250), epochs, batch,
# max_len, seeds
RECIPES = {
    "fast": dict(records=64, eval_records=40, epochs=2, batch_size=16, max_len=24, seeds=[0, 1]),
    "default": dict(eval_records=0, epochs=3, batch_size=32, max_len=64, seeds=[0, 1, 2]),
    "large": dict(eval_records=0, epochs=5, batch_size=32, max_len=64, seeds=[0, 1, 2, 3, 4]),
}
LABELS = {False: "pretrained (all-MiniLM-L6-v2)", True: "from scratch (same architecture)"}


class PretrainedVsScratch(Experiment):
    name = "pretrained-vs-scratch"
    title = "Pretrained vs from scratch"
    claim = ("Finetuning a pretrained checkpoint beats finetuning the same architecture from random weights with "
             "the same recipe.")
    source = ("lecture 004 (Pretrain vs. Random Initialization); Hao et al. 2019, Visualizing and Understanding "
              "the Effectiveness of BERT")
    claims = (Claim("pretrained-wins", "The pretrained MiniLM scores a higher test macro-F1 than the same "
                    "architecture trained from scratch.",
                    "confirmed when the pretrained mean test macro-F1 exceeds the from-scratch mean by more than "
                    "2 x the pooled standard deviation over seeds"),)
    sizes = {
        "fast": "the first 64 training records, 40 dev / 40 test, 2 epochs of 16, max_len 24, 2 seeds (4 trials; "
                "~15 s)",
        "default": "all 2000 training records, 250 dev / 250 test, 3 epochs of 32 (186 steps) at lr 1e-4, "
                   "max_len 64, seeds 0-2 (6 trials of about 90 s; about 5 minutes on 2 CPU cores in fp32)",
        "large": "as default with 5 epochs and 5 seeds (10 trials; about 12 minutes on 2 CPU cores)",
    }
    metric = METRIC

    def prepare(self, size: str, folder: Path, log=print) -> dict:
        from .base import bundled_file

        n = RECIPES[size]["eval_records"]
        if not n:
            return {split: bundled_file(f"{TASK}/{split}.jsonl") for split in ("train", "dev", "test")}
        # a fast size: the first records of train, and dev / test records of the labels those hold (a label the
        # training records lack is refused at test time)
        train = head_records(bundled_file(f"{TASK}/train.jsonl"), folder / "train.jsonl", RECIPES[size]["records"])
        labels = {json.loads(line)["label"] for line in open(train, encoding="utf-8")}
        return {"train": train, **{split: head_records(bundled_file(f"{TASK}/{split}.jsonl"), folder / f"{split}.jsonl",
                                                       n, keep=lambda rec: rec["label"] in labels)
                                   for split in ("dev", "test")}}

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        spec = {
            "command": "finetune",
            "base": {"model.init": realmodel("minilm"), "task": {"name": "classification", "max_len": r["max_len"]},
                     "data.train": inputs["train"], "data.dev": inputs["dev"],
                     "data.test": inputs["test"],
                     "tune.epochs": r["epochs"], "tune.evals_per_epoch": 1,
                     "train": {"lr": 1e-4, "batch_size": r["batch_size"], "precision": "fp32" if size != "large"
                               else "auto", "keep_last": 0, "plot": False, "tensorboard": False}},
            "grid": {"tune.from_scratch": [False, True]},
            "seeds": r["seeds"],
            "metrics": [METRIC, "test.accuracy"],
        }
        return [Sweep("sweep", spec)]

    def table(self, results: Results) -> str:
        lines = ["| model | seeds | test macro-F1 | test accuracy |", "|---|---|---|---|"]
        for scratch, label in LABELS.items():
            s = results.find({"tune.from_scratch": scratch})
            if s is None:
                continue
            lines.append(f"| {label} | {len(s['seeds'])} | {fmt_stats(s['metrics'][METRIC]['values'])} | "
                         f"{fmt_stats(s['metrics']['test.accuracy']['values'])} |")
        return "\n".join(lines)

    def findings(self, results: Results) -> list[Finding]:
        pre = results.values(METRIC, {"tune.from_scratch": False})
        scratch = results.values(METRIC, {"tune.from_scratch": True})
        ok, margin, spread, words = beats(pre, scratch)
        return [Finding(self.claims[0], CONFIRMED if ok else NOT_CONFIRMED,
                        f"pretrained {fmt_stats(pre)} vs from scratch {fmt_stats(scratch)} test macro-F1 over "
                        f"{len(pre)} / {len(scratch)} seeds; {words}", margin, spread)]


EXPERIMENT = PretrainedVsScratch()
