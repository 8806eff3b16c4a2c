"""``pretune experiment positions``: positional encodings and length extrapolation (Press et al. 2022, Figure 1).

The same small GPT-2-style decoder is pretrained with causal LM on the bundled corpus at 128 tokens with each of
sinusoidal, learned, T5-relative, ALiBi and RoPE positions (one sweep over ``model.position`` x seeds); then each
trained model's perplexity is measured on the same held-out text cut into windows of 128, 256, 512 and 1024
tokens (non-overlapping; every length scores the same tokens). A learned table has 128 rows and cannot score a
longer window: that is reported as "n/a (learned table of 128)", never truncated. The held-out text is the tail
of each corpus file (never trained on).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .base import CONFIRMED, NOT_CONFIRMED, Claim, Experiment, Finding, Results, Sweep, beats, fmt, fmt_stats, stats

POSITIONS = {"sinusoidal": "sinusoidal", "learned": "learned", "relative": "T5 relative bias", "alibi": "ALiBi",
             "rope": "RoPE"}
TRAIN_LEN = 128
FACTORS = (1, 2, 4, 8)  # evaluation lengths as multiples of the training length
NEAR = 1.10  # "near its trained-length perplexity": at most 10 % above it
CORPUS = ("enwiki_sample.txt.gz", "austen_emma_pride.txt.gz", "web_bible_gospels.txt.gz", "mobydick_ch1-20.txt.gz")
# size -> corpus files, held-out share of each file's documents, BPE vocabulary, model, steps, batch, lr, warmup,
# held-out windows of the longest length, seeds
RECIPES = {
    "fast": dict(corpus=("mobydick_ch1-20.txt.gz",), heldout=0.1, vocab=384,
                 model=dict(n_layers=2, dim=32, n_heads=2, ffn_dim=64), steps=8, batch_size=8, lr=3e-3, warmup=2,
                 windows=2, seeds=[0, 1], precision="fp32"),
    "default": dict(corpus=CORPUS, heldout=0.02, vocab=4096, model=dict(n_layers=4, dim=128, n_heads=4, ffn_dim=512),
                    steps=500, batch_size=16, lr=3e-3, warmup=50, windows=16, seeds=[0, 1, 2], precision="fp32"),
    "large": dict(corpus=CORPUS, heldout=0.02, vocab=8192, model=dict(n_layers=6, dim=256, n_heads=8, ffn_dim=1024),
                  steps=4000, batch_size=32, lr=6e-4, warmup=400, windows=24, seeds=[0, 1, 2], precision="auto"),
}


def _lengths() -> list[int]:
    return [TRAIN_LEN * f for f in FACTORS]


class Positions(Experiment):
    name = "positions"
    title = "Positional encodings and length extrapolation"
    claim = ("Trained at 128 tokens, ALiBi keeps its perplexity near the trained-length value at 2-4x that length "
             "where sinusoidal positions degrade; RoPE and T5-relative land in between.")
    source = ("lectures 000 (A theory of positional encodings relativity) and 002 (Position encodings: ALiBi, "
              "Rotary); Press et al. 2022, Train Short, Test Long (ALiBi), Figure 1")
    claims = (
        Claim("alibi-extrapolates", "ALiBi stays near its 128-token perplexity at 256 and 512 tokens while "
              "sinusoidal positions degrade.",
              f"confirmed when, at 2x and at 4x the training length, ALiBi's mean perplexity ratio (ppl at the length "
              f"/ ppl at 128, per seed) is at most {NEAR:g} and sinusoidal's ratio exceeds ALiBi's by more than 2 x "
              "the pooled standard deviation of the ratios"),
        Claim("rope-between", "RoPE extrapolates worse than ALiBi and better than sinusoidal positions.",
              "confirmed when, at 4x the training length, RoPE's mean perplexity ratio lies above ALiBi's and below "
              "sinusoidal's, each by more than 2 x the pooled standard deviation of the ratios"),
        Claim("relative-between", "The T5 relative bias extrapolates worse than ALiBi and better than sinusoidal "
              "positions.",
              "confirmed when, at 4x the training length, the T5 bias's mean perplexity ratio lies above ALiBi's "
              "and below sinusoidal's, each by more than 2 x the pooled standard deviation of the ratios"),
    )
    sizes = {
        "fast": "Moby Dick only, a 2-layer 32-wide decoder, 8 steps of 8 x 128 tokens, 2 x 1024 held-out tokens, "
                "2 seeds (10 trials; ~25 s)",
        "default": "the whole bundled corpus (2 % of each file's documents held out), BPE 4096, a 4-layer 128-wide "
                   "decoder (1.3M parameters), 500 steps of 16 x 128 tokens (1M tokens) at lr 3e-3, perplexity on "
                   "16 x 1024 held-out tokens, seeds 0-2 (15 trials of about 95 s; about 14 minutes on 2 CPU cores "
                   "in fp32)",
        "large": "BPE 8192, a 6-layer 256-wide decoder, 4000 steps of 32 x 128 tokens (16M tokens), 24 x 1024 "
                 "held-out tokens, seeds 0-2 (hours on 2 CPU cores: for a GPU or a bigger machine)",
    }
    metric = f"ppl.{TRAIN_LEN}"
    figure_name = "lengths"

    # ------------------------------------------------------------------------------------------
    # inputs: the corpus split into training and held-out text, a tokenizer, the token store
    # ------------------------------------------------------------------------------------------
    def prepare(self, size: str, folder: Path, log=print) -> dict:
        from .. import bundled
        from ..data.readers import iter_documents
        from ..io.outputs import write_atomic

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
            log(f"positions: {len(train)} training and {len(held)} held-out documents -> {folder}")
        if not paths["tokenizer"].is_file():
            from ..io.tokenization import train_tokenizer

            tok = train_tokenizer([paths["train"]], kind="bpe", vocab_size=r["vocab"], show_progress=False)
            tok.save(paths["tokenizer"])
        # the token store every trial reads (built here once: trials running at once must not build it together)
        from ..io.tokenization import Tokenizer
        from ..jobs.pretrain import build_token_store
        from ..runconfig import RunConfig

        build_token_store(RunConfig(), Tokenizer.load(paths["tokenizer"]), [str(paths["train"].resolve())],
                          paths["store"] / "train", show_progress=False)
        return {k: str(p.resolve()) for k, p in paths.items()}

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        steps = r["steps"]
        spec = {
            "command": "pretrain",
            # token embeddings x sqrt(dim) (Vaswani et al. 2017 §3.4; the fairseq LM Press et al. trained): unscaled,
            # sinusoids of amplitude 1 drown embeddings initialised at std 0.02 and the sinusoidal model lags
            "base": {"model": {"preset": "gpt2", **r["model"], "max_seq_len": TRAIN_LEN, "scale_embeddings": True,
                               "dropout": 0.0, "attn_dropout": 0.0},
                     "objective.name": "clm", "tokenizer": inputs["tokenizer"],
                     "data": {"train": [inputs["train"]], "store": inputs["store"], "eval_max": 32},
                     "train": {"steps": steps, "batch_size": r["batch_size"], "lr": r["lr"],
                               "warmup_steps": r["warmup"], "schedule": "cosine", "min_lr_ratio": 0.1,
                               "beta2": 0.95, "weight_decay": 0.1, "eval_every": max(1, steps // 4),
                               "save_every": max(1, steps // 2), "keep_last": 1 if size != "fast" else 0,
                               "precision": r["precision"], "plot": False, "tensorboard": False}},
            "grid": {"model.position": list(POSITIONS)},
            "seeds": r["seeds"],
            # eval.lm_ppl: the run's own evaluation (its held-out blocks of 128); ppl.N, ratio.N: measure() below
            "metrics": ["eval.lm_ppl"] + [f"ppl.{n}" for n in _lengths()] + [f"ratio.{n}" for n in _lengths()[1:]],
        }
        return [Sweep("sweep", spec)]

    # ------------------------------------------------------------------------------------------
    # measuring: perplexity of each trained model at each length
    # ------------------------------------------------------------------------------------------
    def measure(self, size: str, sweep: Sweep, result, inputs: dict, log=print) -> bool:
        from ..io.outputs import mark, write_atomic
        from ..loading import load

        tokens = None
        n_tokens = RECIPES[size]["windows"] * max(_lengths())
        wrote = False
        for row in result.rows:
            folder = result.out / "trials" / row["trial"]
            if row["status"] != "done" or _measured(folder, n_tokens):
                continue
            if tokens is None:
                tokens = heldout_tokens(inputs["heldout"], inputs["tokenizer"], n_tokens)
                if len(tokens) < n_tokens:
                    log(f"positions: the held-out text has {len(tokens)} tokens, fewer than {n_tokens}; measuring on "
                        f"{len(tokens) // max(_lengths())} window(s) of {max(_lengths())}")
            model = load(folder / "model")
            table = model.config.max_positions if model.config.position == "learned" else None
            ppl = perplexities(model, tokens, _lengths(), table_rows=table)
            base = ppl[TRAIN_LEN]
            out = {"ppl": {str(n): v for n, v in ppl.items()},
                   "ratio": {str(n): (None if v is None else v / base) for n, v in ppl.items() if n != TRAIN_LEN},
                   "not_scored": {str(n): f"n/a (learned table of {table})" for n, v in ppl.items() if v is None},
                   "eval_tokens": n_tokens, "windows": {str(n): len(tokens) // n for n in ppl}}
            write_atomic(folder / "results.json", json.dumps(out, indent=1) + "\n")
            mark(folder, ["results.json"])  # an --overwrite of the trial removes it with the run
            log(f"positions: {row['trial']}: " + ", ".join(f"ppl@{n} {fmt(v)}" for n, v in ppl.items()))
            wrote = True
        return wrote

    # ------------------------------------------------------------------------------------------
    # the verdicts
    # ------------------------------------------------------------------------------------------
    def _ratios(self, results: Results, position: str, length: int) -> list[float]:
        return results.values(f"ratio.{length}", {"model.position": position})

    def findings(self, results: Results) -> list[Finding]:
        two, four = TRAIN_LEN * 2, TRAIN_LEN * 4
        # ALiBi near its trained-length value, sinusoidal above it beyond the spread, at 2x and 4x
        parts, ok_all, margins, spreads = [], True, [], []
        for n in (two, four):
            alibi, sin = self._ratios(results, "alibi", n), self._ratios(results, "sinusoidal", n)
            mean_alibi = stats(alibi)[0]
            near = mean_alibi is not None and mean_alibi <= NEAR
            ok, margin, spread, words = beats(alibi, sin, higher_is_better=False)
            ok_all &= near and ok
            margins.append(margin)
            spreads.append(spread)
            parts.append(f"at {n}: ALiBi ratio {fmt_stats(alibi)} ({'<=' if near else '>'} {NEAR:g}), sinusoidal "
                         f"{fmt_stats(sin)}; {words}")
        found = [Finding(self.claims[0], CONFIRMED if ok_all else NOT_CONFIRMED, "; ".join(parts),
                         _least(margins), _most(spreads))]
        for claim, pos in ((self.claims[1], "rope"), (self.claims[2], "relative")):
            alibi, mid, sin = (self._ratios(results, p, four) for p in ("alibi", pos, "sinusoidal"))
            ok1, m1, s1, w1 = beats(alibi, mid, higher_is_better=False)
            ok2, m2, s2, w2 = beats(mid, sin, higher_is_better=False)
            words = (f"at {four}: ALiBi ratio {fmt_stats(alibi)}, {POSITIONS.get(pos, pos)} {fmt_stats(mid)}, "
                     f"sinusoidal {fmt_stats(sin)}; above ALiBi: {w1}; below sinusoidal: {w2}")
            found.append(Finding(claim, CONFIRMED if ok1 and ok2 else NOT_CONFIRMED, words, _least([m1, m2]),
                                 _most([s1, s2])))
        return found

    def table(self, results: Results) -> str:
        lengths = _lengths()
        head = ["position", "seeds"] + [f"ppl @ {n}" + ("" if n == TRAIN_LEN else f" (x{n // TRAIN_LEN})")
                                        for n in lengths]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for pos, label in POSITIONS.items():
            s = results.find({"model.position": pos})
            if s is None:
                continue
            cells = [label, str(len(s["seeds"]))]
            for n in lengths:
                values = s["metrics"][f"ppl.{n}"]["values"]
                if not values and s["seeds"] and pos == "learned" and n > TRAIN_LEN:
                    cells.append(f"n/a (learned table of {TRAIN_LEN})")
                    continue
                ratio = stats(s["metrics"][f"ratio.{n}"]["values"])[0] if n != TRAIN_LEN else None
                cells.append(fmt_stats(values) + ("" if ratio is None else f" (x{ratio:.3g})"))
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Perplexity on the same held-out tokens cut into windows of each length; (xR): the mean ratio "
                  f"to the same models' perplexity at {TRAIN_LEN}."]
        return "\n".join(lines)

    def figure(self, results: Results, path: Path) -> Path | None:
        from matplotlib.figure import Figure

        from ..io.outputs import write_atomic

        lengths = _lengths()
        fig = Figure(figsize=(6.5, 4.2), layout="constrained")
        ax = fig.subplots()
        for i, (pos, label) in enumerate(POSITIONS.items()):
            s = results.find({"model.position": pos})
            if s is None:
                continue
            pts = [(n, *stats(s["metrics"][f"ppl.{n}"]["values"])) for n in lengths]
            pts = [(n, m, sd or 0.0) for n, m, sd in pts if m is not None]
            if pts:
                xs, ms, sds = zip(*pts)
                ax.errorbar(xs, ms, yerr=sds, marker="o", capsize=3, color=f"C{i}", label=label)
        ax.axvline(TRAIN_LEN, color="0.6", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths)
        ax.set_xticklabels([str(n) for n in lengths])
        ax.set(xlabel="evaluation length (tokens; trained at 128)", ylabel="held-out perplexity",
               title="length extrapolation (mean ± std over seeds)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))
        return path


def _least(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def _most(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _measured(folder: Path, n_tokens: int) -> bool:
    try:
        data = json.loads((folder / "results.json").read_text())
    except (OSError, ValueError):
        return False
    return data.get("eval_tokens") == n_tokens and set(data.get("ppl", {})) == {str(n) for n in _lengths()}


def heldout_tokens(text_file: str, tokenizer: str, n_tokens: int):
    """The held-out documents tokenized and joined as training packs them (an end-of-text id between documents),
    the first ``n_tokens`` of them (numpy int64)."""
    import numpy as np

    from ..data.readers import iter_documents
    from ..io.tokenization import Tokenizer

    tok = Tokenizer.load(tokenizer)
    sep = tok.eos_id if tok.eos_id is not None else tok.sep_id
    ids: list[int] = []
    for doc in iter_documents([text_file]):
        ids += tok.encode(doc) + ([sep] if sep is not None else [])
        if len(ids) >= n_tokens:
            break
    return np.asarray(ids[:n_tokens], dtype=np.int64)


def perplexities(model, tokens, lengths: list[int], *, table_rows: int | None = None,
                 batch_tokens: int = 8192) -> dict[int, float | None]:
    """A causal LM's perplexity on ``tokens`` cut into non-overlapping windows of each length (the first token of
    a window is context only); None for a length past a learned position table of ``table_rows`` rows.

    Args:
        model: a TransformerLM with an LM head (eval mode).
        tokens: (N,) token ids; each length scores the first N // length * length of them.
        lengths: window lengths.
        table_rows: the rows of a learned position table (None: the positions extrapolate).
        batch_tokens: tokens per forward pass.
    """
    import torch

    out: dict[int, float | None] = {}
    model.eval()
    for n in lengths:
        if table_rows is not None and n > table_rows:
            out[n] = None
            continue
        rows = torch.as_tensor(tokens[: len(tokens) // n * n]).view(-1, n)  # (windows, n)
        if len(rows) == 0:
            raise ValueError(f"{len(tokens)} held-out tokens cannot fill one window of {n}")
        nll, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(rows), max(1, batch_tokens // n)):
                ids = rows[i:i + max(1, batch_tokens // n)]  # (B, n)
                loss = model(ids, labels=ids, return_logits=False).loss  # mean over B * (n - 1) targets
                k = ids.shape[0] * (n - 1)
                nll += float(loss) * k
                count += k
        out[n] = math.exp(nll / count)
    return out


EXPERIMENT = Positions()
