"""``pretune experiment masking``: static vs dynamic masking (RoBERTa) and the masking rate (BERT's 15 %).

The same small BERT-style encoder (post-norm, as BERT) is pretrained with masked LM on a corpus small enough to be
seen several times (Austen's two novels at the default size: about three epochs), where static and dynamic masking
differ: pretune's ``objective.dynamic=false`` draws each block's mask once and shows the same one every epoch,
``true`` draws a new one each time (RoBERTa §4.1; the first epoch is the same for both). One sweep (``static``)
trains with static masks at 15 %, another (``rates``) with dynamic masks at 10 / 15 / 30 / 40 %.

Losses are compared only when measured the same way: a run's own evaluation masks its held-out blocks at its own
rate (and, static, with its own draw), so it cannot compare rates. Instead every trained model is scored here on
the same held-out blocks (the last 5 % of the documents, never trained on) with the same masks: BERT's 80/10/10
corruption of 15 % of the tokens, a few fixed draws per block (``heldout.mlm_loss``, ``heldout.mlm_acc``). That
measure favours the models trained at 15 %, so the rate's verdict is downstream only: each pretrained model is
finetuned, with the seed it was pretrained with, on the bundled SMS spam task (test macro-F1).
"""

from __future__ import annotations

import json
from pathlib import Path

from .base import CONFIRMED, NOT_CONFIRMED, Claim, Experiment, Finding, Results, Sweep, fmt, fmt_stats, matches, stats
from .corpus import downstream_name, downstream_spec, link_pretrained, pretraining_inputs, task_files, trial_models

REFERENCE_RATE = 0.15  # BERT's rate: the static sweep's, the held-out masks', the rate claim's reference
MASK_SEED = 1234  # the held-out masks' seed (every model sees the same ones)
LOSS = "heldout.mlm_loss"
DOWNSTREAM = "test.macro_f1"
# "at least as good": the shortfall within max(2 x the pooled std, the tolerance), with a pooled std of at most the
# bound (a noisier comparison cannot tell)
LOSS_TOLERANCE, LOSS_MAX_SPREAD = 0.01, 0.05  # nats of held-out MLM loss
F1_TOLERANCE, F1_MAX_SPREAD = 0.01, 0.03  # test macro-F1
# size -> corpus, held-out share, WordPiece vocabulary, model, steps, batch, lr, warmup, dynamic masking rates,
# held-out blocks and mask draws, seeds, the downstream finetuning
RECIPES = {
    "fast": dict(corpus=("mobydick_ch1-20.txt.gz",), heldout=0.1, vocab=400,
                 model=dict(n_layers=2, dim=32, n_heads=2, ffn_dim=64, max_seq_len=32), steps=8, batch_size=8,
                 lr=1e-3, warmup=2, rates=[0.15, 0.4], heldout_blocks=16, draws=1, seeds=[0, 1], precision="fp32",
                 task_records={"train": 96, "dev": 40, "test": 40},
                 ft=dict(max_len=32, epochs=1, batch_size=32, lr=1e-3)),
    "default": dict(corpus=("austen_emma_pride.txt.gz",), heldout=0.05, vocab=2048,
                    model=dict(n_layers=4, dim=128, n_heads=4, ffn_dim=512, max_seq_len=64), steps=320, batch_size=64,
                    lr=1e-3, warmup=32, rates=[0.1, 0.15, 0.3, 0.4], heldout_blocks=256, draws=4, seeds=[0, 1, 2],
                    precision="fp32", task_records=None, ft=dict(max_len=64, epochs=1, batch_size=32, lr=1e-3)),
    "large": dict(corpus=("austen_emma_pride.txt.gz",), heldout=0.05, vocab=4096,
                  model=dict(n_layers=6, dim=256, n_heads=8, ffn_dim=1024, max_seq_len=128), steps=3000,
                  batch_size=64, lr=5e-4, warmup=300, rates=[0.1, 0.15, 0.2, 0.3, 0.4], heldout_blocks=256, draws=4,
                  seeds=[0, 1, 2], precision="auto", task_records=None,
                  ft=dict(max_len=64, epochs=2, batch_size=32, lr=1e-3)),
}


def _static_name() -> str:
    return "static"


def _dynamic_name(rate: float) -> str:
    return f"dynamic-{rate:g}"


def _name_of(params: dict) -> str:
    """The link name of a pretraining setting: ``static`` or ``dynamic-<rate>``."""
    return _dynamic_name(params["objective.rate"]) if "objective.rate" in params else _static_name()


class Masking(Experiment):
    name = "masking"
    title = "Static vs dynamic masking, and the masking rate"
    claim = ("Dynamic masking (a new mask every time a sequence is seen) is at least as good as static masking "
             "(RoBERTa), and BERT's 15 % masking rate does at least as well downstream as lower or higher rates.")
    source = ("lecture 002_e88de835563f8753.txt (BERT: pick randomly 15 % of tokens; Friends of BERT: RoBERTa, "
              "dynamic masking, its static/dynamic table); Devlin et al. 2019 §3.1; Liu et al. 2019, RoBERTa, "
              "§4.1 and Table 1")
    claims = (
        Claim("dynamic-loss", "Dynamic masking reaches a held-out MLM loss at least as low as static masking "
              "(RoBERTa Table 1; lecture 002_e88de835563f8753.txt).",
              "confirmed when dynamic masking's mean held-out MLM loss (every model on the same held-out masks, 15 %) "
              f"exceeds static's by at most max(2 x the pooled standard deviation, {LOSS_TOLERANCE:g}) (lower is "
              f"fine) and that pooled standard deviation is at most {LOSS_MAX_SPREAD:g}"),
        Claim("dynamic-downstream", "Finetuned downstream, dynamic masking scores at least as well as static masking "
              "(RoBERTa Table 1: SQuAD, MNLI, SST-2; lecture 002_e88de835563f8753.txt).",
              "confirmed when dynamic masking's mean test macro-F1 falls short of static's by at most max(2 x the "
              f"pooled standard deviation, {F1_TOLERANCE:g}) (higher is fine) and that pooled standard deviation is "
              f"at most {F1_MAX_SPREAD:g}"),
        Claim("rate-15", "BERT's 15 % masking rate scores downstream at least as well as the other rates (Devlin et "
              "al. 2019; lecture 002_e88de835563f8753.txt).",
              "confirmed when, against every other rate, the 15 % models' mean test macro-F1 falls short by at most "
              f"max(2 x the pooled standard deviation, {F1_TOLERANCE:g}) with a pooled standard deviation of at most "
              f"{F1_MAX_SPREAD:g}"),
    )
    sizes = {
        "fast": "Moby Dick only, a 2-layer 32-wide encoder, static 15 % and dynamic 15 % / 40 %, 8 steps of 8 x 32 "
                "tokens, finetuned on 96 SMS records, 2 seeds (6 + 6 trials; ~22 s on 2 free cores)",
        "default": "Austen's two novels (5 % of the documents held out; 0.4M tokens), WordPiece 2048, a 4-layer "
                   "128-wide BERT encoder, 320 steps of 64 x 64 tokens (1.3M tokens: about 3 epochs) at lr 1e-3, "
                   "static 15 % and dynamic 10 / 15 / 30 / 40 %, held-out loss on 256 x 62 tokens x 4 mask draws, "
                   "then one epoch of SMS spam (113 steps of 32 at lr 1e-3), seeds 0-2 (15 + 15 trials of about 87 s "
                   "and 11 s; about 14 minutes on 2 CPU cores in fp32)",
        "large": "WordPiece 4096, a 6-layer 256-wide encoder at 128 tokens, 3000 steps of 64 (about 60 epochs), "
                 "dynamic rates 10 / 15 / 20 / 30 / 40 %, two epochs of SMS spam, seeds 0-2 (hours on 2 CPU cores: "
                 "for a GPU or a bigger machine)",
    }
    metric = LOSS
    figure_name = "masking"

    # ------------------------------------------------------------------------------------------
    # what runs
    # ------------------------------------------------------------------------------------------
    def prepare(self, size: str, folder: Path, log=print) -> dict:
        r = RECIPES[size]
        inputs = pretraining_inputs(folder, corpus=r["corpus"], heldout=r["heldout"], kind="wordpiece",
                                    vocab=r["vocab"], log=lambda m: log(f"masking: {m}"))
        inputs.update(task_files(folder, r["task_records"]))
        targets = {}
        for sw in self._pretraining(size, inputs):
            targets.update(trial_models(sw.spec, folder.parent / sw.name, _name_of))
        return {**inputs, "links": link_pretrained(folder, targets)}

    def _pretraining(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        steps = r["steps"]

        def spec(objective: dict, grid: dict) -> dict:
            return {
                "command": "pretrain",
                "base": {"model": {"preset": "bert-base", **r["model"], "dropout": 0.0, "attn_dropout": 0.0},
                         "objective": {"name": "mlm", **objective}, "tokenizer": inputs["tokenizer"],
                         "data": {"train": [inputs["train"]], "eval": [inputs["heldout"]], "store": inputs["store"],
                                  "eval_max": r["heldout_blocks"]},
                         "train": {"steps": steps, "batch_size": r["batch_size"], "lr": r["lr"],
                                   "warmup_steps": r["warmup"], "schedule": "linear", "beta2": 0.98,
                                   "weight_decay": 0.01, "eval_every": max(1, steps // 4),
                                   "save_every": max(1, steps // 2), "keep_last": 1 if size != "fast" else 0,
                                   "precision": r["precision"], "plot": False, "tensorboard": False}},
                "grid": grid,
                "seeds": r["seeds"],
                # heldout.*: measure() below (the same held-out masks for every model); eval.mlm_loss: the run's own
                "metrics": [LOSS, "heldout.mlm_acc", "eval.mlm_loss"],
            }

        return [Sweep("static", spec({"rate": REFERENCE_RATE}, {"objective.dynamic": [False]})),
                Sweep("rates", spec({"dynamic": True}, {"objective.rate": list(r["rates"])}))]

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        names = [_static_name()] + [_dynamic_name(rate) for rate in r["rates"]]
        down = downstream_spec(inputs["links"], names, inputs, seeds=r["seeds"], precision=r["precision"], **r["ft"])
        return [*self._pretraining(size, inputs), Sweep("downstream", down)]

    # ------------------------------------------------------------------------------------------
    # measuring: every model on the same held-out masks
    # ------------------------------------------------------------------------------------------
    def measure(self, size: str, sweep: Sweep, result, inputs: dict, log=print) -> bool:
        if sweep.spec["command"] != "pretrain":
            return False
        from ..io.outputs import mark, write_atomic
        from ..io.tokenization import Tokenizer
        from ..loading import load

        r = RECIPES[size]
        tok = Tokenizer.load(inputs["tokenizer"])
        block = r["model"]["max_seq_len"] - 2  # [CLS] block [SEP], as the objective lays it out
        wanted = {"rate": REFERENCE_RATE, "draws": r["draws"], "seed": MASK_SEED, "block": block,
                  "max_blocks": r["heldout_blocks"]}
        wrote = False
        blocks = None
        for row in result.rows:
            folder = result.out / "trials" / row["trial"]
            if row["status"] != "done" or _measured(folder, wanted):
                continue
            if blocks is None:
                blocks = heldout_blocks(inputs["heldout"], tok, block, r["heldout_blocks"])
            scores = heldout_mlm(load(folder / "model"), tok, blocks, rate=REFERENCE_RATE, draws=r["draws"],
                                 seed=MASK_SEED)
            out = {"heldout": {**scores, **wanted, "blocks": len(blocks)}}
            write_atomic(folder / "results.json", json.dumps(out, indent=1) + "\n")
            mark(folder, ["results.json"])  # an --overwrite of the trial removes it with the run
            log(f"masking: {row['trial']}: held-out MLM loss {fmt(scores['mlm_loss'])} (15 % masks, "
                f"{scores['targets']} targets)")
            wrote = True
        return wrote

    # ------------------------------------------------------------------------------------------
    # the verdicts
    # ------------------------------------------------------------------------------------------
    def _pretrained(self, results: Results, name: str, metric: str = LOSS) -> list[float]:
        if name == _static_name():
            return results.values(metric, {"objective.dynamic": False}, sweep="static")
        return results.values(metric, {"objective.rate": float(name.split("-", 1)[1])}, sweep="rates")

    def _downstream(self, results: Results, name: str, metric: str = DOWNSTREAM) -> list[float]:
        for s in results.settings("downstream"):
            if downstream_name(s["params"]) == name and metric in s["metrics"]:
                return list(s["metrics"][metric]["values"])
        return []

    def findings(self, results: Results) -> list[Finding]:
        dyn15, static = _dynamic_name(REFERENCE_RATE), _static_name()
        found = []
        d, s = self._pretrained(results, dyn15), self._pretrained(results, static)
        ok, gap, spread, words = matches(d, s, tolerance=LOSS_TOLERANCE, max_spread=LOSS_MAX_SPREAD,
                                         higher_is_better=False)
        found.append(Finding(self.claims[0], CONFIRMED if ok else NOT_CONFIRMED,
                             f"held-out MLM loss at 15 %: dynamic {fmt_stats(d)} vs static {fmt_stats(s)} over "
                             f"{len(d)} / {len(s)} seeds; {words}", gap, spread))
        d, s = self._downstream(results, dyn15), self._downstream(results, static)
        ok, gap, spread, words = matches(d, s, tolerance=F1_TOLERANCE, max_spread=F1_MAX_SPREAD)
        found.append(Finding(self.claims[1], CONFIRMED if ok else NOT_CONFIRMED,
                             f"test macro-F1: dynamic {fmt_stats(d)} vs static {fmt_stats(s)}; {words}", gap, spread))
        ref = self._downstream(results, dyn15)
        others = [rate for rate in sorted({p["params"]["objective.rate"] for p in results.settings("rates")})
                  if rate != REFERENCE_RATE]
        parts, ok_all, gaps, spreads = [], bool(others) and bool(ref), [], []
        for rate in others:
            ok, gap, spread, words = matches(ref, self._downstream(results, _dynamic_name(rate)),
                                             tolerance=F1_TOLERANCE, max_spread=F1_MAX_SPREAD)
            ok_all &= ok
            gaps.append(gap)
            spreads.append(spread)
            parts.append(f"vs {rate:.0%} {fmt_stats(self._downstream(results, _dynamic_name(rate)))}: {words}")
        found.append(Finding(self.claims[2], CONFIRMED if ok_all else NOT_CONFIRMED,
                             f"test macro-F1 at 15 % {fmt_stats(ref)}; " + ("; ".join(parts) or
                                                                            "no other rate measured at this size"),
                             max((g for g in gaps if g is not None), default=None),
                             max((x for x in spreads if x is not None), default=None)))
        return found

    def table(self, results: Results) -> str:
        rates = sorted({p["params"]["objective.rate"] for p in results.settings("rates")})
        names = [(_static_name(), "static", REFERENCE_RATE)] + [(_dynamic_name(x), "dynamic", x) for x in rates]
        lines = ["| masking | rate | seeds | held-out MLM loss (15 % masks) | held-out MLM accuracy | "
                 "downstream test macro-F1 | test accuracy |", "|---|---|---|---|---|---|---|"]
        for name, kind, rate in names:
            loss = self._pretrained(results, name)
            if not loss and not self._downstream(results, name):
                continue
            lines.append(f"| {kind} | {rate:.0%} | {len(loss)} | {fmt_stats(loss)} | "
                         f"{fmt_stats(self._pretrained(results, name, 'heldout.mlm_acc'))} | "
                         f"{fmt_stats(self._downstream(results, name))} | "
                         f"{fmt_stats(self._downstream(results, name, 'test.accuracy'))} |")
        lines += ["", "Held-out MLM loss: every pretrained model on the same held-out blocks with the same masks (15 % "
                  "of the tokens, BERT's 80/10/10 corruption, fixed draws), so the numbers compare; it favours the "
                  "models trained at 15 %. Downstream: each model finetuned on SMS spam with the seed it was "
                  "pretrained with."]
        return "\n".join(lines)

    def figure(self, results: Results, path: Path) -> Path | None:
        from matplotlib.figure import Figure

        from ..io.outputs import write_atomic

        rates = sorted({p["params"]["objective.rate"] for p in results.settings("rates")})
        fig = Figure(figsize=(9, 3.6), layout="constrained")
        axes = fig.subplots(1, 2)
        for ax, label, values_of in ((axes[0], "held-out MLM loss, 15 % masks (lower is better)", self._pretrained),
                                     (axes[1], "downstream test macro-F1 (higher is better)", self._downstream)):
            pts = [(100 * x, *stats(values_of(results, _dynamic_name(x)))) for x in rates]
            pts = [(x, m, sd or 0.0) for x, m, sd in pts if m is not None]
            if pts:
                xs, ms, sds = zip(*pts)
                ax.errorbar(xs, ms, yerr=sds, marker="o", capsize=3, color="C0", label="dynamic")
            mean, sd = stats(values_of(results, _static_name()))
            if mean is not None:
                ax.errorbar([100 * REFERENCE_RATE], [mean], yerr=[sd or 0.0], marker="s", capsize=3, color="C3",
                            linestyle="none", label="static")
            ax.set(xlabel="masking rate (%)", ylabel=label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("Masking: static vs dynamic, and the rate (mean ± std over seeds)")
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))
        return path


def _measured(folder: Path, wanted: dict) -> bool:
    """Whether the trial's results.json holds a held-out score measured as ``wanted`` says (else measure again)."""
    try:
        data = json.loads((folder / "results.json").read_text()).get("heldout", {})
    except (OSError, ValueError, AttributeError):
        return False
    return all(data.get(k) == v for k, v in wanted.items()) and "mlm_loss" in data


def heldout_blocks(text_file: str, tokenizer, block: int, n_blocks: int) -> list:
    """The held-out documents tokenized and joined as training packs them ([SEP] between documents, FULL-SENTENCES),
    cut into at most ``n_blocks`` blocks of ``block`` tokens (numpy int64 arrays)."""
    import numpy as np

    from ..data.readers import iter_documents

    sep = tokenizer.sep_id
    ids: list[int] = []
    for doc in iter_documents([text_file]):
        ids += tokenizer.encode(doc) + [sep]
        if len(ids) >= block * n_blocks:
            break
    n = min(n_blocks, len(ids) // block)
    if n == 0:
        raise ValueError(f"{text_file} holds {len(ids)} tokens, fewer than one block of {block}")
    return [np.asarray(ids[i * block:(i + 1) * block], dtype=np.int64) for i in range(n)]


def heldout_mlm(model, tokenizer, blocks: list, *, rate: float, draws: int, seed: int, batch_size: int = 64) -> dict:
    """A masked LM's loss and accuracy on held-out blocks with fixed masks: each block as [CLS] block [SEP], masked
    ``draws`` times by the objective's own corruption (``objectives.masking.mlm_example``: ``rate`` of the tokens,
    80 % [MASK] / 10 % random / 10 % kept) with the generator seeded by (seed, draw, block), so every model is
    scored on the same inputs and targets.

    Args:
        model: a TransformerLM with an MLM head (eval mode).
        tokenizer: the tokenizer the model was trained with (its [CLS], [SEP], [MASK] and special ids).
        blocks: (T,) int64 arrays of the same length, without special tokens (:func:`heldout_blocks`).

    Returns:
        ``mlm_loss`` (mean cross-entropy over the masked targets), ``mlm_acc`` and ``targets`` (their number).
    """
    import numpy as np
    import torch

    from ..objectives.masking import IGNORE, mlm_example

    special = sorted(tokenizer.special_ids)
    vocab = min(tokenizer.vocab_size, model.config.vocab_size)
    inputs, labels = [], []
    for d in range(draws):
        for i, b in enumerate(blocks):
            ids = np.concatenate([[tokenizer.cls_id], b, [tokenizer.sep_id]]).astype(np.int64)
            x, y = mlm_example(ids, np.random.default_rng([seed, d, i]), rate=rate, mask_id=tokenizer.mask_id,
                               vocab_size=vocab, special_ids=special)
            inputs.append(x)
            labels.append(y)
    x_all, y_all = torch.as_tensor(np.stack(inputs)), torch.as_tensor(np.stack(labels))  # (draws * blocks, T)
    model.eval()
    nll, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(x_all), batch_size):
            x, y = x_all[i:i + batch_size], y_all[i:i + batch_size]  # (B, T)
            logits = model(x, torch.ones_like(x), return_logits=True).logits.float()  # (B, T, vocab)
            keep = y != IGNORE
            nll += float(torch.nn.functional.cross_entropy(logits[keep], y[keep], reduction="sum"))
            correct += int((logits[keep].argmax(-1) == y[keep]).sum())
            count += int(keep.sum())
    return {"mlm_loss": nll / count, "mlm_acc": correct / count, "targets": count}


EXPERIMENT = Masking()
