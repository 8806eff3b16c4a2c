"""``pretune experiment warmup-batch``: learning-rate warmup and batch size in pretraining (lecture 000, "How to
(pre)train your transformer?": Popel & Bojar 2018, Training Tips for the Transformer Model, Figures 5 and 8).

A small GPT-2-style decoder (pre-norm, no dropout) is pretrained with causal LM on the bundled corpus, 128-token
blocks, AdamW with a cosine schedule and, as in the Tensor2Tensor Transformer recipe Popel & Bojar trained, no
gradient clipping (clipping at norm 1 hides most of what warmup does at this scale). Two questions, each its own
sweep(s) over seeds:

* ``warmup``: no warmup vs a linear warmup over the first 10 % of the steps, at a high peak learning rate (3e-2,
  ten times the rate the batch sweeps use); the held-out loss at the end.
* ``batch-N``: batch sizes at a fixed number of training examples (sequences) seen: each batch size runs
  examples / N steps (a sweep per batch size, since the steps follow it), the same learning rate and a warmup over
  10 % of its steps; the held-out loss at the end.

The held-out loss is the run's own evaluation (``eval.loss``) on the same blocks for every trial: the last 2 % of
each corpus file's documents, never trained on.
"""

from __future__ import annotations

from pathlib import Path

from .base import CONFIRMED, NOT_CONFIRMED, Claim, Experiment, Finding, Results, Sweep, beats, fmt_stats, stats

METRIC = "eval.loss"
CORPUS = ("enwiki_sample.txt.gz", "austen_emma_pride.txt.gz", "web_bible_gospels.txt.gz", "mobydick_ch1-20.txt.gz")
BLOCK = 128  # tokens per training block (the model's max_seq_len)
WARMUP_SHARE = 0.1  # warmup steps as a share of a run's steps
# size -> corpus files, held-out share of each file's documents, BPE vocabulary, model, the warmup sweep's steps,
# batch, high learning rate and warmup steps; the batch sizes, the examples each of them sees and their learning
# rate; held-out blocks; seeds
RECIPES = {
    "fast": dict(corpus=("mobydick_ch1-20.txt.gz",), heldout=0.1, vocab=384,
                 model=dict(n_layers=2, dim=32, n_heads=2, ffn_dim=64), warmup_steps=8, warmup_batch=8,
                 high_lr=[3e-2], warmups=[0, 2], batch_sizes=[4, 8], examples=32, batch_lr=3e-3, eval_max=8,
                 seeds=[0, 1], precision="fp32"),
    "default": dict(corpus=CORPUS, heldout=0.02, vocab=1024, model=dict(n_layers=4, dim=128, n_heads=4, ffn_dim=512),
                    warmup_steps=500, warmup_batch=16, high_lr=[3e-2], warmups=[0, 50], batch_sizes=[8, 16, 32, 64],
                    examples=8000, batch_lr=3e-3, eval_max=64, seeds=[0, 1, 2], precision="fp32"),
    "large": dict(corpus=CORPUS, heldout=0.02, vocab=4096, model=dict(n_layers=6, dim=256, n_heads=8, ffn_dim=1024),
                  warmup_steps=4000, warmup_batch=32, high_lr=[3e-3, 1e-2, 3e-2], warmups=[0, 100, 400, 1600],
                  batch_sizes=[8, 16, 32, 64, 128, 256], examples=128000, batch_lr=1e-3, eval_max=256,
                  seeds=[0, 1, 2], precision="auto"),
}


class WarmupBatch(Experiment):
    name = "warmup-batch"
    title = "Learning-rate warmup and batch size"
    claim = ("Warmup stabilises training at a high learning rate: without it the loss ends higher; and batch size is "
             "crucial for the training: at the same number of examples seen, batch sizes end at different losses.")
    source = ("lecture 000 (How to (pre)train your transformer?: \"Batch size is crucial for the training\", \"As is "
              "the warmup\"; seeds/000_38ade92d524102bd.txt); Popel & Bojar 2018, Training Tips for the Transformer "
              "Model, Figures 5 and 8")
    claims = (
        Claim("warmup-helps-at-high-lr", "At a high peak learning rate, a linear warmup ends at a lower held-out "
              "loss than no warmup.",
              "confirmed when, at the highest learning rate of the warmup sweep, no warmup's mean held-out loss "
              "exceeds that of the best warmup by more than 2 x the pooled standard deviation over seeds, or when "
              "runs without warmup diverge (a non-finite loss stops them) and none with a warmup does"),
        Claim("batch-size-matters", "At a fixed number of training examples, the batch size changes the held-out "
              "loss the model ends at.",
              "confirmed when the mean held-out losses of the best and the worst batch size differ by more than 2 x "
              "their pooled standard deviation over seeds (the direction is reported, not claimed: Popel & Bojar "
              "compare at equal training time on a GPU, where a larger batch also sees more examples)"),
    )
    sizes = {
        "fast": "Moby Dick only, a 2-layer 32-wide decoder, 8 steps of 8 x 128 tokens with warmup 0 / 2 at lr 3e-2, "
                "batch 4 and 8 at 32 examples, 2 seeds (8 trials; ~20 s)",
        "default": "the whole bundled corpus, BPE 1024, a 4-layer 128-wide decoder (0.9M parameters), no gradient "
                   "clipping: warmup 0 / 50 of 500 steps of 16 x 128 tokens at lr 3e-2; batch 8 / 16 / 32 / 64 at "
                   "8000 examples (1000 / 500 / 250 / 125 steps) at lr 3e-3; 64 held-out blocks; seeds 0-2 (18 trials "
                   "of about 75 s of one core each, two at a time; about 12 minutes on 2 CPU cores in fp32)",
        "large": "BPE 4096, a 6-layer 256-wide decoder: warmup 0 / 100 / 400 / 1600 of 4000 steps of 32 at lr 3e-3, "
                 "1e-2 and 3e-2; batch 8 to 256 at 128000 examples; seeds 0-2 (hours on 2 CPU cores: a GPU or a "
                 "bigger machine)",
    }
    metric = METRIC
    figure_name = "warmup-batch"

    # ------------------------------------------------------------------------------------------
    # inputs: the corpus split into training and held-out text, a tokenizer, the token stores
    # ------------------------------------------------------------------------------------------
    def prepare(self, size: str, folder: Path, log=print) -> dict:
        from .. import bundled
        from ..data.readers import iter_documents
        from ..io.outputs import write_atomic
        from ..io.tokenization import Tokenizer, train_tokenizer
        from ..jobs.pretrain import build_token_store
        from ..runconfig import RunConfig

        r = RECIPES[size]
        folder.mkdir(parents=True, exist_ok=True)
        paths = {"train": folder / "train.txt", "heldout": folder / "heldout.txt",
                 "tokenizer": folder / "tokenizer.json", "store": folder / "store"}
        if not (paths["train"].is_file() and paths["heldout"].is_file()):
            train, held = [], []
            for name in r["corpus"]:
                docs = list(iter_documents([bundled.path(f"corpus/{name}")]))
                n_held = round(len(docs) * r["heldout"]) if len(docs) >= 20 else 0  # the Gospels: 2 documents
                train += docs[:len(docs) - n_held]
                held += docs[len(docs) - n_held:]
            write_atomic(paths["heldout"], "\n\n".join(held) + "\n", fsync=False)
            write_atomic(paths["train"], "\n\n".join(train) + "\n", fsync=False)
            log(f"warmup-batch: {len(train)} training and {len(held)} held-out documents -> {folder}")
        if not paths["tokenizer"].is_file():
            train_tokenizer([paths["train"]], kind="bpe", vocab_size=r["vocab"],
                            show_progress=False).save(paths["tokenizer"])
        # the token stores every trial reads (built once here: trials running at once must not build them together)
        tok = Tokenizer.load(paths["tokenizer"])
        for split in ("train", "heldout"):
            build_token_store(RunConfig(), tok, [str(paths[split].resolve())],
                              paths["store"] / ("train" if split == "train" else "eval"), show_progress=False)
        return {k: str(p.resolve()) for k, p in paths.items()}

    def _spec(self, size: str, inputs: dict, *, steps: int, batch_size: int, lr, warmup, seeds: list[int]) -> dict:
        """A pretraining sweep: ``lr`` and ``warmup`` are a value or a list (a grid over it)."""
        r = RECIPES[size]
        grid = {key: value for key, value in (("train.lr", lr), ("train.warmup_steps", warmup))
                if isinstance(value, list)}
        fixed = {key.split(".")[1]: value for key, value in (("train.lr", lr), ("train.warmup_steps", warmup))
                 if not isinstance(value, list)}
        return {
            "command": "pretrain",
            "base": {"model": {"preset": "gpt2", **r["model"], "max_seq_len": BLOCK, "dropout": 0.0,
                               "attn_dropout": 0.0},
                     "objective.name": "clm", "tokenizer": inputs["tokenizer"],
                     "data": {"train": [inputs["train"]], "eval": [inputs["heldout"]], "store": inputs["store"],
                              "eval_max": r["eval_max"]},
                     "train": {"steps": steps, "batch_size": batch_size, **fixed, "schedule": "cosine",
                               "min_lr_ratio": 0.1, "beta2": 0.95, "weight_decay": 0.1, "clip": 0.0,
                               "eval_every": max(1, steps // 4), "log_every": max(1, steps // 50), "save_every": 0,
                               "keep_last": 0, "precision": r["precision"], "plot": False, "tensorboard": False}},
            "grid": grid,
            "seeds": seeds,
            "metrics": [METRIC, "train.loss"],
        }

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        out = [Sweep("warmup", self._spec(size, inputs, steps=r["warmup_steps"], batch_size=r["warmup_batch"],
                                          lr=list(r["high_lr"]), warmup=list(r["warmups"]), seeds=r["seeds"]))]
        for b in r["batch_sizes"]:
            steps = max(1, r["examples"] // b)
            out.append(Sweep(f"batch-{b}", self._spec(size, inputs, steps=steps, batch_size=b, lr=r["batch_lr"],
                                                      warmup=round(WARMUP_SHARE * steps), seeds=r["seeds"])))
        return out

    # ------------------------------------------------------------------------------------------
    # the verdicts
    # ------------------------------------------------------------------------------------------
    def _batches(self, results: Results) -> dict[int, list[float]]:
        """batch size -> the held-out loss of each finished seed, in the recipe's order."""
        return {int(name.split("-", 1)[1]): results.values(METRIC, {}, sweep=name)
                for name in results.sweeps if name.startswith("batch-")}

    def findings(self, results: Results) -> list[Finding]:
        r = RECIPES[results.size]
        lr = max(r["high_lr"])
        by_warmup = {w: results.values(METRIC, {"train.lr": lr, "train.warmup_steps": w}, sweep="warmup")
                     for w in r["warmups"]}
        diverged = {w: _diverged(results, lr, w) for w in r["warmups"]}
        # a warmup none of whose seeds diverged, with finished trials: the candidates for "with warmup"
        with_warmup = {w: v for w, v in by_warmup.items() if w and v and not diverged[w]}
        head = f"lr {lr:g}, {r['warmup_steps']} steps: "
        if diverged[0] and with_warmup:  # Popel & Bojar's failure: without warmup the training diverges
            best = min(with_warmup, key=lambda w: stats(with_warmup[w])[0])
            first = Finding(self.claims[0], CONFIRMED,
                            f"{head}without warmup {diverged[0]} seed(s) diverged (a non-finite loss stopped the run; "
                            f"the others ended at {fmt_stats(by_warmup[0])}); with warmup {best} none did, held-out "
                            f"loss {fmt_stats(with_warmup[best])}")
        elif not by_warmup.get(0) or not with_warmup:
            first = Finding(self.claims[0], NOT_CONFIRMED, f"not measured: the warmup sweep at lr {lr:g} has no "
                            "finished trial without warmup or with one (none diverged)"
                            if not any(diverged.values()) else
                            f"{head}diverged seeds by warmup: " + ", ".join(f"{w}: {n}" for w, n in diverged.items()))
        else:
            best = min(with_warmup, key=lambda w: stats(with_warmup[w])[0])
            ok, margin, spread, words = beats(with_warmup[best], by_warmup[0], higher_is_better=False)
            first = Finding(self.claims[0], CONFIRMED if ok else NOT_CONFIRMED,
                            f"{head}held-out loss without warmup {fmt_stats(by_warmup[0])}, with warmup {best} "
                            f"{fmt_stats(with_warmup[best])}; {words}", margin, spread)
        batches = {b: v for b, v in self._batches(results).items() if v}
        if len(batches) < 2:
            second = Finding(self.claims[1], NOT_CONFIRMED, "not measured: fewer than two batch sizes finished")
        else:
            best = min(batches, key=lambda b: stats(batches[b])[0])
            worst = max(batches, key=lambda b: stats(batches[b])[0])
            ok, margin, spread, words = beats(batches[best], batches[worst], higher_is_better=False)
            order = " < ".join(str(b) for b in sorted(batches, key=lambda b: stats(batches[b])[0]))
            second = Finding(self.claims[1], CONFIRMED if ok else NOT_CONFIRMED,
                             f"{r['examples']} examples: held-out loss by batch size "
                             + ", ".join(f"{b}: {fmt_stats(v)}" for b, v in batches.items())
                             + f" (lowest first: {order}); best {best} vs worst {worst}: {words}", margin, spread)
        return [first, second]

    # ------------------------------------------------------------------------------------------
    # the table and the figure
    # ------------------------------------------------------------------------------------------
    def table(self, results: Results) -> str:
        r = RECIPES[results.size]
        lines = [f"Warmup ({r['warmup_steps']} steps of {r['warmup_batch']} x {BLOCK} tokens, cosine, no clipping):",
                 "", "| peak lr | warmup steps | seeds | held-out loss | last training loss | diverged |",
                 "|---|---|---|---|---|---|"]
        for s in results.settings("warmup"):
            lr, w = s["params"].get("train.lr"), s["params"].get("train.warmup_steps")
            lines.append(f"| {lr} | {w} | {len(s['seeds'])} | {fmt_stats(s['metrics'][METRIC]['values'])} | "
                         f"{fmt_stats(s['metrics']['train.loss']['values'])} | {_diverged(results, lr, w)} |")
        lines += ["", f"Batch size at {r['examples']} training examples (lr {r['batch_lr']:g}, warmup "
                  f"{WARMUP_SHARE:.0%} of the steps):", "",
                  "| batch size | steps | seeds | held-out loss | last training loss |", "|---|---|---|---|---|"]
        for name in results.sweeps:
            if not name.startswith("batch-"):
                continue
            b = int(name.split("-", 1)[1])
            for s in results.settings(name):
                lines.append(f"| {b} | {max(1, r['examples'] // b)} | {len(s['seeds'])} | "
                             f"{fmt_stats(s['metrics'][METRIC]['values'])} | "
                             f"{fmt_stats(s['metrics']['train.loss']['values'])} |")
        return "\n".join(lines)

    def figure(self, results: Results, path: Path) -> Path | None:
        import json

        from matplotlib.figure import Figure

        from ..io.outputs import write_atomic

        r = RECIPES[results.size]
        lr = max(r["high_lr"])
        fig = Figure(figsize=(10, 4), layout="constrained")
        left, right = fig.subplots(1, 2)
        # left: the training loss of every warmup trial at the highest lr (a colour per warmup, a style per seed)
        res = results.sweeps.get("warmup")
        for row in res.rows if res is not None else []:
            if row["status"] != "done" or row["params"].get("train.lr", lr) != lr:
                continue
            w = row["params"].get("train.warmup_steps", 0)
            curve = _train_curve(res.out / "trials" / row["trial"] / "metrics.jsonl", json)
            if curve:
                xs, ys = zip(*curve)
                color = f"C{r['warmups'].index(w) if w in r['warmups'] else 0}"
                left.plot(xs, ys, color=color, linewidth=1, alpha=0.8,
                          linestyle=("-", "--", ":", "-.")[r["seeds"].index(row["seed"]) % 4],
                          label=f"warmup {w}" if row["seed"] == r["seeds"][0] else None)
        left.set(xlabel="step", ylabel="training loss", title=f"Warmup at peak lr {lr:g} (one line per seed)")
        left.grid(alpha=0.3)
        left.legend(fontsize=8)
        # right: held-out loss by batch size at a fixed number of examples
        pts = [(b, *stats(v)) for b, v in self._batches(results).items()]
        pts = [(b, m, sd or 0.0) for b, m, sd in pts if m is not None]
        if pts:
            xs, ms, sds = zip(*pts)
            right.errorbar(xs, ms, yerr=sds, marker="o", capsize=3)
            right.set_xscale("log", base=2)
            right.set_xticks(xs, [str(x) for x in xs])
        right.set(xlabel="batch size (log scale)", ylabel="held-out loss",
                  title=f"Batch size at {r['examples']} examples (mean ± std over seeds)")
        right.grid(alpha=0.3)
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))
        return path


def _diverged(results: Results, lr: float, warmup: int) -> int:
    """The warmup sweep's trials at (lr, warmup) that a non-finite loss stopped (``TrainingDiverged``)."""
    return sum(r["sweep"] == "warmup" and r["status"] == "failed" and "non-finite loss" in (r.get("error") or "")
               and r["params"].get("train.lr") == lr and r["params"].get("train.warmup_steps") == warmup
               for r in results.rows)


def _train_curve(path: Path, json) -> list[tuple[int, float]]:
    """(step, training loss) of every logged training record of a run's metrics.jsonl."""
    out = []
    try:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("split") == "train" and rec.get("loss") is not None:
                out.append((rec["step"], rec["loss"]))
    except (OSError, ValueError):
        return []
    return out


EXPERIMENT = WarmupBatch()
