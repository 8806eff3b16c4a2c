"""``pretune experiment ffn-variants``: the FFN variants of Shazeer 2020 at equal parameter count.

The same small GPT-2-style decoder (pre-norm, no biases, as T5 and Shazeer's models have none, so parameter counts
match exactly) is pretrained with causal LM on the bundled corpus with each FFN of ``model.ffn``: the original
``act(xW1)W2`` with ReLU, GELU or Swish, and the gated ``(act(xW) * xV)W2`` with sigmoid (GLU), none (Bilinear),
ReLU (ReGLU), GELU (GEGLU) or Swish (SwiGLU). A gated FFN has three weight matrices instead of two, so its
``ffn_dim`` is 2/3 of the others' (Shazeer 2020 §2: d_ff 3072 -> 2048) and every variant has the same number of
parameters. Two pretraining sweeps (``ungated``, ``gated``: the same base but for ``model.ffn_dim``) score each
model's loss on the same held-out text (the last documents of each corpus file, never trained on); a third
(``downstream``) finetunes each pretrained model, with the seed it was pretrained with, on the bundled SMS spam
task (test macro-F1). Shazeer pretrained T5 with span corruption; a causal LM is used here because at laptop scale
it learns from every token (a masked LM from 15 % of them), so a few hundred steps get past the unigram plateau.
"""

from __future__ import annotations

from pathlib import Path

from .base import CONFIRMED, NOT_CONFIRMED, Claim, Experiment, Finding, Results, Sweep, beats, fmt_stats, stats
from .corpus import (
    CORPUS,
    downstream_name,
    downstream_spec,
    link_pretrained,
    pretraining_inputs,
    task_files,
    trial_models,
)

# model.ffn -> (label, gated?), in Shazeer's Table 1 order (the names of pretune.model.layers.FFNS)
VARIANTS = {"relu": ("ReLU", False), "gelu": ("GELU", False), "swish": ("Swish", False), "glu": ("GLU", True),
            "bilinear": ("Bilinear", True), "reglu": ("ReGLU", True), "geglu": ("GEGLU", True),
            "swiglu": ("SwiGLU", True)}
GLU_CLAIMED = ("geglu", "swiglu", "reglu")  # the variants the claim names (Shazeer's best three)
LOSS = "eval.lm_loss"  # the run's own evaluation on the held-out text (data.eval: the same blocks in every trial)
DOWNSTREAM = "test.macro_f1"
# size -> corpus files, held-out share of each file's documents, BPE vocabulary, model (ffn_dim: the ungated width;
# gated: 2/3 of it), steps, batch, lr, warmup, held-out blocks, variants, seeds, the downstream finetuning
RECIPES = {
    "fast": dict(corpus=("mobydick_ch1-20.txt.gz",), heldout=0.1, vocab=384,
                 model=dict(n_layers=2, dim=32, n_heads=2, max_seq_len=64), ffn_dim=96, steps=8, batch_size=8,
                 lr=3e-3, warmup=2, eval_max=8, variants=["relu", "swiglu"], seeds=[0, 1], precision="fp32",
                 task_records={"train": 96, "dev": 40, "test": 40}, ft=dict(max_len=32, epochs=1, batch_size=32,
                                                                           lr=1e-3)),
    "default": dict(corpus=CORPUS, heldout=0.02, vocab=4096, model=dict(n_layers=4, dim=128, n_heads=4,
                                                                        max_seq_len=128),
                    ffn_dim=512, steps=300, batch_size=16, lr=3e-3, warmup=30, eval_max=128, variants=list(VARIANTS),
                    seeds=[0, 1, 2], precision="fp32", task_records=None,
                    ft=dict(max_len=64, epochs=1, batch_size=32, lr=1e-3)),
    "large": dict(corpus=CORPUS, heldout=0.02, vocab=8192, model=dict(n_layers=6, dim=256, n_heads=8, max_seq_len=128),
                  ffn_dim=1024, steps=4000, batch_size=32, lr=1e-3, warmup=400, eval_max=256, variants=list(VARIANTS),
                  seeds=[0, 1, 2], precision="auto", task_records=None,
                  ft=dict(max_len=64, epochs=2, batch_size=32, lr=1e-3)),
}


def gated_dim(ffn_dim: int) -> int:
    """The inner width of a gated FFN with the parameters of an ungated one of ``ffn_dim``: 3 d f' = 2 d f."""
    return round(ffn_dim * 2 / 3)


def ffn_parameters(variant: str, dim: int, ffn_dim: int) -> int:
    """Weights of one FFN block (no biases): 2 d f ungated, 3 d f' gated (f' = 2f/3)."""
    gated = VARIANTS[variant][1]
    return (3 * dim * gated_dim(ffn_dim)) if gated else 2 * dim * ffn_dim


class FfnVariants(Experiment):
    name = "ffn-variants"
    title = "FFN variants at equal parameter count"
    claim = ("The GLU variants of the feed-forward block (GEGLU, SwiGLU, ReGLU) reach a lower pretraining loss than "
             "the ReLU FFN at the same parameter count, and score higher once finetuned.")
    source = ("lectures 000_38ade92d524102bd.txt (Your time, FFN), 002_e88de835563f8753.txt (Activations: gated FFN "
              "variants, Table 2) and 003_ffc31dd897aa412c.txt (Do Transformer Modifications Transfer?); Shazeer "
              "2020, GLU Variants Improve Transformer, Tables 1-2")
    claims = (
        Claim("glu-lower-loss", "GEGLU, SwiGLU and ReGLU each reach a lower held-out pretraining loss than ReLU at "
              "equal parameter count (Shazeer 2020 Table 1; lectures 002_e88de835563f8753.txt, "
              "003_ffc31dd897aa412c.txt).",
              "confirmed when, for each of GEGLU, SwiGLU and ReGLU, ReLU's mean held-out LM loss exceeds the "
              "variant's by more than 2 x their pooled standard deviation over seeds"),
        Claim("glu-downstream", "Finetuned on the same task, the GLU variants score higher than ReLU (Shazeer 2020 "
              "Table 2, the GLUE average; lecture 002_e88de835563f8753.txt).",
              "confirmed when the mean test macro-F1 of GEGLU, SwiGLU and ReGLU together (every seed of the three) "
              "exceeds ReLU's by more than 2 x the pooled standard deviation"),
    )
    sizes = {
        "fast": "Moby Dick only, a 2-layer 32-wide decoder, ReLU and SwiGLU, 8 steps of 8 x 64 tokens, finetuned on 96 "
                "SMS records, 2 seeds (4 + 4 trials; ~15 s on 2 free cores)",
        "default": "the whole bundled corpus (2 % of each file's documents held out), BPE 4096, a 4-layer 128-wide "
                   "decoder without biases (ffn_dim 512, gated 341: 131k FFN weights per layer each), all 8 variants, "
                   "300 steps of 16 x 128 tokens (0.6M tokens) at lr 3e-3, held-out loss on 128 x 128 tokens, then "
                   "one epoch of SMS spam (113 steps of 32 at lr 1e-3), seeds 0-2 (24 + 24 trials of about 57 s and "
                   "11 s; about 15 minutes on 2 CPU cores in fp32)",
        "large": "BPE 8192, a 6-layer 256-wide decoder (ffn_dim 1024, gated 683), 4000 steps of 32 x 128 tokens (16M "
                 "tokens), two epochs of SMS spam, seeds 0-2 (hours on 2 CPU cores: for a GPU or a bigger machine)",
    }
    metric = LOSS
    figure_name = "ffn-variants"

    # ------------------------------------------------------------------------------------------
    # what runs
    # ------------------------------------------------------------------------------------------
    def prepare(self, size: str, folder: Path, log=print) -> dict:
        r = RECIPES[size]
        inputs = pretraining_inputs(folder, corpus=r["corpus"], heldout=r["heldout"], kind="bpe", vocab=r["vocab"],
                                    log=lambda m: log(f"ffn-variants: {m}"))
        inputs.update(task_files(folder, r["task_records"]))
        targets = {}
        for sw in self._pretraining(size, inputs):
            targets.update(trial_models(sw.spec, folder.parent / sw.name, lambda p: p["model.ffn"]))
        return {**inputs, "links": link_pretrained(folder, targets)}

    def _pretraining(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        steps = r["steps"]
        out = []
        for sweep, gated in (("ungated", False), ("gated", True)):
            variants = [v for v in r["variants"] if VARIANTS[v][1] == gated]
            if not variants:
                continue
            width = gated_dim(r["ffn_dim"]) if gated else r["ffn_dim"]
            spec = {
                "command": "pretrain",
                "base": {"model": {"preset": "gpt2", **r["model"], "ffn_dim": width, "bias": False, "dropout": 0.0,
                                   "attn_dropout": 0.0},
                         "objective.name": "clm", "tokenizer": inputs["tokenizer"],
                         "data": {"train": [inputs["train"]], "eval": [inputs["heldout"]], "store": inputs["store"],
                                  "eval_max": r["eval_max"]},
                         "train": {"steps": steps, "batch_size": r["batch_size"], "lr": r["lr"],
                                   "warmup_steps": r["warmup"], "schedule": "cosine", "min_lr_ratio": 0.1,
                                   "beta2": 0.95, "weight_decay": 0.1, "eval_every": max(1, steps // 4),
                                   "save_every": max(1, steps // 2), "keep_last": 1 if size != "fast" else 0,
                                   "precision": r["precision"], "plot": False, "tensorboard": False}},
                "grid": {"model.ffn": variants},
                "seeds": r["seeds"],
                "metrics": [LOSS, "eval.lm_ppl"],
            }
            out.append(Sweep(sweep, spec))
        return out

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        down = downstream_spec(inputs["links"], list(r["variants"]), inputs, seeds=r["seeds"],
                               precision=r["precision"], **r["ft"])
        return [*self._pretraining(size, inputs), Sweep("downstream", down)]

    # ------------------------------------------------------------------------------------------
    # the verdicts
    # ------------------------------------------------------------------------------------------
    def _loss(self, results: Results, variant: str) -> list[float]:
        return results.values(LOSS, {"model.ffn": variant})

    def _downstream(self, results: Results, variant: str, metric: str = DOWNSTREAM) -> list[float]:
        for s in results.settings("downstream"):
            if downstream_name(s["params"]) == variant and metric in s["metrics"]:
                return list(s["metrics"][metric]["values"])
        return []

    def findings(self, results: Results) -> list[Finding]:
        relu = self._loss(results, "relu")
        parts, ok_all, margins, spreads = [], True, [], []
        for v in GLU_CLAIMED:
            values = self._loss(results, v)
            ok, margin, spread, words = beats(values, relu, higher_is_better=False)
            ok_all &= ok
            margins.append(margin)
            spreads.append(spread)
            parts.append(f"{VARIANTS[v][0]} {fmt_stats(values)}: {words}")
        found = [Finding(self.claims[0], CONFIRMED if ok_all else NOT_CONFIRMED,
                         f"held-out LM loss, ReLU {fmt_stats(relu)} over {len(relu)} seeds; " + "; ".join(parts),
                         _least(margins), _most(spreads))]
        relu_down = self._downstream(results, "relu")
        glu_down = [x for v in GLU_CLAIMED for x in self._downstream(results, v)]
        measured = [VARIANTS[v][0] for v in GLU_CLAIMED if self._downstream(results, v)]
        ok, margin, spread, words = beats(glu_down, relu_down)
        found.append(Finding(self.claims[1], CONFIRMED if ok else NOT_CONFIRMED,
                             f"test macro-F1, GLU variants ({', '.join(measured) or 'none measured'}) "
                             f"{fmt_stats(glu_down)} over {len(glu_down)} runs vs ReLU {fmt_stats(relu_down)} over "
                             f"{len(relu_down)}; {words}", margin, spread))
        return found

    def table(self, results: Results) -> str:
        r = RECIPES.get(results.size, RECIPES["default"])
        dim = r["model"]["dim"]
        lines = ["| FFN | gated | ffn_dim | FFN weights / layer | seeds | held-out LM loss | held-out ppl | "
                 "downstream test macro-F1 | test accuracy |", "|---|---|---|---|---|---|---|---|---|"]
        for v, (label, gated) in VARIANTS.items():
            s = results.find({"model.ffn": v})
            if s is None:
                continue
            width = gated_dim(r["ffn_dim"]) if gated else r["ffn_dim"]
            weights = ffn_parameters(v, dim, r["ffn_dim"])
            lines.append(f"| {label} | {'yes' if gated else 'no'} | {width} | {weights:,} | {len(s['seeds'])} | "
                         f"{fmt_stats(s['metrics'][LOSS]['values'])} | "
                         f"{fmt_stats(s['metrics']['eval.lm_ppl']['values'])} | "
                         f"{fmt_stats(self._downstream(results, v))} | "
                         f"{fmt_stats(self._downstream(results, v, 'test.accuracy'))} |")
        lines += ["", "Held-out loss: the causal-LM loss of each pretrained model on the same held-out blocks (never "
                  "trained on); downstream: that model finetuned on SMS spam with the seed it was pretrained with."]
        return "\n".join(lines)

    def figure(self, results: Results, path: Path) -> Path | None:
        from matplotlib.figure import Figure

        from ..io.outputs import write_atomic

        fig = Figure(figsize=(9, 3.8), layout="constrained")
        axes = fig.subplots(1, 2)
        panels = ((axes[0], "held-out LM loss (lower is better)", self._loss),
                  (axes[1], "downstream test macro-F1 (higher is better)", self._downstream))
        for ax, label, values_of in panels:
            shown = [(v, values_of(results, v)) for v in VARIANTS]
            shown = [(v, vals) for v, vals in shown if vals]
            for i, (v, vals) in enumerate(shown):
                mean, sd = stats(vals)
                color = "C1" if VARIANTS[v][1] else "C0"
                ax.errorbar(i, mean, yerr=sd or 0.0, fmt="o", markersize=7, capsize=4, color=color)
                ax.plot([i] * len(vals), vals, "k.", markersize=3, alpha=0.6)
            ax.set_xticks(range(len(shown)))
            ax.set_xticklabels([VARIANTS[v][0] for v, _ in shown], rotation=45, ha="right")
            low = [min(vals) for _, vals in shown]
            high = [max(vals) for _, vals in shown]
            if low:
                pad = (max(high) - min(low)) * 0.3 or 0.01
                ax.set_ylim(min(low) - pad, max(high) + pad)
            ax.set(ylabel=label)
            ax.grid(alpha=0.3, axis="y")
        fig.suptitle("FFN variants at equal parameter count (ungated blue, gated orange; mean ± std, dots: seeds)")
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))
        return path


def _least(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def _most(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


EXPERIMENT = FfnVariants()
