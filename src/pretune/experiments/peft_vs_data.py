"""``pretune experiment peft-vs-data``: which finetuning method fits which amount of data.

Full finetuning and the PEFT methods (LoRA, adapters, prefix tuning, prompt tuning, (IA)3, BitFit) on the real
all-MiniLM-L6-v2, each at its own default learning rate (``pretune.peft.methods``; full finetuning 5e-5), on the
bundled SMS spam task with a seeded subsample of the training records (``data.train_limit``: 100 / 300 / 1000 /
all 3627; nested, so a larger subsample holds a smaller one). One sweep per training-set size: the number of
steps follows the size (at least ``min_steps``, else the epochs), scored by test macro-F1 (spam is 13 %).
"""

from __future__ import annotations

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
    matches,
    realmodel,
    stats,
)

TASK = "tasks/sms_spam"
N_TRAIN = 3627  # the bundled sms_spam training records (0 in train_limit: all of them)
METRIC = "test.macro_f1"
METHODS = {"": "full finetuning", "lora": "LoRA", "adapter": "adapters", "prefix": "prefix tuning",
           "prompt": "prompt tuning", "ia3": "(IA)3", "bitfit": "BitFit"}
# "matches": LoRA's shortfall within the seed spread (2 x the pooled std, at least MATCH_TOLERANCE), with a pooled
# std of at most MAX_SPREAD (a noisier comparison cannot tell a match from a miss)
MATCH_TOLERANCE, MAX_SPREAD = 0.01, 0.025
# size -> methods, training-set sizes (0: all), steps (at least min_steps, else `epochs` passes), seeds, model
RECIPES = {
    "fast": dict(methods=["", "lora", "ia3"], sizes=[32, 0], min_steps=4, epochs=1, batch_size=16, max_len=24,
                 seeds=[0, 1], model="tiny", precision="fp32"),
    "default": dict(methods=["", "lora", "ia3", "prompt"], sizes=[100, 1000, 0], min_steps=80, epochs=1,
                    batch_size=32, max_len=64, seeds=[0, 1, 2], model="minilm", precision="fp32"),
    "large": dict(methods=list(METHODS), sizes=[100, 300, 1000, 0], min_steps=80, epochs=2, batch_size=32,
                  max_len=64, seeds=[0, 1, 2], model="minilm", precision="auto"),
}
FAST_RECORDS = {"train": 96, "dev": 40, "test": 40}  # the fast size's data: the first records of each split


def _size_name(n: int) -> str:
    return f"n{n}" if n else "all"


def _steps(n: int, r: dict) -> int:
    """Optimizer steps for ``n`` training records: ``epochs`` passes, at least ``min_steps``."""
    return max(r["min_steps"], r["epochs"] * -(-n // r["batch_size"]))


class PeftVsData(Experiment):
    name = "peft-vs-data"
    title = "PEFT method vs training-set size"
    claim = ("LoRA matches full finetuning when data is plentiful; the rule of thumb: 10s-100s of examples call for "
             "prompting or (IA)3, 100s-1000s for prompt tuning or (IA)3, more for LoRA.")
    source = ("lectures 000 (When to use each: a rule of thumb) and 002 (PEFT: Summary); Hu et al. 2021 (LoRA), "
              "Liu et al. 2022 (T-Few, (IA)3), Lester et al. 2021 (prompt tuning)")
    claims = (
        Claim("lora-matches-full", "With all the training data, LoRA matches full finetuning.",
              "confirmed when LoRA's shortfall against full finetuning on all the data (difference of mean test "
              f"macro-F1; scoring higher is fine) is within the seed-to-seed spread, at most max(2 x the pooled "
              f"standard deviation, {MATCH_TOLERANCE:g}), and that pooled standard deviation is at most {MAX_SPREAD:g} "
              "(a noisier comparison cannot tell a match)"),
        Claim("lora-for-more-data", "With all the training data, LoRA beats the lighter methods ((IA)3 and prompt "
              "tuning).",
              "confirmed when LoRA's mean test macro-F1 on all the data exceeds that of the better of (IA)3 and "
              "prompt tuning by more than 2 x the pooled standard deviation"),
        Claim("light-for-few-data", "With the fewest examples, (IA)3 or prompt tuning beats LoRA.",
              "confirmed when, at the smallest training-set size, the better of (IA)3 and prompt tuning exceeds "
              "LoRA's mean test macro-F1 by more than 2 x the pooled standard deviation"),
    )
    sizes = {
        "fast": "a tiny random-init encoder (tests only), full / LoRA / (IA)3 x 32 and 96 records x 2 seeds (12 "
                "trials; ~20 s)",
        "default": "MiniLM, full / LoRA / (IA)3 / prompt tuning x 100, 1000 and all 3627 records x seeds 0-2 (36 "
                   "trials; 80 steps of 32 at 100 and 1000 records, one epoch (114 steps) at all; about 15 minutes "
                   "on 2 CPU cores in fp32). Smaller than the full grid to fit 20 minutes: --size large runs it",
        "large": "the full grid: all 7 methods (+ adapters, prefix tuning, BitFit) x 100 / 300 / 1000 / all records x "
                 "seeds 0-2, two epochs at all (84 trials; about 1.5 hours on 2 CPU cores, less with --jobs on a "
                 "bigger machine)",
    }
    metric = METRIC
    figure_name = "learning-curves"

    def prepare(self, size: str, folder: Path, log=print) -> dict:
        from .base import bundled_file, head_records

        if RECIPES[size]["model"] != "tiny":
            return {**{split: bundled_file(f"{TASK}/{split}.jsonl") for split in ("train", "dev", "test")},
                    "n_train": N_TRAIN}
        files = {split: head_records(bundled_file(f"{TASK}/{split}.jsonl"), folder / f"{split}.jsonl", n)
                 for split, n in FAST_RECORDS.items()}
        tok, model = folder / "tokenizer.json", folder / "model"
        if not tok.is_file():  # the tiny model's own vocabulary, from the training texts
            import json

            from ..io.tokenization import train_tokenizer

            texts = [json.loads(line)["text"] for line in open(bundled_file(f"{TASK}/train.jsonl"), encoding="utf-8")]
            train_tokenizer(texts=texts, kind="wordpiece", vocab_size=400, show_progress=False).save(tok)
        if not (model / "config.json").is_file():  # a randomly initialised tiny "checkpoint" for PEFT to wrap
            import torch

            from ..io.checkpoint import save
            from ..io.tokenization import Tokenizer
            from ..model import TransformerLM
            from ..presets import get_preset

            vocab = Tokenizer.load(tok)
            torch.manual_seed(0)
            save(TransformerLM(get_preset("tiny-bert-base", vocab_size=vocab.vocab_size, pad_token_id=vocab.pad_id)),
                 model, tokenizer=tok)
        return {**files, "model": str(model.resolve()), "n_train": FAST_RECORDS["train"]}

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        model = {"model.init": inputs["model"] if r["model"] == "tiny" else realmodel("minilm")}
        out = []
        for n in r["sizes"]:
            steps = _steps(n or inputs["n_train"], r)
            spec = {
                "command": "finetune",
                "base": {**model, "task": {"name": "classification", "max_len": r["max_len"]},
                         "data": {"train": inputs["train"], "dev": inputs["dev"], "test": inputs["test"],
                                  "train_limit": n},
                         "tune.epochs": 0,
                         "train": {"steps": steps, "eval_every": max(1, steps // 2), "batch_size": r["batch_size"],
                                   "precision": r["precision"], "keep_last": 0, "plot": False,
                                   "tensorboard": False}},
                "grid": {"peft.method": list(r["methods"])},
                "seeds": r["seeds"],
                "metrics": [METRIC, "test.accuracy"],
            }
            out.append(Sweep(_size_name(n), spec))
        return out

    # ------------------------------------------------------------------------------------------
    # the verdicts
    # ------------------------------------------------------------------------------------------
    def _values(self, results: Results, method: str, sweep: str) -> list[float]:
        return results.values(METRIC, {"peft.method": method}, sweep=sweep)

    def findings(self, results: Results) -> list[Finding]:
        sweeps = list(results.sweeps)
        found = []
        full, lora = self._values(results, "", "all"), self._values(results, "lora", "all")
        ok, gap, spread, words = matches(lora, full, tolerance=MATCH_TOLERANCE, max_spread=MAX_SPREAD)
        found.append(Finding(self.claims[0], CONFIRMED if ok else NOT_CONFIRMED,
                             f"all records: LoRA {fmt_stats(lora)} vs full finetuning {fmt_stats(full)} test macro-F1; "
                             f"{words}", gap, spread))
        for claim, sweep, lora_better in ((self.claims[1], "all", True),
                                          (self.claims[2], sweeps[0] if sweeps else "", False)):
            lora = self._values(results, "lora", sweep)
            light = {m: self._values(results, m, sweep) for m in ("ia3", "prompt")}
            light = {m: v for m, v in light.items() if v}
            if not light or not lora:
                found.append(Finding(claim, NOT_CONFIRMED, f"not measured at this size: {sweep or 'no sweep'} has no "
                                     "LoRA or no (IA)3 / prompt tuning trials"))
                continue
            best = max(light, key=lambda m: stats(light[m])[0])
            ok, margin, spread, words = beats(lora, light[best]) if lora_better else beats(light[best], lora)
            versus = f"LoRA over {METHODS[best]}" if lora_better else f"{METHODS[best]} over LoRA"
            scores = ", ".join(f"{METHODS[m]} {fmt_stats(v)}" for m, v in light.items())
            found.append(Finding(claim, CONFIRMED if ok else NOT_CONFIRMED, f"{_label(sweep)}: LoRA {fmt_stats(lora)}, "
                                 f"{scores} test macro-F1; {versus}: {words}", margin, spread))
        return found

    def table(self, results: Results) -> str:
        sweeps = list(results.sweeps)
        methods = list(dict.fromkeys(s["params"]["peft.method"] for s in results.settings()))
        lines = ["Test macro-F1 (test accuracy below) by method and training records:", "",
                 "| method | " + " | ".join(_label(s) for s in sweeps) + " |", "|---|" + "---|" * len(sweeps)]
        for metric in (METRIC, "test.accuracy"):
            if metric != METRIC:
                lines += ["", "| method (test accuracy) | " + " | ".join(_label(s) for s in sweeps) + " |",
                          "|---|" + "---|" * len(sweeps)]
            for m in methods:
                cells = [fmt_stats(results.values(metric, {"peft.method": m}, sweep=s)) for s in sweeps]
                lines.append(f"| {METHODS.get(m, m)} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def figure(self, results: Results, path: Path) -> Path | None:
        from matplotlib.figure import Figure

        from ..io.outputs import write_atomic

        sweeps = list(results.sweeps)
        fig = Figure(figsize=(6.5, 4.2), layout="constrained")
        ax = fig.subplots()
        sizes = {s: _records(s, results.inputs.get("n_train")) for s in sweeps}
        methods = list(dict.fromkeys(s["params"]["peft.method"] for s in results.settings()))
        for i, m in enumerate(methods):
            pts = [(sizes[s], *stats(results.values(METRIC, {"peft.method": m}, sweep=s))) for s in sweeps]
            pts = [(x, mean, sd or 0.0) for x, mean, sd in pts if mean is not None and x]
            if pts:
                xs, ms, sds = zip(*pts)
                ax.errorbar(xs, ms, yerr=sds, marker="o", capsize=3, color=f"C{i}", label=METHODS.get(m, m))
        ax.set_xscale("log")
        ax.set(xlabel="training records (log scale)", ylabel="test macro-F1",
               title="PEFT methods vs training-set size (mean ± std over seeds)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))
        return path


def _records(sweep: str, n_all: int | None) -> int | None:
    """The training records of a sweep (``n100``: 100; ``all``: every record of the training file)."""
    if sweep == "all":
        return n_all
    return int(sweep[1:]) if sweep[1:].isdigit() else None


def _label(sweep: str) -> str:
    return "all records" if sweep == "all" else f"{sweep[1:]} records"


EXPERIMENT = PeftVsData()
