"""What an experiment is: a lecture's claim, the sweeps that test it at each size, and the rule that turns the
measured numbers into a verdict.

An experiment subclasses :class:`Experiment` and fills in its class attributes (``name``, ``claim``, ``source``,
``claims``, ``sizes``) and ``sweeps``; ``findings`` gives one :class:`Finding` per :class:`Claim`. Optional hooks:
``prepare`` (inputs the sweeps read: a tokenizer, data subsets), ``measure`` (numbers a trial's own run does not
produce, such as perplexity at other lengths, written into its folder), ``table`` and ``figure``. The runner
(:mod:`pretune.experiments.runner`) does the rest: the folder, resuming, the reports.

The statistics every verdict uses are here too: :func:`stats` (mean ± sample std over seeds), :func:`pooled_std`
and :func:`beats` / :func:`matches` (a difference of means against twice the pooled seed-to-seed spread).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sweep's result type; imported lazily at run time (no torch here)
    from ..sweep import SweepResult

SIZES = ("fast", "default", "large")
CONFIRMED = "confirmed"
NOT_CONFIRMED = "not confirmed at this scale"
SPREAD_FACTOR = 2.0  # a difference of means counts when it exceeds this many pooled standard deviations


@dataclass(frozen=True)
class Claim:
    """One claim an experiment gives a verdict on."""

    key: str  # short id, e.g. "alibi-extrapolates" (verdict.json)
    text: str  # the claim, one sentence
    rule: str  # how its verdict is decided, one sentence (shown in report.md)


@dataclass
class Finding:
    """The verdict on one claim: its label, the numbers behind it, in words."""

    claim: Claim
    label: str  # CONFIRMED or NOT_CONFIRMED
    explanation: str  # the margin and the spread, in words and numbers
    margin: float | None = None  # the measured difference the rule looks at
    spread: float | None = None  # the seed-to-seed spread it is compared with (pooled std)

    @property
    def confirmed(self) -> bool:
        return self.label == CONFIRMED

    def to_dict(self) -> dict:
        return {"claim": self.claim.key, "text": self.claim.text, "rule": self.claim.rule, "verdict": self.label,
                "explanation": self.explanation, "margin": self.margin, "spread": self.spread}


@dataclass
class Sweep:
    """One sweep an experiment runs: its folder name under the experiment's folder and its spec (the format of
    ``pretune sweep``, without ``out``)."""

    name: str
    spec: dict


@dataclass
class Results:
    """What the sweeps of one experiment run measured: each sweep's aggregated result by name."""

    size: str
    sweeps: dict[str, SweepResult]
    inputs: dict = field(default_factory=dict)  # what prepare() returned

    def settings(self, sweep: str | None = None) -> list[dict]:
        """The aggregated settings (``pretune.sweep``'s: setting, params, seeds, metrics {name: {mean, std,
        values}}) of one sweep, or of every sweep in order, each with its sweep's name under ``"sweep"``."""
        names = [sweep] if sweep is not None else list(self.sweeps)
        return [{**s, "sweep": n} for n in names if n in self.sweeps for s in self.sweeps[n].settings]

    def find(self, params: dict, *, sweep: str | None = None) -> dict | None:
        """The setting whose parameters include ``params`` (dotted key -> value), or None."""
        for s in self.settings(sweep):
            if all(s["params"].get(k) == v for k, v in params.items()):
                return s
        return None

    def values(self, metric: str, params: dict, *, sweep: str | None = None) -> list[float]:
        """The metric's value for each finished seed of the setting matching ``params`` (empty: none)."""
        s = self.find(params, sweep=sweep)
        return list(s["metrics"][metric]["values"]) if s is not None and metric in s["metrics"] else []

    @property
    def rows(self) -> list[dict]:
        """Every trial of every sweep (results.jsonl's rows), each with its sweep's name under ``"sweep"``."""
        return [{"sweep": n, **r} for n, res in self.sweeps.items() for r in res.rows]


class Experiment:
    """A lecture's claim, tested with sweeps at a size, judged by a stated rule. Subclass it; see the module
    docstring and docs/experiments.md ("Adding an experiment")."""

    name: str = ""  # the command's NAME: pretune experiment NAME
    title: str = ""  # a few words for tables and plots
    claim: str = ""  # the lecture's claim, one sentence
    source: str = ""  # where the claim comes from: the seed lecture file(s) and the paper(s)
    claims: tuple[Claim, ...] = ()  # what verdicts are given on (each finding answers one)
    sizes: dict[str, str] = {}  # size -> one line: what it runs and how long it takes on 2 CPU cores
    metric: str = ""  # the headline metric (a sweep metric name), for the default table
    figure_name: str = ""  # the experiment's own figure (``<name>.png``), drawn by figure(); empty: none

    # ------------------------------------------------------------------------------------------
    # what to run
    # ------------------------------------------------------------------------------------------
    def prepare(self, size: str, folder: Path, log=print) -> dict:
        """Make the inputs the sweeps read (a tokenizer, data subsets, a token store) in ``folder`` (the
        experiment's ``inputs/``) and return what sweeps() needs (name -> path). Must be cheap to call again
        (a rerun continues the experiment): reuse what is already there. Default: nothing."""
        return {}

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        """The sweeps to run at ``size``, in order (a later one may read what an earlier one's trials wrote:
        their folders are ``<out>/<sweep>/trials/<trial>``)."""
        raise NotImplementedError

    def measure(self, size: str, sweep: Sweep, result: SweepResult, inputs: dict, log=print) -> bool:
        """After a sweep: measure what its trials' runs do not (write it into each done trial's folder, e.g. as
        its ``results.json``, so the sweep's metrics find it); skip trials measured before. Returns whether
        anything new was written (then the sweep's report is rewritten). Default: nothing."""
        return False

    # ------------------------------------------------------------------------------------------
    # what it found
    # ------------------------------------------------------------------------------------------
    def findings(self, results: Results) -> list[Finding]:
        """One Finding per claim in ``claims``."""
        raise NotImplementedError

    def verdict(self, results: Results) -> tuple[str, str]:
        """(label, explanation): confirmed when every claim is; the explanation names each claim's verdict."""
        found = self.findings(results)
        label = CONFIRMED if found and all(f.confirmed for f in found) else NOT_CONFIRMED
        n = sum(f.confirmed for f in found)
        return label, f"{n} of {len(found)} claims confirmed: " + "; ".join(
            f"{f.claim.key}: {f.label}" for f in found)

    def table(self, results: Results) -> str:
        """The measured table (markdown): each setting's metrics as mean ± std over its seeds."""
        rows = results.settings()
        metrics = list(dict.fromkeys(m for s in rows for m in s["metrics"]))
        keys = list(dict.fromkeys(k for s in rows for k in s["params"]))
        multi = len(results.sweeps) > 1
        header = (["sweep"] if multi else []) + keys + ["seeds"] + metrics
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for s in rows:
            cells = ([s["sweep"]] if multi else []) + [str(s["params"].get(k, "")) for k in keys]
            cells.append(str(len(s["seeds"])))
            cells += [fmt_stats(s["metrics"][m]["values"]) for m in metrics]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def figure(self, results: Results, path: Path) -> Path | None:
        """Draw the experiment's own figure into ``path`` (PNG); None when it has none."""
        return None


# ----------------------------------------------------------------------------------------------
# statistics over seeds
# ----------------------------------------------------------------------------------------------
def stats(values: list[float]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation) of the values; the std is None with fewer than two."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt(x: float | None, digits: int = 4) -> str:
    return "—" if x is None else f"{x:.{digits}g}"


def fmt_stats(values: list[float], digits: int = 4) -> str:
    """``mean ± std`` (one value: the value alone; none: a dash)."""
    mean, std = stats(values)
    if mean is None:
        return "—"
    return fmt(mean, digits) + (f" ± {fmt(std, 2)}" if std is not None else "")


def pooled_std(a: list[float], b: list[float]) -> float | None:
    """The pooled sample standard deviation of two groups, sqrt(((n_a-1) s_a^2 + (n_b-1) s_b^2) / (n_a+n_b-2));
    None when neither group has two values."""
    dof = (len(a) - 1 if len(a) > 1 else 0) + (len(b) - 1 if len(b) > 1 else 0)
    if dof == 0:
        return None
    ss = sum((len(g) - 1) * statistics.variance(g) for g in (a, b) if len(g) > 1)
    return math.sqrt(ss / dof)


def beats(better: list[float], worse: list[float], *, higher_is_better: bool = True,
          factor: float = SPREAD_FACTOR) -> tuple[bool, float | None, float | None, str]:
    """Does ``better`` beat ``worse`` beyond the seed-to-seed spread? (ok, margin, spread, words): ok when the
    difference of means in the claimed direction exceeds ``factor`` x the pooled std (and both groups have
    values and a spread can be computed)."""
    (ma, _), (mb, _) = stats(better), stats(worse)
    if ma is None or mb is None:
        return False, None, None, "not measured (a setting has no finished trial)"
    margin = (ma - mb) if higher_is_better else (mb - ma)
    spread = pooled_std(better, worse)
    if spread is None:
        return False, margin, None, f"margin {margin:+.4g}, but one seed each: no seed-to-seed spread to compare with"
    ok = margin > factor * spread
    words = (f"margin {margin:+.4g} {'>' if ok else '<='} {factor:g} x pooled std {spread:.2g} "
             f"(= {factor * spread:.2g})")
    return ok, margin, spread, words


def matches(candidate: list[float], reference: list[float], *, tolerance: float, max_spread: float,
            higher_is_better: bool = True, factor: float = SPREAD_FACTOR
            ) -> tuple[bool, float | None, float | None, str]:
    """Does ``candidate`` match ``reference``? (ok, gap, spread, words): ok when the candidate's shortfall (difference
    of means; doing better is fine) is within the seed-to-seed spread, at most max(``factor`` x the pooled std,
    ``tolerance``), and the pooled std itself is at most ``max_spread`` (too noisy a comparison, or one seed each,
    cannot tell a match)."""
    (mc, _), (mr, _) = stats(candidate), stats(reference)
    if mc is None or mr is None:
        return False, None, None, "not measured (a setting has no finished trial)"
    gap = (mr - mc) if higher_is_better else (mc - mr)  # > 0: the candidate is behind
    spread = pooled_std(candidate, reference)
    if spread is None:
        return False, gap, None, f"gap {gap:+.4g}, but one seed each: no seed-to-seed spread to compare it with"
    allowed = max(factor * spread, tolerance)
    ok = gap <= allowed and spread <= max_spread
    words = (f"gap {gap:+.4g} (reference minus candidate) {'<=' if gap <= allowed else '>'} max({factor:g} x pooled "
             f"std {spread:.2g}, {tolerance:g}) = {allowed:.2g}; pooled std {'<=' if spread <= max_spread else '>'} "
             f"{max_spread:g}")
    return ok, gap, spread, words


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
def bundled_file(name: str) -> str:
    """The path of a bundled data file (``tasks/sms_spam/train.jsonl``) as text, for a sweep spec."""
    from .. import bundled

    return str(bundled.path(name))


def head_records(source: str | Path, dest: Path, n: int, keep=None) -> str:
    """The first ``n`` records (lines) of a JSONL file, those ``keep(record)`` accepts when given, written to
    ``dest`` (kept when it is already there, so a rerun reuses it); returns its path as text. For the small data
    of a fast size."""
    import json

    from ..io.outputs import write_atomic

    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        with open(source, encoding="utf-8") as f:
            for line in f:
                if len(lines) == n:
                    break
                if line.strip() and (keep is None or keep(json.loads(line))):
                    lines.append(line)
        write_atomic(dest, "".join(lines), fsync=False)
    return str(dest.resolve())


def realmodel(name: str) -> str:
    """The folder of an offline real checkpoint (``minilm``, ``smollm2``) as text; a ConfigError saying how to
    install it when its package is missing."""
    from ..config import ConfigError
    from ..io import realmodels

    finders = {"minilm": realmodels.minilm_dir, "smollm2": realmodels.smollm2_dir}
    try:
        return str(finders[name]())
    except FileNotFoundError as e:
        raise ConfigError(f"this experiment needs the real {name} checkpoint: {e}") from None


def tiny_decoder(folder: Path, texts, *, vocab_size: int, max_seq_len: int) -> str:
    """A fast size's model: a tiny random-init Llama-like decoder (seed 0) with a BPE tokenizer of ``vocab_size``
    trained on ``texts``, made once in ``folder`` (``tokenizer.json``, ``model/``; a rerun reuses them); returns the
    model folder as text. ``texts`` is called only when the tokenizer is not there yet: pass a function."""
    tok, model = folder / "tokenizer.json", folder / "model"
    if not tok.is_file():
        from ..io.tokenization import train_tokenizer

        train_tokenizer(texts=texts(), kind="bpe", vocab_size=vocab_size, show_progress=False).save(tok)
    if not (model / "config.json").is_file():
        import torch

        from ..io.checkpoint import save
        from ..io.tokenization import Tokenizer
        from ..model import TransformerLM
        from ..presets import get_preset

        vocab = Tokenizer.load(tok)
        torch.manual_seed(0)
        save(TransformerLM(get_preset("tiny-llama", vocab_size=vocab.vocab_size, max_seq_len=max_seq_len)), model,
             tokenizer=tok)
    return str(model.resolve())

