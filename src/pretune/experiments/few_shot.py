"""``pretune experiment few-shot``: few-shot prompting's sensitivities (lecture 000, "Prompting (manual)").

SmolLM2-135M-Instruct classifies WordNet glosses of four noun supersenses (``noun.person``, ``noun.artifact``,
``noun.animal``, ``noun.plant`` of the bundled ``wordnet_supersense`` task: "Definition: <gloss>\\nCategory:
<word>") with ``pretune prompt``, no training: the label word with the highest likelihood wins. Demonstrations
are drawn, balanced over the four labels, from the training split (each sweep seed is one set of examples); the
evaluation records are the dev and test records of those labels. Four sweeps, each varying one thing around the
same prompt:

* ``shots``: 0 / 1 / 4 / 8 demonstrations (the label names as label words, gold labels);
* ``order``: the same 4 examples in several orders (``--order-seed``), for a few example sets;
* ``label-words``: other label words than the names in plain words (person / object / animal / plant): the
  supersense names as they are (artifact for object) and arbitrary words (north / south / east / west), 4 shots;
* ``random-labels``: the same demonstrations with labels drawn uniformly from the label set (``--random-labels``,
  Min et al. 2022), at 4 and 8 shots.

Min et al. 2022, Rethinking the Role of Demonstrations; Zhao et al. 2021, Calibrate Before Use (order and label-word
sensitivity); Lu et al. 2022, Fantastically Ordered Prompts.
"""

from __future__ import annotations

import json
import math
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
    fmt,
    fmt_stats,
    realmodel,
    stats,
    tiny_decoder,
)

TASK = "tasks/wordnet_supersense"
METRIC = "metrics.accuracy"
TEMPLATE = "Definition: {text}\\nCategory: {label}"  # \n: pretune prompt turns it into a newline
# label -> word: the labels' names in plain words (the prompt every sweep starts from), the supersense names as they
# are (noun.artifact -> "artifact"), and arbitrary words with no link to the categories
WORDS = {
    "names": {"noun.person": "person", "noun.artifact": "object", "noun.animal": "animal", "noun.plant": "plant"},
    "supersenses": {"noun.person": "person", "noun.artifact": "artifact", "noun.animal": "animal",
                    "noun.plant": "plant"},
    "arbitrary": {"noun.person": "north", "noun.artifact": "south", "noun.animal": "east", "noun.plant": "west"},
}
WORD_LABELS = {"names": "label names", "supersenses": "supersense names", "arbitrary": "arbitrary words"}
LABELS = tuple(WORDS["names"])
RANDOM_TOLERANCE = 0.05  # "costs little": Min et al. 2022 report drops of 0-5 % absolute (§4.1, Figure 3)
RANDOM_MAX_SPREAD = 0.05  # the paired differences' std above which a match cannot be told from a miss
# size -> the model, evaluation records per label (0: all of them), shot counts, the shot count the order / label
# word sweeps use, order seeds and the example sets they reorder, the other label words, the shot counts with random
# labels, seeds
RECIPES = {
    "fast": dict(model="tiny", eval_per_label=5, shots=[0, 1, 2], base_shots=2, orders=[0, 1], order_sets=[0, 1],
                 words=["arbitrary"], random_shots=[2], seeds=[0, 1]),
    "default": dict(model="smollm2", eval_per_label=0, shots=[0, 1, 4, 8], base_shots=4, orders=[0, 1, 2, 3, 4],
                    order_sets=[0, 1, 2], words=["supersenses", "arbitrary"], random_shots=[4, 8],
                    seeds=[0, 1, 2, 3, 4, 5]),
    "large": dict(model="smollm2", eval_per_label=0, shots=[0, 1, 2, 4, 8, 16], base_shots=4,
                  orders=list(range(10)), order_sets=[0, 1, 2, 3, 4], words=["supersenses", "arbitrary"],
                  random_shots=[4, 8, 16], seeds=list(range(10))),
}


class FewShot(Experiment):
    name = "few-shot"
    title = "Few-shot prompting: shots, order, label words, random labels"
    claim = ("In-context learning is fragile: accuracy changes with the order of the same demonstrations and with "
             "the label words; random labels in the demonstrations cost little compared with gold labels (Min et "
             "al. 2022); more demonstrations help up to a point.")
    source = ("lecture 000 (Prompting (manual): Prompt Format Matters, Example order is suspiciously too important, "
              "True Labels Do Not Matter; seeds/000_38ade92d524102bd.txt); Min et al. 2022, Rethinking the Role of "
              "Demonstrations; Zhao et al. 2021, Calibrate Before Use")
    claims = (
        Claim("order-matters", "The same demonstrations in another order give another accuracy.",
              "confirmed when, over the example sets of the order sweep, the accuracy's standard deviation across "
              "orders of the same examples is above 0 and its range (best minus worst order, averaged over the "
              "sets) exceeds 2 x the standard error of one accuracy on the evaluation records, sqrt(p (1 - p) / n): "
              "more than re-drawing the evaluation records would move it"),
        Claim("label-words-matter", "Arbitrary label words give another accuracy than the label names.",
              "confirmed when the mean accuracy with the label names and with arbitrary words (the same "
              "demonstrations) differ, in either direction, by more than 2 x the pooled standard deviation over "
              "the example sets"),
        Claim("random-labels-cost-little", "Demonstrations with random labels score nearly as well as the same "
              "demonstrations with their gold labels.",
              "confirmed when, at every shot count of the random-label sweep, the mean shortfall of random against "
              f"gold labels (paired by example set) is at most max(2 x the std of the paired differences, "
              f"{RANDOM_TOLERANCE:g}) and that std is at most {RANDOM_MAX_SPREAD:g}"),
        Claim("more-shots-help-up-to-a-point", "Accuracy rises from zero-shot to a few shots, then stops rising.",
              "confirmed when the best shot count's mean accuracy exceeds zero-shot's by more than 2 x the pooled "
              "standard deviation, and the most shots do not beat the next fewer by more than 2 x theirs"),
    )
    sizes = {
        "fast": "a tiny random-init decoder (a test of the machinery, its numbers mean nothing), 20 evaluation "
                "records, 0 / 1 / 2 shots, 2 orders of 2 example sets, arbitrary words and random labels at 2 "
                "shots, 2 seeds (14 trials; ~25 s)",
        "default": "SmolLM2-135M-Instruct on all 166 dev + test records of the four supersenses: 0 / 1 / 4 / 8 shots "
                   "x 6 example sets, 5 orders of 3 sets of 4, the other label words at 4 shots and random labels at "
                   "4 and 8 shots x 6 sets (63 trials of about 12 s of one core each, two at a time; about 7 minutes "
                   "on 2 CPU cores in fp32)",
        "large": "0 / 1 / 2 / 4 / 8 / 16 shots x 10 example sets, 10 orders of 5 sets, the other label words at 4 "
                 "shots, random labels at 4 / 8 / 16 shots (160 trials; about 25 minutes on 2 CPU cores, minutes on "
                 "a bigger machine with --jobs)",
    }
    metric = METRIC
    figure_name = "few-shot"

    # ------------------------------------------------------------------------------------------
    # inputs: the evaluation records, the two verbalizers, the fast size's tiny model
    # ------------------------------------------------------------------------------------------
    def prepare(self, size: str, folder: Path, log=print) -> dict:
        from ..io.outputs import write_atomic
        from .base import bundled_file

        r = RECIPES[size]
        folder.mkdir(parents=True, exist_ok=True)
        evaluation = folder / "eval.jsonl"
        if not evaluation.is_file():  # the dev and test records of the four labels (fast: the first few of each)
            kept: dict[str, list[str]] = {label: [] for label in LABELS}
            for split in ("dev", "test"):
                for line in open(bundled_file(f"{TASK}/{split}.jsonl"), encoding="utf-8"):
                    label = json.loads(line)["label"] if line.strip() else None
                    if label in kept and (not r["eval_per_label"] or len(kept[label]) < r["eval_per_label"]):
                        kept[label].append(line if line.endswith("\n") else line + "\n")
            write_atomic(evaluation, "".join(line for label in LABELS for line in kept[label]), fsync=False)
        inputs = {"eval": str(evaluation.resolve()), "pool": bundled_file(f"{TASK}/train.jsonl"),
                  "n_eval": sum(1 for line in open(evaluation, encoding="utf-8") if line.strip())}
        for kind, words in WORDS.items():
            path = folder / f"words-{kind}.json"
            if not path.is_file():
                write_atomic(path, json.dumps(words, indent=1) + "\n", fsync=False)
            inputs[kind] = str(path.resolve())
        inputs["model"] = realmodel("smollm2") if r["model"] == "smollm2" else _tiny_model(folder, inputs["pool"])
        return inputs

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        base = {"model": inputs["model"], "data": inputs["eval"], "template": TEMPLATE, "verbalizer": inputs["names"],
                "shots_from": inputs["pool"], "balanced": True}
        metrics = [METRIC, "metrics.macro_f1"]

        def spec(grid: dict, seeds: list[int], **extra) -> dict:
            return {"command": "prompt", "base": {**base, **extra}, "grid": grid, "seeds": seeds, "metrics": metrics}

        k = r["base_shots"]
        return [Sweep("shots", spec({"shots": r["shots"]}, r["seeds"])),
                Sweep("order", spec({"order_seed": r["orders"]}, r["order_sets"], shots=k)),
                Sweep("label-words", spec({"verbalizer": [inputs[w] for w in r["words"]]}, r["seeds"], shots=k)),
                Sweep("random-labels", spec({"shots": r["random_shots"], "random_labels": [True]}, r["seeds"]))]

    # ------------------------------------------------------------------------------------------
    # the verdicts
    # ------------------------------------------------------------------------------------------
    def findings(self, results: Results) -> list[Finding]:
        size = RECIPES[results.size]
        return [self._order(results), self._words(results, size["base_shots"]),
                self._random(results, size["random_shots"]), self._shots(results)]

    def _order(self, results: Results) -> Finding:
        claim = self.claims[0]
        sets = _order_sets(results)
        if not sets:
            return Finding(claim, NOT_CONFIRMED, "not measured: the order sweep has no finished trial")
        n = results.inputs.get("n_eval") or 0
        ranges = [max(v) - min(v) for v in sets.values() if len(v) > 1]
        stds = [stats(v)[1] for v in sets.values() if len(v) > 1]
        if not ranges or not n:
            return Finding(claim, NOT_CONFIRMED, "not measured: no example set has two finished orders")
        p = stats([x for v in sets.values() for x in v])[0]
        se = math.sqrt(p * (1 - p) / n)
        mean_range, spread = stats(ranges)[0], stats(stds)[0]
        ok = spread > 0 and mean_range > 2 * se
        per_set = "; ".join(f"set {s}: {fmt_stats(v)} over {len(v)} orders (range {max(v) - min(v):.3g})"
                            for s, v in sets.items())
        words = (f"{per_set}. Mean range across orders {mean_range:.3g} {'>' if mean_range > 2 * se else '<='} "
                 f"2 x the standard error of an accuracy of {p:.3g} on {n} records ({2 * se:.3g}); mean std across "
                 f"orders {spread:.3g}")
        return Finding(claim, CONFIRMED if ok else NOT_CONFIRMED, words, mean_range, spread)

    def _words(self, results: Results, k: int) -> Finding:
        names = results.values(METRIC, {"shots": k}, sweep="shots")
        arbitrary = results.values(METRIC, {"verbalizer": results.inputs.get("arbitrary")}, sweep="label-words")
        supersenses = results.values(METRIC, {"verbalizer": results.inputs.get("supersenses")}, sweep="label-words")
        (m_names, _), (m_arb, _) = stats(names), stats(arbitrary)
        if m_names is not None and m_arb is not None and m_arb > m_names:
            ok, margin, spread, words = beats(arbitrary, names)
            ahead = "arbitrary words ahead"
        else:
            ok, margin, spread, words = beats(names, arbitrary)
            ahead = "label names ahead"
        return Finding(self.claims[1], CONFIRMED if ok else NOT_CONFIRMED,
                       f"{k} shots: label names ({_words_text('names')}) {fmt_stats(names)} vs arbitrary words "
                       f"({_words_text('arbitrary')}) {fmt_stats(arbitrary)} accuracy over {len(names)} / "
                       f"{len(arbitrary)} example sets; {ahead}: {words}"
                       + (f" (the supersense names, {_words_text('supersenses')}: {fmt_stats(supersenses)})"
                          if supersenses else ""), margin, spread)

    def _random(self, results: Results, shot_counts: list[int]) -> Finding:
        claim = self.claims[2]
        parts, oks, gaps, spreads = [], [], [], []
        for k in shot_counts:
            gold = _by_seed(results, "shots", {"shots": k})
            rand = _by_seed(results, "random-labels", {"shots": k})
            paired = [gold[s] - rand[s] for s in gold if s in rand]
            gap, spread = stats(paired)
            if gap is None or spread is None:
                oks.append(False)
                parts.append(f"{k} shots: {len(paired)} paired example set(s), too few for a spread")
                continue
            allowed = max(2 * spread, RANDOM_TOLERANCE)
            ok = gap <= allowed and spread <= RANDOM_MAX_SPREAD
            oks.append(ok)
            gaps.append(gap)
            spreads.append(spread)
            parts.append(f"{k} shots: gold {fmt_stats(list(gold.values()))}, random {fmt_stats(list(rand.values()))}; "
                         f"shortfall {gap:+.3g} ± {spread:.2g} over {len(paired)} paired sets "
                         f"{'<=' if gap <= allowed else '>'} max(2 x std, {RANDOM_TOLERANCE:g}) = {allowed:.3g}; std "
                         f"{'<=' if spread <= RANDOM_MAX_SPREAD else '>'} {RANDOM_MAX_SPREAD:g}")
        ok = bool(oks) and all(oks)
        return Finding(claim, CONFIRMED if ok else NOT_CONFIRMED, "; ".join(parts) or "not measured",
                       max(gaps) if gaps else None, max(spreads) if spreads else None)

    def _shots(self, results: Results) -> Finding:
        claim = self.claims[3]
        by_k = {s["params"]["shots"]: s["metrics"][METRIC]["values"] for s in results.settings("shots")}
        by_k = {k: v for k, v in sorted(by_k.items()) if v}
        if 0 not in by_k or len(by_k) < 3:
            return Finding(claim, NOT_CONFIRMED, "not measured: the shots sweep needs zero-shot and two shot counts")
        ks = [k for k in by_k if k]
        best = max(ks, key=lambda k: stats(by_k[k])[0])
        ok1, margin, spread, w1 = beats(by_k[best], by_k[0])
        more, fewer = ks[-1], ks[-2]
        still, _, _, w2 = beats(by_k[more], by_k[fewer])
        table = ", ".join(f"{k}: {fmt_stats(v)}" for k, v in by_k.items())
        words = (f"accuracy by shots {table}; best {best} shots over zero-shot: {w1}; {more} over {fewer} shots: {w2} "
                 f"({'still rising' if still else 'no further gain beyond the spread'})")
        return Finding(claim, CONFIRMED if ok1 and not still else NOT_CONFIRMED, words, margin, spread)

    # ------------------------------------------------------------------------------------------
    # the table and the figure
    # ------------------------------------------------------------------------------------------
    def table(self, results: Results) -> str:
        r = RECIPES[results.size]
        k = r["base_shots"]
        lines = ["Accuracy (macro-F1) on the evaluation records, mean ± std over the example sets (seeds):", "",
                 "| prompt | shots | example sets | accuracy | macro-F1 |", "|---|---|---|---|---|"]

        def row(label: str, shots: int, sweep: str, params: dict) -> None:
            s = results.find(params, sweep=sweep)
            if s is not None:
                lines.append(f"| {label} | {shots} | {len(s['seeds'])} | {fmt_stats(s['metrics'][METRIC]['values'])} "
                             f"| {fmt_stats(s['metrics']['metrics.macro_f1']['values'])} |")

        for shots in r["shots"]:
            row(f"label names ({_words_text('names')}), gold labels", shots, "shots", {"shots": shots})
        for kind in r["words"]:
            row(f"{WORD_LABELS[kind]} ({_words_text(kind)})", k, "label-words",
                {"verbalizer": results.inputs.get(kind)})
        for shots in r["random_shots"]:
            row("label names, random labels", shots, "random-labels", {"shots": shots})
        sets = _order_sets(results)
        if sets:
            lines += ["", f"The same {k} examples in other orders (accuracy by order seed):", "",
                      "| example set (seed) | " + " | ".join(f"order {o}" for o in r["orders"]) + " | range |",
                      "|---|" + "---|" * (len(r["orders"]) + 1)]
            for s, by_order in _order_table(results).items():
                cells = [fmt(by_order.get(o), 3) for o in r["orders"]]
                values = [v for v in by_order.values() if v is not None]
                lines.append(f"| {s} | " + " | ".join(cells) + f" | {fmt(max(values) - min(values), 3)} |")
        n = results.inputs.get("n_eval")
        lines += ["", f"{n} evaluation records; chance is about 0.25 (four labels)." if n else ""]
        return "\n".join(lines).rstrip()

    def figure(self, results: Results, path: Path) -> Path | None:
        from matplotlib.figure import Figure

        from ..io.outputs import write_atomic

        r = RECIPES[results.size]
        fig = Figure(figsize=(10, 4), layout="constrained")
        left, right = fig.subplots(1, 2)
        series = [("label names, gold labels", "shots", r["shots"], "C0", "o"),
                  ("label names, random labels", "random-labels", r["random_shots"], "C1", "s")]
        for label, sweep, counts, color, marker in series:
            pts = [(k, *stats(results.values(METRIC, {"shots": k}, sweep=sweep))) for k in counts]
            pts = [(k, m, sd or 0.0) for k, m, sd in pts if m is not None]
            if pts:
                xs, ms, sds = zip(*pts)
                left.errorbar(xs, ms, yerr=sds, marker=marker, capsize=3, color=color, label=label)
        for kind, color, marker in (("supersenses", "C4", "v"), ("arbitrary", "C2", "^")):
            mean, sd = stats(results.values(METRIC, {"verbalizer": results.inputs.get(kind)}, sweep="label-words"))
            if mean is not None:
                left.errorbar([r["base_shots"]], [mean], yerr=[sd or 0.0], marker=marker, capsize=3, color=color,
                              linestyle="none", label=f"{WORD_LABELS[kind]} ({_words_text(kind)})")
        left.axhline(0.25, color="0.6", linestyle=":", linewidth=1, label="chance (4 labels)")
        left.set(xlabel="demonstrations (shots)", ylabel="accuracy", title="Shots, label words, random labels",
                 xticks=sorted(set(r["shots"]) | set(r["random_shots"])))
        left.grid(alpha=0.3)
        left.legend(fontsize=7)
        orders = _order_table(results)
        for i, by_order in enumerate(orders.values()):
            values = [v for v in by_order.values() if v is not None]
            right.scatter([i] * len(values), values, color=f"C{i}", alpha=0.8)
        right.set(xlabel="example set (seed)", ylabel="accuracy",
                  title=f"The same {r['base_shots']} examples in {len(r['orders'])} orders")
        right.set_xticks(range(len(orders)), [str(s) for s in orders])
        right.grid(alpha=0.3)
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))
        return path


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _words_text(kind: str) -> str:
    return " / ".join(WORDS[kind].values())


def _by_seed(results: Results, sweep: str, params: dict) -> dict[int, float]:
    """seed -> the metric of each finished trial of a sweep whose parameters include ``params``."""
    return {r["seed"]: r["metrics"][METRIC] for r in results.rows
            if r["sweep"] == sweep and r["status"] == "done" and r["metrics"].get(METRIC) is not None
            and all(r["params"].get(k) == v for k, v in params.items())}


def _order_table(results: Results) -> dict[int, dict[int, float]]:
    """example set (seed) -> order seed -> accuracy, from the order sweep's finished trials."""
    out: dict[int, dict[int, float]] = {}
    for r in results.rows:
        if r["sweep"] == "order" and r["status"] == "done" and r["metrics"].get(METRIC) is not None:
            out.setdefault(r["seed"], {})[r["params"]["order_seed"]] = r["metrics"][METRIC]
    return dict(sorted(out.items()))


def _order_sets(results: Results) -> dict[int, list[float]]:
    return {s: list(v.values()) for s, v in _order_table(results).items()}


def _tiny_model(folder: Path, pool: str) -> str:
    """The fast size's model: a tiny random-init causal LM with a BPE vocabulary of the task's glosses (made once,
    reused by a rerun)."""
    def texts():
        out = [json.loads(line)["text"] for line in open(pool, encoding="utf-8") if line.strip()]
        return out + ["Definition: Category:", *(w for words in WORDS.values() for w in words.values())]

    return tiny_decoder(folder, texts, vocab_size=512, max_seq_len=1024)


EXPERIMENT = FewShot()
