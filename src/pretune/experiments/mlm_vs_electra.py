"""``pretune experiment mlm-vs-electra``: ELECTRA's replaced-token detection against masked LM at equal pretraining
compute, scored downstream (Clark et al. 2020, ELECTRA, Table 1 and Figure 3; lecture 002, "Friends of Bert:
ELECTRA").

The same encoder (a BERT-style body; for ELECTRA it is the discriminator, beside a generator a quarter as wide whose
embeddings it shares) is pretrained on the bundled corpus with masked LM (``mlm``) and with ELECTRA (``electra``).
Equal compute: each objective's floating-point operations per training step are counted on batches of its own data
(``pretune.objectives.flops``: ELECTRA's generator forward, backward and sampling pass included), and ELECTRA runs
``round(MLM steps x MLM FLOPs per step / ELECTRA FLOPs per step)`` steps, so both runs do the same number of
operations; each run's total is written into its ``results.json`` (``compute.pflops``). Both runs are one sweep,
side by side: a case each (``cases`` of the sweep spec: the objective, its model head, its steps). Each pretrained
encoder, and the same architecture at its random initialisation (what
pretraining buys at all), is then finetuned with several seeds on the bundled WordNet supersense classification
task (a gloss -> one of 45 supersenses; test accuracy) and on the bundled Austen NER tagging task (entity F1), one
sweep per task over ``model.init``. The models reach the finetuning sweeps through ``inputs/pretrained/<name>``,
links to the pretraining trials' ``model`` folders, so the trial names say which model they start from.
"""

from __future__ import annotations

import json
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
OBJECTIVES = {"mlm": "masked LM", "electra": "ELECTRA", "scratch": "no pretraining (random init)"}
# the downstream tasks: sweep name -> bundled task, pretune task, the metric the verdict reads, the other one shown
TASKS = {
    "supersense": dict(task="tasks/wordnet_supersense", name="classification", metric="test.accuracy",
                       other="test.macro_f1", label="WordNet supersense (test accuracy)"),
    "ner": dict(task="tasks/austen_ner", name="tagging", metric="test.entity_f1", other="test.tag_accuracy",
                label="Austen NER (test entity F1)"),
}
# size -> corpus, WordPiece vocabulary, encoder, masked LM's steps (ELECTRA's follow from the FLOPs), batch, lr,
# warmup share, pretraining seeds, the random-init reference, batches the FLOPs are counted on; finetuning: records
# (0: all), epochs, batch, lr, max_len; the tasks; finetuning seeds
RECIPES = {
    "fast": dict(corpus=("mobydick_ch1-20.txt.gz",), vocab=512,
                 model=dict(n_layers=2, dim=32, n_heads=2, ffn_dim=64, max_seq_len=64),
                 steps=8, batch_size=8, lr=1e-3, warmup=0.25, pretrain_seeds=[0], reference=False, flops_batches=1,
                 precision="fp32", finetune=dict(records=64, eval_records=40, epochs=1, batch_size=16, lr=1e-3,
                                                 max_len=24),
                 tasks=("supersense",), seeds=[0, 1]),
    "default": dict(corpus=CORPUS, vocab=4096, model=dict(n_layers=4, dim=128, n_heads=4, ffn_dim=512, max_seq_len=128),
                    steps=1500, batch_size=32, lr=1e-3, warmup=0.1, pretrain_seeds=[0], reference=True,
                    flops_batches=2, precision="fp32",
                    finetune=dict(records=0, epochs=4, batch_size=32, lr=3e-4, max_len=64),
                    tasks=("supersense", "ner"), seeds=[0, 1, 2]),
    "large": dict(corpus=CORPUS, vocab=8192, model=dict(n_layers=12, dim=256, n_heads=4, ffn_dim=1024, max_seq_len=128),
                  steps=20000, batch_size=128, lr=5e-4, warmup=0.05, pretrain_seeds=[0, 1, 2], reference=True,
                  flops_batches=2, precision="auto",
                  finetune=dict(records=0, epochs=5, batch_size=32, lr=3e-4, max_len=64),
                  tasks=("supersense", "ner"), seeds=[0, 1, 2]),
}


_HEADS = {"mlm": "mlm", "electra": "rtd"}  # the model head each objective trains (ELECTRA: the discriminator's)


def _steps(size: str, flops: dict) -> dict:
    """Each objective's pretraining steps: masked LM's from the recipe, ELECTRA's as many as do the same FLOPs."""
    steps = RECIPES[size]["steps"]
    return {"mlm": steps, "electra": max(1, round(steps * flops["mlm"] / flops["electra"]))}


def _init_name(objective: str, seed: int) -> str:
    return f"{objective}-s{seed}"


class MlmVsElectra(Experiment):
    name = "mlm-vs-electra"
    title = "Masked LM vs ELECTRA at equal compute"
    claim = ("At equal pretraining compute, an encoder pretrained with ELECTRA's replaced-token detection finetunes "
             "to better downstream scores than the same encoder pretrained with masked LM.")
    source = ("lecture 002 (Friends of Bert: ELECTRA; seeds/002_e88de835563f8753.txt); Clark et al. 2020, "
              "ELECTRA: Pre-training Text Encoders as Discriminators Rather Than Generators, Table 1 and Figure 3")
    claims = (
        Claim("electra-beats-mlm-classification", "At equal pretraining FLOPs, ELECTRA's discriminator scores a higher "
              "test accuracy than the masked-LM encoder on WordNet supersense classification.",
              "confirmed when ELECTRA's mean test accuracy over its finetuning runs exceeds masked LM's by more than "
              "2 x the pooled standard deviation (the spread is over finetuning seeds, and over pretraining seeds "
              "where the size has several)"),
        Claim("electra-beats-mlm-tagging", "At equal pretraining FLOPs, ELECTRA's discriminator scores a higher test "
              "entity F1 than the masked-LM encoder on Austen NER tagging.",
              "confirmed when ELECTRA's mean test entity F1 over its finetuning runs exceeds masked LM's by more than "
              "2 x the pooled standard deviation"),
    )
    sizes = {
        "fast": "Moby Dick only, WordPiece 512, a 2-layer 32-wide encoder, 8 masked-LM steps of 8 x 64 tokens "
                "(ELECTRA fewer, at equal FLOPs), finetuned on 64 supersense records (no NER: its claim is not "
                "measured), 2 seeds (6 trials; ~20 s)",
        "default": "the whole bundled corpus, WordPiece 4096, a 4-layer 128-wide BERT encoder, 1500 masked-LM steps "
                   "of 32 x 128 tokens at lr 1e-3 (6.1M tokens) and ELECTRA's equal-FLOPs steps (about 1330), side "
                   "by side, pretraining seed 0; each model and the random init finetuned on all 2000 supersense and "
                   "all 600 NER records, 4 epochs at lr 3e-4, seeds 0-2 (20 trials; about 15 minutes on 2 CPU cores "
                   "in fp32, 12 of them pretraining)",
        "large": "WordPiece 8192, ELECTRA-Small's discriminator shape (12 layers, 256 wide), 20000 masked-LM steps of "
                 "128 x 128 tokens and ELECTRA's equal-FLOPs steps, pretraining seeds 0-2, finetuning seeds 0-2 (60 "
                 "trials; for a GPU: days on 2 CPU cores)",
    }
    metric = TASKS["supersense"]["metric"]
    figure_name = "downstream"

    # ------------------------------------------------------------------------------------------
    # inputs: tokenizer and token store, FLOPs per step of each objective, the random inits, task data
    # ------------------------------------------------------------------------------------------
    def prepare(self, size: str, folder: Path, log=print) -> dict:
        r = RECIPES[size]
        files = corpus_files(r["corpus"])
        inputs = {**shared_corpus(folder, files, kind="wordpiece", vocab=r["vocab"], log=log), "files": files}
        flops = {obj: cached_step_flops(self._pretrain_base(size, inputs, obj), folder, batches=r["flops_batches"],
                                        log=log)["flops_per_step"] for obj in ("mlm", "electra")}
        inputs.update(flops=flops, data=self._task_data(size, folder))
        # the models the finetuning sweeps start from: links to the pretraining trials' model folders (made before
        # those exist), and the encoder at its random initialisation
        pretrained = folder / "pretrained"
        pretrained.mkdir(parents=True, exist_ok=True)
        inits = {}
        for trial in pretraining_trials(self._pretrain_spec(size, inputs)):
            name = _init_name(trial.params["objective.name"], trial.seed)
            inits[name] = link_model(pretrained / name, Path("..", "..", "pretrain", "trials", trial.name, "model"))
        for seed in r["pretrain_seeds"] if r["reference"] else []:
            scratch = pretrained / _init_name("scratch", seed)
            if not (scratch / "config.json").is_file():
                save_random_init(self._pretrain_base(size, inputs, "mlm"), seed, scratch)
            inits[_init_name("scratch", seed)] = str(scratch.resolve(strict=False))
        inputs["inits"] = inits
        return inputs

    def _task_data(self, size: str, folder: Path) -> dict:
        from .base import bundled_file, head_records

        ft = RECIPES[size]["finetune"]
        out = {}
        for sweep, t in TASKS.items():
            files = {split: bundled_file(f"{t['task']}/{split}.jsonl") for split in ("train", "dev", "test")}
            if ft["records"]:  # a fast size: the first records (supersense: dev/test of the labels training has)
                train = head_records(files["train"], folder / sweep / "train.jsonl", ft["records"])
                keep = None
                if t["name"] == "classification":
                    labels = {json.loads(line)["label"] for line in open(train, encoding="utf-8")}
                    keep = lambda rec, labels=labels: rec["label"] in labels  # noqa: E731
                files = {"train": train, **{split: head_records(files[split], folder / sweep / f"{split}.jsonl",
                                                                ft["eval_records"], keep=keep)
                                            for split in ("dev", "test")}}
            out[sweep] = files
        return out

    def _pretrain_base(self, size: str, inputs: dict, objective: str | None = None) -> dict:
        """The pretraining runs' shared config; with ``objective``, that objective's whole run (its model head)."""
        r = RECIPES[size]
        steps = r["steps"]  # masked LM's; ELECTRA's case sets its own
        base = {"model": {"preset": "bert-base", **r["model"], "cls_act": "gelu"}, "tokenizer": inputs["tokenizer"],
                "data": {"train": list(inputs["files"]), "store": inputs["store"], "eval_max": 32},
                "train": {"steps": steps, "batch_size": r["batch_size"], "lr": r["lr"],
                          "warmup_steps": max(1, round(r["warmup"] * steps)), "schedule": "linear", "beta2": 0.98,
                          "weight_decay": 0.01, "eval_every": max(1, steps // 4), "save_every": max(1, steps // 4),
                          "keep_last": 1 if size != "fast" else 0, "precision": r["precision"], "plot": False,
                          "tensorboard": False}}
        if objective is not None:
            base["model"]["head"] = _HEADS[objective]
            base["objective"] = {"name": objective}
        return base

    def _pretrain_spec(self, size: str, inputs: dict) -> dict:
        """One sweep for both objectives, so that the two runs train side by side: a case each (the objective, its
        model head and its steps: ELECTRA's at equal FLOPs)."""
        return {"command": "pretrain", "base": self._pretrain_base(size, inputs),
                "cases": [{"objective.name": obj, "model.head": _HEADS[obj], "train.steps": steps}
                          for obj, steps in _steps(size, inputs["flops"]).items()],
                "seeds": RECIPES[size]["pretrain_seeds"],
                "metrics": ["compute.pflops", "compute.steps", "eval.mlm_loss", "eval.rtd_acc"]}

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        out = [Sweep("pretrain", self._pretrain_spec(size, inputs))]
        ft = r["finetune"]
        for sweep in r["tasks"]:
            t = TASKS[sweep]
            data = inputs["data"][sweep]
            out.append(Sweep(sweep, {
                "command": "finetune",
                "base": {"task": {"name": t["name"], "max_len": ft["max_len"]},
                         "data": {"train": data["train"], "dev": data["dev"], "test": data["test"]},
                         "tune": {"epochs": ft["epochs"], "evals_per_epoch": 1},
                         "train": {"lr": ft["lr"], "batch_size": ft["batch_size"], "precision": r["precision"],
                                   "keep_last": 0, "plot": False, "tensorboard": False}},
                "grid": {"model.init": list(inputs["inits"].values())},
                "seeds": r["seeds"],
                "metrics": [t["metric"], t["other"]]}))
        return out

    def measure(self, size: str, sweep: Sweep, result, inputs: dict, log=print) -> bool:
        if sweep.name != "pretrain":
            return False
        return measure_compute(result, lambda row: inputs["flops"][row["params"]["objective.name"]], log=log)

    # ------------------------------------------------------------------------------------------
    # the verdicts
    # ------------------------------------------------------------------------------------------
    def _values(self, results: Results, sweep: str, objective: str, metric: str | None = None) -> list[float]:
        """Every finetuning run of the task from an ``objective``'s models (all pretraining seeds)."""
        metric = metric or TASKS[sweep]["metric"]
        inits = results.inputs.get("inits", {})
        return [v for name, path in inits.items() if name.rsplit("-s", 1)[0] == objective
                for v in results.values(metric, {"model.init": path}, sweep=sweep)]

    def findings(self, results: Results) -> list[Finding]:
        found = []
        for claim, sweep in zip(self.claims, TASKS):
            label = TASKS[sweep]["label"]
            if sweep not in results.sweeps:
                found.append(Finding(claim, NOT_CONFIRMED, f"not measured at this size: no {sweep} sweep"))
                continue
            electra, mlm, scratch = (self._values(results, sweep, o) for o in ("electra", "mlm", "scratch"))
            ok, margin, spread, words = beats(electra, mlm)
            found.append(Finding(claim, CONFIRMED if ok else NOT_CONFIRMED,
                                 f"{label}: ELECTRA {fmt_stats(electra)} vs masked LM {fmt_stats(mlm)} over "
                                 f"{len(electra)} / {len(mlm)} runs"
                                 + (f" (no pretraining: {fmt_stats(scratch)})" if scratch else "") + "; "
                                 f"{self._compute_words(results)}; {words}", margin, spread))
        return found

    def _compute(self, results: Results, objective: str) -> tuple[float | None, float | None]:
        """(mean PFLOPs, mean steps) of an objective's pretraining runs."""
        s = results.find({"objective.name": objective}, sweep="pretrain")
        if s is None:
            return None, None
        return (stats(s["metrics"].get("compute.pflops", {}).get("values", []))[0],
                stats(s["metrics"].get("compute.steps", {}).get("values", []))[0])

    def _compute_words(self, results: Results) -> str:
        (pm, sm), (pe, se) = self._compute(results, "mlm"), self._compute(results, "electra")
        if pm is None or pe is None:
            return "pretraining compute not measured"
        return (f"pretraining: masked LM {sm:.0f} steps, {fmt(pm, 3)} PFLOPs; ELECTRA {se:.0f} steps, "
                f"{fmt(pe, 3)} PFLOPs")

    def table(self, results: Results) -> str:
        sweeps = [s for s in TASKS if s in results.sweeps]
        head = ["pretraining", "steps", "PFLOPs", "wall s"] + [TASKS[s]["label"] for s in sweeps]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        present = {name.rsplit("-s", 1)[0] for name in results.inputs.get("inits", {})}
        for obj, label in OBJECTIVES.items():
            if obj not in present:
                continue
            if obj == "scratch":
                cells = [label, "0", "0", "—"]
            else:
                pflops, steps = self._compute(results, obj)
                walls = [r["wall_seconds"] for r in results.rows if r["sweep"] == "pretrain" and r["status"] == "done"
                         and r["params"].get("objective.name") == obj and r.get("wall_seconds") is not None]
                cells = [label, "—" if steps is None else f"{steps:.0f}", fmt(pflops, 3), fmt(stats(walls)[0], 3)]
            for s in sweeps:
                main, other = (self._values(results, s, obj, TASKS[s][m]) for m in ("metric", "other"))
                cells.append(f"{fmt_stats(main)} ({TASKS[s]['other'].split('.')[-1]} {fmt_stats(other)}; "
                             f"{len(main)} runs)")
            lines.append("| " + " | ".join(cells) + " |")
        flops = results.inputs.get("flops", {})
        if flops:
            lines += ["", "Counted GFLOPs per training step: " + ", ".join(
                f"{OBJECTIVES[o]} {flops[o] / 1e9:.3g}" for o in ("mlm", "electra") if o in flops)
                + "; ELECTRA's steps are masked LM's x their ratio, so both pretraining runs do the same FLOPs "
                "(wall s: a pretraining run's wall time, which FLOPs do not capture)."]
        electra = results.find({"objective.name": "electra"}, sweep="pretrain")
        rtd = electra["metrics"].get("eval.rtd_acc", {}).get("values", []) if electra else []
        if rtd:
            lines += ["", f"ELECTRA's replaced-token detection accuracy on its held-out blocks: {fmt_stats(rtd)}; "
                      "answering \"original\" everywhere scores the share of tokens not replaced, at least 0.85 with "
                      "15 % of them masked, so a value there means the discriminator learned little."]
        return "\n".join(lines)

    def figure(self, results: Results, path: Path) -> Path | None:
        from matplotlib.figure import Figure

        from ..io.outputs import write_atomic

        sweeps = [s for s in TASKS if s in results.sweeps]
        if not sweeps:
            return None
        fig = Figure(figsize=(4.0 * len(sweeps), 3.8), layout="constrained")
        axes = fig.subplots(1, len(sweeps), squeeze=False)[0]
        short = {"mlm": "masked LM", "electra": "ELECTRA", "scratch": "no pretraining"}
        for ax, sweep in zip(axes, sweeps):
            present = [o for o in OBJECTIVES if self._values(results, sweep, o)]
            for i, obj in enumerate(present):
                values = self._values(results, sweep, obj)
                mean, std = stats(values)
                ax.bar(i, mean, yerr=std or 0.0, capsize=4, color=f"C{list(OBJECTIVES).index(obj)}", alpha=0.7)
                ax.plot([i] * len(values), values, "k.", markersize=5)
            ax.set_xticks(range(len(present)), [short[o] for o in present])
            ax.set_title(TASKS[sweep]["label"], fontsize=9)
            ax.grid(alpha=0.3, axis="y")
        fig.suptitle("Finetuned at equal pretraining FLOPs (mean ± std; dots: runs)", fontsize=10)
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))
        return path


EXPERIMENT = MlmVsElectra()
