"""Experiment trackers beside ``metrics.jsonl``: every row the run logs also goes to an MLflow run and a Weights &
Biases run (``train.report_to``; TensorBoard stays with :class:`~pretune.train.logging.MetricsLogger`).

::

    trackers = open_trackers(cfg.train, run_dir, config=cfg.to_dict(), job="pretrain", enabled=dist.is_main)
    trainer = Trainer(..., trackers=trackers)       # its MetricsLogger sends each row here too
    trainer.fit()
    trackers.log_artifacts(run_dir, ["loss.png", "results.json"])
    trackers.close()

What a tracked run holds: the resolved config as parameters (flattened keys, ``train.lr``; W&B: the nested config),
each logged row's metrics under ``"{split}/{name}"`` (``train/loss``, ``eval/loss``: the split of the JSONL row, then
the name it has there) at the row's step, the run's name (its folder's name) and tags (``train.tags``, and
``pretune.job``, ``pretune.group``), and the files the job hands over at the end. Where they go:

- MLflow: ``$MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<tracking_dir>/mlruns.db`` with the artifacts in
  ``<tracking_dir>/mlartifacts`` (``mlflow ui --backend-store-uri sqlite:///RUN/mlruns.db`` shows it; MLflow >= 3.13
  refuses plain file stores); the experiment ``$MLFLOW_EXPERIMENT_NAME``, else ``pretune``.
- W&B: ``<tracking_dir>/wandb``, offline (``WANDB_MODE=offline``) unless ``$WANDB_MODE`` says otherwise; the project
  ``$WANDB_PROJECT``, else ``pretune``; ``wandb sync <tracking_dir>/wandb/offline-run-*`` uploads it.

``<tracking_dir>`` is ``train.tracking_dir``, else the run folder. The ids of the tracked runs are kept in
``<run>/trackers.json``, so ``--resume`` continues the same MLflow run (W&B offline: a new folder under the same id).
Only process 0 tracks (``enabled=False`` elsewhere). A tracker that fails (a server that cannot be reached, a store
that refuses a write) warns once and is dropped: training goes on and ``metrics.jsonl`` keeps every row. A tracker
whose package is missing is a ConfigError naming the package and the ``track`` extra, raised before training.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..io.outputs import mark, write_atomic

RECORD_FILE = "trackers.json"  # in the run folder: each tracker's run id, for --resume
EXTRA = "track"  # pip install 'pretune[track]'
DEFAULT_PROJECT = "pretune"  # MLflow experiment / W&B project when the environment names none
MLFLOW_PARAM_CHARS = 6000  # MLflow's longest parameter value (mlflow.utils.validation, MLflow 3)
MLFLOW_BATCH = 100  # MLflow's most parameters in one log_batch


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclass
class RunInfo:
    """What every tracker is told about the run it tracks."""

    run_dir: Path  # the run folder; its name is the tracked run's name
    store: Path  # where local stores go (train.tracking_dir, else run_dir)
    config: dict = field(default_factory=dict)  # the resolved config: the parameters
    labels: list[str] = field(default_factory=list)  # train.tags
    group: str = ""  # train.group (a sweep's name)
    job: str = ""  # pretrain, finetune, ...

    @property
    def tags(self) -> dict[str, str]:
        """MLflow's tags: each label with an empty value, and the run's folder, job and group."""
        tags = {t: "" for t in self.labels} | {"pretune.run_dir": str(self.run_dir.resolve())}
        return tags | ({"pretune.job": self.job} if self.job else {}) | (
            {"pretune.group": self.group} if self.group else {})


@contextlib.contextmanager
def _one_at_a_time(lock: Path | None):
    """Hold an exclusive lock on the file ``lock`` (None: no lock): the trials of a sweep that start together must
    not create one sqlite store's tables, or its first experiment, at the same time."""
    if lock is None:
        yield
        return
    import fcntl

    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


class MlflowRun:
    """One MLflow run through ``MlflowClient`` (no global active run, so several may be open in one process)."""

    name = "mlflow"
    local = ("mlruns.db", "mlartifacts", ".mlruns.lock")  # what it writes into its store folder

    def __init__(self, info: RunInfo, record: dict | None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{info.store.resolve() / 'mlruns.db'}"
        self.local_store = not os.environ.get("MLFLOW_TRACKING_URI")
        with _one_at_a_time(info.store / ".mlruns.lock" if self.local_store else None):
            self.client = MlflowClient(tracking_uri=uri)  # a new sqlite store creates its tables (seconds)
            if record and record.get("tracking_uri") == uri:  # --resume: the same run goes on
                self.run_id = record["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")
                logged = self.client.get_run(self.run_id).data.params
            else:
                experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
                self.run_id = self.client.create_run(self._experiment(experiment, info.store),
                                                     run_name=info.run_dir.name, tags=info.tags).info.run_id
                logged = {}
        # parameters cannot change once logged: a resumed run adds the keys it did not have (run.yaml holds the rest)
        params = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in _flat(info.config).items() if k not in logged]
        for i in range(0, len(params), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MLFLOW_BATCH])
        self.record = {"tracking_uri": uri, "run_id": self.run_id}

    def _experiment(self, name: str, store: Path) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        where = (store.resolve() / "mlartifacts").as_uri() if self.local_store else None  # a server chooses its own
        try:
            return self.client.create_experiment(name, artifact_location=where)
        except Exception:  # another trial of the sweep created it first (on a server)
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log(self, step: int, split: str, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(f"{split}/{k}", float(v), now, step)
                                                    for k, v in values.items()])

    def log_artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=path.name)
            else:
                self.client.log_artifact(self.run_id, str(path))

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class WandbRun:
    """One Weights & Biases run, offline unless ``$WANDB_MODE`` is set."""

    name = "wandb"
    local = ("wandb",)

    def __init__(self, info: RunInfo, record: dict | None):
        import wandb

        info.store.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, name=info.run_dir.name, dir=str(info.store),
            group=info.group or None, job_type=info.job or None, tags=list(info.labels), config=info.config,
            mode=None if os.environ.get("WANDB_MODE") else "offline",  # the user's WANDB_MODE wins
            id=record["id"] if record else None, resume="allow" if record else None,
            reinit="create_new",  # runs of several trials or tests in one process stay apart
            settings=wandb.Settings(console="off", silent=True))  # pretune's own output stays on the terminal
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # the x axis: the row's step, as in metrics.jsonl
        self.record = {"id": self.run.id, "dir": str(Path(self.run.dir).parent)}

    def log(self, step: int, split: str, values: dict[str, float]) -> None:
        self.run.log({"step": step, **{f"{split}/{k}": v for k, v in values.items()}})

    def log_artifacts(self, paths: list[Path]) -> None:
        import shutil

        files_dir = Path(self.run.dir)  # what `wandb sync` uploads: copies, so a later rewrite changes nothing there
        for path in paths:
            for f in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
                copy = files_dir / f.relative_to(path.parent)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, copy)
                self.run.save(str(copy), base_path=str(files_dir), policy="now")

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


TRACKERS = {"mlflow": MlflowRun, "wandb": WandbRun}  # train.report_to's names besides tensorboard
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}  # the package each one imports


class Trackers:
    """The open tracked runs of one training run (none on processes other than 0); each call reaches every one
    still working. Made by :func:`open_trackers`."""

    def __init__(self, runs: list | None = None):
        self.runs = list(runs or [])
        self.closed = False

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.runs]

    def _each(self, what: str, call) -> None:
        for run in list(self.runs):
            try:
                call(run)
            except Exception as e:  # a tracker's failure (network, store, its own bugs) never stops training
                self.runs.remove(run)
                warnings.warn(f"{run.name} tracking failed ({what}: {type(e).__name__}: {str(e)[:300]}); training "
                              "goes on without it, metrics.jsonl keeps every row", stacklevel=3)

    def log(self, step: int, split: str, values: dict[str, float]) -> None:
        """One row of metrics.jsonl: ``values`` at ``step`` under ``"{split}/{name}"``."""
        self._each(f"logging step {step}", lambda r: r.log(step, split, values))

    def log_artifacts(self, run_dir: str | os.PathLike, names: Iterable[str]) -> None:
        """Attach the files (or folders) ``names`` of ``run_dir`` that exist (plots, results.json, run.yaml)."""
        paths = [Path(run_dir) / n for n in names if (Path(run_dir) / n).exists()]
        if paths:
            self._each("adding artifacts", lambda r: r.log_artifacts(paths))

    def close(self, *, failed: bool = False) -> None:
        """End the tracked runs (``failed``: as failed); later calls do nothing."""
        if not self.closed:
            self.closed = True
            self._each("ending the run", lambda r: r.close(failed))

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def _import_or_explain(name: str) -> None:
    import importlib

    try:
        importlib.import_module(PACKAGES[name])
    except ImportError as e:
        raise ConfigError(f"train.report_to names {name}, but the {PACKAGES[name]} package is not installed ({e}): "
                          f"pip install 'pretune[{EXTRA}]' (or pip install {PACKAGES[name]}), or leave {name} out "
                          "of train.report_to") from None


def open_trackers(train, run_dir: str | os.PathLike, *, config: dict | None = None, job: str = "",
                  resume: bool = False, enabled: bool = True) -> Trackers:
    """Open the MLflow / W&B runs ``train.trackers`` names (a ``TrainConfig``; tensorboard is the logger's own).

    Args:
        train: the run's ``TrainConfig``: ``trackers``, ``tags``, ``group``, ``tracking_dir``.
        run_dir: the run folder; the run's name is its name, ``trackers.json`` goes there.
        config: the resolved config (``RunConfig.to_dict()``): the tracked run's parameters.
        job: ``pretrain``, ``finetune``, ...: the tag ``pretune.job`` (W&B: the job type).
        resume: continue the runs ``trackers.json`` names (``--resume``), else start new ones.
        enabled: False (processes other than 0 under torchrun): no tracker, nothing imported or written.

    A tracker whose package is missing raises ConfigError; one that fails to start warns and is left out.
    """
    wanted = [n for n in train.trackers if n in TRACKERS]
    if not enabled or not wanted:
        return Trackers()
    for name in wanted:
        _import_or_explain(name)
    run_dir = Path(run_dir)
    store = Path(train.tracking_dir) if train.tracking_dir else run_dir
    record_path = run_dir / RECORD_FILE
    records = json.loads(record_path.read_text()) if resume and record_path.is_file() else {}
    info = RunInfo(run_dir=run_dir, store=store, config=config or {}, labels=list(train.tags), group=train.group,
                   job=job)
    runs = []
    for name in wanted:
        try:
            runs.append(TRACKERS[name](info, records.get(name)))
        except Exception as e:  # an unreachable server, a locked store: train without it
            warnings.warn(f"{name} tracking could not start ({type(e).__name__}: {str(e)[:300]}); training goes on "
                          "without it, metrics.jsonl keeps every row", stacklevel=2)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(record_path, json.dumps({r.name: r.record for r in runs}, indent=1) + "\n", fsync=False)
    mine = [e for r in runs for e in r.local] if store.resolve() == run_dir.resolve() else []  # --overwrite: gone
    mark(run_dir, [RECORD_FILE, *mine])
    return Trackers(runs)


__all__ = ["TRACKERS", "RunInfo", "Trackers", "open_trackers", "RECORD_FILE"]
