"""``pretune experiment t5-objectives``: the T5 objectives table on one small encoder-decoder (Raffel et al. 2020,
Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer, Tables 4 and 5; lecture 004,
"T5 Pretraining").

The same T5-style encoder-decoder (relative position buckets, RMSNorm, ReLU FFN, tied embeddings) is pretrained on
the bundled corpus with each of T5's objectives, the same number of steps each (one sweep over
``objective.name``): span corruption (``span``), prefix LM (``prefix_lm``), BERT-style (``bert_style``: 15 % of the
tokens masked or replaced, the target the whole original text), deshuffling (``deshuffle``) and i.i.d. token
dropping (``drop_tokens``). Their training steps differ in cost (the decoder reads the target: span corruption's
and drop's targets are short, BERT-style's and deshuffling's the whole block), so each run's counted FLOPs are
reported (``compute.pflops``; ``pretune.objectives.flops``). Each pretrained model, and the same architecture at its
random initialisation (what pretraining buys at all), is then finetuned with several seeds on the bundled WordNet
reverse dictionary (a gloss -> the word it defines, text to text) and scored on its test set by the perplexity of
the target word (the verdicts read it: exact match is near zero for models this small), exact match and ROUGE-L.
"""

from __future__ import annotations

from pathlib import Path

from .base import CONFIRMED, NOT_CONFIRMED, Claim, Experiment, Finding, Results, Sweep, beats, fmt, fmt_stats, stats
from .pretraining import (
    cached_step_flops,
    corpus_files,
    link_model,
    measure_compute,
    pretraining_trials,
    save_random_init,
    shared_corpus,
)

CORPUS = ("enwiki_sample.txt.gz", "austen_emma_pride.txt.gz", "web_bible_gospels.txt.gz", "mobydick_ch1-20.txt.gz")
OBJECTIVES = {"span": "span corruption", "bert_style": "BERT-style", "drop_tokens": "i.i.d. drop tokens",
              "prefix_lm": "prefix LM", "deshuffle": "deshuffling", "scratch": "no pretraining (random init)"}
DENOISING = ("span", "bert_style")  # the claimed winners
TASK = "tasks/wordnet_reverse_dictionary"
METRIC, OTHERS = "test.perplexity", ("test.exact_match_text", "test.rouge_l")
# size -> corpus, unigram vocabulary, encoder-decoder (n_layers each stack), objectives, steps, batch, lr (T5's
# inverse square root after a constant warmup), pretraining seeds, the random-init reference, batches the FLOPs are
# counted on; finetuning: records (0: all), epochs, batch, lr; finetuning seeds
RECIPES = {
    "fast": dict(corpus=("mobydick_ch1-20.txt.gz",), vocab=512,
                 model=dict(n_layers=1, dim=32, n_heads=2, head_dim=16, ffn_dim=64, max_seq_len=64),
                 objectives=("span", "prefix_lm", "deshuffle"), steps=6, batch_size=8, lr=3e-3, warmup=0.3,
                 pretrain_seeds=[0], reference=False, flops_batches=1, precision="fp32",
                 finetune=dict(records=64, eval_records=32, epochs=1, batch_size=16, lr=1e-3), seeds=[0, 1]),
    "default": dict(corpus=CORPUS, vocab=4096,
                    model=dict(n_layers=2, dim=128, n_heads=4, head_dim=32, ffn_dim=512, max_seq_len=128),
                    objectives=("span", "bert_style", "drop_tokens", "prefix_lm", "deshuffle"), steps=600,
                    batch_size=32, lr=3e-3, warmup=0.1, pretrain_seeds=[0], reference=True, flops_batches=2,
                    precision="fp32", finetune=dict(records=0, epochs=5, batch_size=32, lr=1e-3), seeds=[0, 1, 2]),
    "large": dict(corpus=CORPUS, vocab=8192,
                  model=dict(n_layers=6, dim=512, n_heads=8, head_dim=64, ffn_dim=2048, max_seq_len=256),
                  objectives=("span", "bert_style", "drop_tokens", "prefix_lm", "deshuffle"), steps=20000,
                  batch_size=64, lr=1e-2, warmup=0.05, pretrain_seeds=[0, 1, 2], reference=True, flops_batches=2,
                  precision="auto", finetune=dict(records=0, epochs=10, batch_size=32, lr=1e-3), seeds=[0, 1, 2]),
}


def _init_name(objective: str, seed: int) -> str:
    return f"{objective}-s{seed}"


class T5Objectives(Experiment):
    name = "t5-objectives"
    title = "T5's pretraining objectives"
    claim = ("Pretrained the same number of steps, the denoising objectives (span corruption, BERT-style) transfer "
             "better downstream than deshuffling and prefix language modelling.")
    source = ("lecture 004 (T5 Pretraining; seeds/004_cf7c82b07318fd2a.txt); Raffel et al. 2020, "
              "Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer, Tables 4 and 5")
    claims = (
        Claim("denoising-beats-deshuffling", "Span corruption and BERT-style each reach a lower test perplexity on the "
              "reverse dictionary than deshuffling.",
              "confirmed when deshuffling's mean test perplexity exceeds both span corruption's and BERT-style's by "
              "more than 2 x the pooled standard deviation (each pair pooled on its own; the spread is over finetuning "
              "seeds, and over pretraining seeds where the size has several)"),
        Claim("denoising-beats-prefix-lm", "Span corruption and BERT-style each reach a lower test perplexity on the "
              "reverse dictionary than prefix LM.",
              "confirmed when prefix LM's mean test perplexity exceeds both span corruption's and BERT-style's by more "
              "than 2 x the pooled standard deviation (each pair pooled on its own; the spread is over finetuning "
              "seeds, and over pretraining seeds where the size has several)"),
    )
    sizes = {
        "fast": "Moby Dick only, unigram 512, a 1+1-layer 32-wide encoder-decoder, 6 steps of 8 x 64 tokens with span "
                "corruption, prefix LM and deshuffling, finetuned on 64 reverse-dictionary records, 2 seeds (9 "
                "trials; ~25 s)",
        "default": "the whole bundled corpus, unigram 4096 with T5's 100 sentinels, a 2+2-layer 128-wide "
                   "encoder-decoder, 600 steps of 32 x 128 tokens at lr 3e-3 (inverse square root) with each of the "
                   "five objectives (pretraining seed 0); each model and the random init finetuned on all 1500 "
                   "reverse-dictionary records, 5 epochs at lr 1e-3, seeds 0-2 (23 trials; about 16 minutes on 2 CPU "
                   "cores in fp32, 12 of them pretraining)",
        "large": "unigram 8192, T5-small's shape (6+6 layers, 512 wide), 20000 steps of 64 x 256 tokens at lr 1e-2 "
                 "with each objective, pretraining seeds 0-2, each model finetuned 10 epochs with seeds 0-2 (15 + 54 "
                 "trials; for a GPU)",
    }
    metric = METRIC
    figure_name = "objectives"

    # ------------------------------------------------------------------------------------------
    # inputs: tokenizer (T5 sentinels) and token store, FLOPs per step of each objective, the random init, task data
    # ------------------------------------------------------------------------------------------
    def prepare(self, size: str, folder: Path, log=print) -> dict:
        from .base import bundled_file, head_records

        r = RECIPES[size]
        files = corpus_files(r["corpus"])
        inputs = {**shared_corpus(folder, files, kind="unigram", specials="t5", vocab=r["vocab"], log=log),
                  "files": files}
        inputs["flops"] = {obj: cached_step_flops(self._pretrain_base(size, inputs, obj), folder,
                                                  batches=r["flops_batches"], log=log)["flops_per_step"]
                           for obj in r["objectives"]}
        ft = r["finetune"]
        data = {split: bundled_file(f"{TASK}/{split}.jsonl") for split in ("train", "dev", "test")}
        if ft["records"]:  # a fast size: the first records of each split
            data = {split: head_records(path, folder / "task" / f"{split}.jsonl",
                                        ft["records"] if split == "train" else ft["eval_records"])
                    for split, path in data.items()}
        inputs["data"] = data
        pretrained = folder / "pretrained"
        pretrained.mkdir(parents=True, exist_ok=True)
        inits = {}
        for trial in pretraining_trials(self._pretrain_spec(size, inputs)):
            name = _init_name(trial.params["objective.name"], trial.seed)
            inits[name] = link_model(pretrained / name, Path("..", "..", "pretrain", "trials", trial.name, "model"))
        for seed in r["pretrain_seeds"] if r["reference"] else []:
            scratch = pretrained / _init_name("scratch", seed)
            if not (scratch / "config.json").is_file():
                save_random_init(self._pretrain_base(size, inputs, r["objectives"][0]), seed, scratch)
            inits[_init_name("scratch", seed)] = str(scratch.resolve(strict=False))
        inputs["inits"] = inits
        return inputs

    def _pretrain_base(self, size: str, inputs: dict, objective: str | None = None) -> dict:
        r = RECIPES[size]
        steps = r["steps"]
        base = {"model": {"preset": "t5-small", **r["model"], "dropout": 0.0, "attn_dropout": 0.0},
                "tokenizer": inputs["tokenizer"],
                "data": {"train": list(inputs["files"]), "store": inputs["store"], "eval_max": 32},
                # T5: a constant rate for the warmup steps, then its inverse square root (Raffel et al. 2020 §3.1.2)
                "train": {"steps": steps, "batch_size": r["batch_size"], "lr": r["lr"], "schedule": "inverse_sqrt",
                          "warmup_steps": max(1, round(r["warmup"] * steps)), "weight_decay": 0.0,
                          "eval_every": max(1, steps // 4), "save_every": max(1, steps // 4),
                          "keep_last": 1 if size != "fast" else 0, "precision": r["precision"], "plot": False,
                          "tensorboard": False}}
        if objective is not None:
            base["objective"] = {"name": objective}
        return base

    def _pretrain_spec(self, size: str, inputs: dict) -> dict:
        r = RECIPES[size]
        # the costliest objectives first: with trials two at a time, the sweep ends sooner
        order = sorted(r["objectives"], key=lambda o: -inputs["flops"].get(o, 0.0))
        return {"command": "pretrain", "base": self._pretrain_base(size, inputs), "grid": {"objective.name": order},
                "seeds": r["pretrain_seeds"], "metrics": ["compute.pflops", "compute.steps", "eval.lm_loss"]}

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        ft = r["finetune"]
        finetune = {
            "command": "finetune",
            # the task as configs/finetune/seq2seq.yaml sets it; model selection on the dev perplexity
            "base": {"task": {"name": "seq2seq", "prefix": "word for: ", "max_len": 64, "max_target_len": 8,
                              "metric": "perplexity"},
                     "data": dict(inputs["data"]),
                     "tune": {"epochs": ft["epochs"], "evals_per_epoch": 1},
                     "train": {"lr": ft["lr"], "batch_size": ft["batch_size"], "precision": r["precision"],
                               "keep_last": 0, "plot": False, "tensorboard": False}},
            "grid": {"model.init": list(inputs["inits"].values())},
            "seeds": r["seeds"],
            "metrics": [METRIC, *OTHERS]}
        return [Sweep("pretrain", self._pretrain_spec(size, inputs)), Sweep("reverse-dictionary", finetune)]

    def measure(self, size: str, sweep: Sweep, result, inputs: dict, log=print) -> bool:
        if sweep.name != "pretrain":
            return False
        return measure_compute(result, lambda row: inputs["flops"][row["params"]["objective.name"]], log=log)

    # ------------------------------------------------------------------------------------------
    # the verdicts
    # ------------------------------------------------------------------------------------------
    def _values(self, results: Results, objective: str, metric: str = METRIC) -> list[float]:
        """Every finetuning run from an ``objective``'s models (all pretraining seeds)."""
        inits = results.inputs.get("inits", {})
        return [v for name, path in inits.items() if name.rsplit("-s", 1)[0] == objective
                for v in results.values(metric, {"model.init": path}, sweep="reverse-dictionary")]

    def findings(self, results: Results) -> list[Finding]:
        found = []
        for claim, loser in zip(self.claims, ("deshuffle", "prefix_lm")):
            worse = self._values(results, loser)
            parts, ok_all, margins, spreads = [], True, [], []
            for obj in DENOISING:
                better = self._values(results, obj)
                ok, margin, spread, words = beats(better, worse, higher_is_better=False)
                ok_all &= ok
                margins.append(margin)
                spreads.append(spread)
                parts.append(f"{OBJECTIVES[obj]} {fmt_stats(better)} vs {OBJECTIVES[loser]} {fmt_stats(worse)}: "
                             f"{words}")
            known = [m for m in margins if m is not None]
            found.append(Finding(claim, CONFIRMED if ok_all else NOT_CONFIRMED,
                                 "test perplexity of the target word; " + "; ".join(parts),
                                 min(known) if len(known) == len(margins) else None,
                                 max((s for s in spreads if s is not None), default=None)))
        return found

    def _compute(self, results: Results, objective: str) -> tuple[float | None, float | None]:
        """(PFLOPs, steps) of an objective's pretraining runs (means over its seeds)."""
        s = results.find({"objective.name": objective}, sweep="pretrain")
        if s is None:
            return None, None
        return (stats(s["metrics"].get("compute.pflops", {}).get("values", []))[0],
                stats(s["metrics"].get("compute.steps", {}).get("values", []))[0])

    def table(self, results: Results) -> str:
        head = ["pretraining objective", "steps", "PFLOPs", "runs", "test perplexity", "exact match", "ROUGE-L (0-100)"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        present = {name.rsplit("-s", 1)[0] for name in results.inputs.get("inits", {})}
        for obj, label in OBJECTIVES.items():
            if obj not in present:
                continue
            pflops, steps = (0.0, 0.0) if obj == "scratch" else self._compute(results, obj)
            ppl = self._values(results, obj)
            cells = [label, "—" if steps is None else f"{steps:.0f}", fmt(pflops, 3), str(len(ppl)), fmt_stats(ppl)]
            cells += [fmt_stats(self._values(results, obj, m)) for m in OTHERS]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Finetuned on the WordNet reverse dictionary (gloss -> word); test perplexity of the target "
                  "word's tokens (lower is better), exact match (a fraction) and ROUGE-L (0-100, Hugging Face "
                  "evaluate's x 100) of the greedy output. Every objective pretrains the same number of steps; "
                  "PFLOPs: each run's counted operations (the decoder reads the target, so objectives with short "
                  "targets cost less)."]
        return "\n".join(lines)

    def figure(self, results: Results, path: Path) -> Path | None:
        from matplotlib.figure import Figure

        from ..io.outputs import write_atomic

        present = [o for o in OBJECTIVES if self._values(results, o)]
        if not present:
            return None
        fig = Figure(figsize=(6.5, 3.8), layout="constrained")
        ax = fig.subplots()
        for i, obj in enumerate(present):
            values = self._values(results, obj)
            mean, std = stats(values)
            color = "C0" if obj in DENOISING else ("C3" if obj in ("deshuffle", "prefix_lm") else "C7")
            ax.bar(i, mean, yerr=std or 0.0, capsize=4, color=color, alpha=0.7)
            ax.plot([i] * len(values), values, "k.", markersize=5)
        ax.set_xticks(range(len(present)), [OBJECTIVES[o].replace(" (random init)", "") for o in present],
                      rotation=20, ha="right", fontsize=8)
        ax.set(ylabel="test perplexity of the target (lower is better)",
               title="T5 objectives, finetuned on the reverse dictionary (mean ± std; dots: runs)")
        ax.grid(alpha=0.3, axis="y")
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))
        return path


EXPERIMENT = T5Objectives()
