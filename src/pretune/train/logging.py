"""Training metrics: one JSON object a line in ``run_dir/metrics.jsonl``, TensorBoard scalars in
``run_dir/tb``, the same rows in MLflow / W&B (``pretune.train.trackers``), and a loss-curve PNG drawn from the JSONL.

::

    with MetricsLogger("runs/gpt2") as log:
        log.log(100, "train", loss=3.2, lr=3e-4, tokens_per_s=5.1e4)
        log.log(500, "eval", loss=3.0, perplexity=20.1)
    plot_losses("runs/gpt2/metrics.jsonl", "runs/gpt2/loss.png", title="tiny-gpt2")
"""

from __future__ import annotations

import json
import math
import operator
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..io.outputs import write_atomic

if TYPE_CHECKING:
    from .trackers import Trackers

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
# eval metrics the plot's second panel looks for: a perplexity, else an accuracy (masked-token first)
PERPLEXITY_SUFFIXES = ("perplexity", "ppl")  # "perplexity", "ppl", "lm_ppl", "mlm_perplexity", ...
ACCURACY_SUFFIXES = ("accuracy", "acc")  # "mlm_acc", "masked_accuracy", "accuracy", ...

_warned_no_tensorboard = False


def _summary_writer(log_dir: Path, purge_step: int | None) -> Any | None:
    global _warned_no_tensorboard
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch.utils.tensorboard needs the tensorboard package
        if not _warned_no_tensorboard:
            warnings.warn(f"TensorBoard unavailable ({e}); logging metrics to JSONL only", stacklevel=3)
            _warned_no_tensorboard = True
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def _as_number(name: str, value: Any) -> float | int:
    if hasattr(value, "item"):  # 0-d torch tensor / numpy scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__} ({value!r})")
    return value


class MetricsLogger:
    """Appends metric records to ``run_dir/metrics.jsonl`` and mirrors them to TensorBoard and the trackers.

    Args:
        run_dir: run folder (created). The JSONL holds ``{"step", "split", <metric>: value, ...}``.
        tensorboard: also write ``run_dir/tb`` event files with scalars ``"{split}/{metric}"``
            (``train/loss``); without the ``tensorboard`` package: one warning, JSONL only.
        trackers: open MLflow / W&B runs (:func:`~pretune.train.trackers.open_trackers`) each record also goes
            to, as ``"{split}/{metric}"`` at its step; their opener ends them (after adding its artifacts).
        enabled: False makes every method a no-op and touches no file (DDP ranks other than 0).
        append: keep the existing metrics (resuming). False starts the run afresh: the JSONL is
            emptied and old TensorBoard event files in ``run_dir/tb`` are removed.
        resume_step: with ``append``, the step of the checkpoint being resumed: records with
            ``step > resume_step`` (written after that checkpoint by the interrupted run) are dropped
            from the JSONL and purged by TensorBoard, so curves do not double back. None keeps all;
            ignored without ``append``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        trackers: Trackers | None = None,
        enabled: bool = True,
        append: bool = False,
        resume_step: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self._file = None
        self._writer = None
        self._trackers = trackers
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not append:
            resume_step = None
        elif resume_step is not None and resume_step < 0:
            raise ValueError(f"resume_step ({resume_step}) must be >= 0")
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        if not append:
            for old in (self.run_dir / TB_DIR).glob("events.out.tfevents.*"):
                old.unlink()
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # closed in close()
        if tensorboard:
            purge = resume_step + 1 if resume_step is not None else None
            self._writer = _summary_writer(self.run_dir / TB_DIR, purge)

    def log(self, step: int, split: str, **metrics: float) -> None:
        """Write one record: ``step`` (optimizer steps so far), ``split`` ("train", "eval", ...) and
        numeric metrics (floats, ints, 0-d tensors), e.g. ``loss=2.3, lr=1e-4, tokens_per_s=9e4``."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"MetricsLogger({str(self.run_dir)!r}) is closed")
        if isinstance(step, bool) or not hasattr(step, "__index__") or operator.index(step) < 0:
            raise ValueError(f"step ({step!r}) must be an int >= 0")
        step = operator.index(step)  # numpy / 0-d tensor ints -> int
        if not split or not isinstance(split, str):
            raise ValueError(f"split ({split!r}) must be a non-empty string such as 'train' or 'eval'")
        values = {k: _as_number(k, v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "split": split, **values}) + "\n")
        self._file.flush()
        if self._writer is not None:
            for k, v in values.items():
                self._writer.add_scalar(f"{split}/{k}", v, global_step=step)
        if self._trackers is not None:
            self._trackers.log(step, split, values)

    def close(self) -> None:
        """Flush and close the files; later calls are no-ops."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a ``metrics.jsonl`` (or of a run folder holding one), in file order. Blank lines
    are skipped; an unreadable line (a run killed mid-write) is skipped with a warning."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{n}: skipping unreadable metrics line {line[:80]!r}", stacklevel=2)
    return records


def _ema(values: Sequence[float], beta: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing): starts at the first value."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i) if beta > 0 else v)
    return out


def _series(records: list[dict], split: str, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get("split") == split and isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def _second_panel_key(records: list[dict]) -> str | None:
    keys = {k for r in records if r.get("split") == "eval" for k, v in r.items() if isinstance(v, (int, float))}

    def matches(k: str, suffixes: tuple[str, ...]) -> bool:
        return k in suffixes or k.endswith(tuple("_" + x for x in suffixes))

    ppl = sorted(k for k in keys if matches(k, PERPLEXITY_SUFFIXES))
    acc = sorted((not k.startswith(("mlm", "masked")), k) for k in keys if matches(k, ACCURACY_SUFFIXES))
    return ppl[0] if ppl else acc[0][1] if acc else None


def plot_losses(metrics_path: str | os.PathLike, out_png: str | os.PathLike, *, title: str = "") -> Path:
    """Draw loss curves from a ``metrics.jsonl`` into a PNG (Agg, no display; written atomically).

    Panels, sharing the step axis: train loss (thin raw line plus a debiased-EMA smoothed line) with
    eval loss as markers; an eval perplexity (``perplexity``, ``ppl``, ``*_ppl``: log scale) or else an
    accuracy (``*_acc``, ``*accuracy``; masked-token ``mlm_*``/``masked_*`` first) when logged; the
    train learning rate (``lr``) when logged.
    Any subset of these, a single point, or no records at all (an empty "no metrics" figure) is fine.

    Returns:
        ``Path(out_png)``.
    """
    from matplotlib.figure import Figure  # Figure() without pyplot: Agg canvas, no global state

    records = read_metrics(metrics_path)
    train_s, train_loss = _series(records, "train", "loss")
    eval_s, eval_loss = _series(records, "eval", "loss")
    lr_s, lr = _series(records, "train", "lr")
    extra_key = _second_panel_key(records)
    panels = ["loss"] + (["extra"] if extra_key else []) + (["lr"] if lr_s else [])
    heights = {"loss": 3.0, "extra": 1.8, "lr": 1.2}
    fig = Figure(figsize=(7.5, sum(heights[p] for p in panels) + 0.6), dpi=120, layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [heights[p] for p in panels]})[:, 0]
    ax = axes[0]
    if train_s:
        marker = "o" if len(train_s) == 1 else None
        ax.plot(train_s, train_loss, color="tab:blue", lw=0.7, alpha=0.35, marker=marker, label="train")
        if len(train_s) > 20:  # EMA horizon ~2% of the points (>= 2, <= 100): smooth, but little lag
            beta = min(0.99, max(0.5, 1 - 50 / len(train_s)))
            ax.plot(train_s, _ema(train_loss, beta), color="tab:blue", lw=1.6, label="train (smoothed)")
    if eval_s:
        ax.plot(eval_s, eval_loss, color="tab:orange", marker="o", ms=4, lw=1.0, label="eval")
    if train_s or eval_s:
        ax.legend(loc="upper right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    for ax, panel in zip(axes[1:], panels[1:]):
        if panel == "extra":
            s, v = _series(records, "eval", extra_key)
            ax.plot(s, v, color="tab:green", marker="o", ms=4, lw=1.0)
            ax.set_ylabel(f"eval {extra_key}")
            if not extra_key.endswith(ACCURACY_SUFFIXES) and min(v) > 0:
                ax.set_yscale("log")  # perplexity falls by orders of magnitude early on
        else:
            ax.plot(lr_s, lr, color="tab:gray", lw=1.0, marker="o" if len(lr_s) == 1 else None)
            ax.set_ylabel("lr")
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda fh: fig.savefig(fh, format="png"), fsync=False)
    return out


def format_duration(seconds: float) -> str:
    """Short human duration for ETAs: ``"42s"``, ``"3m05s"``, ``"1h02m"``, ``"2d03h"``; ``"?"`` when
    unknown (negative, NaN or infinite)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


__all__ = ["MetricsLogger", "format_duration", "plot_losses", "read_metrics"]
