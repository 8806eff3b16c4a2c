"""Running a sweep: its folder and state file, each trial as a subprocess (or a submitit job), the live table.

The sweep folder (``out``)::

    sweep.yaml          the spec as run (values resolved)
    sweep_state.json    the sweep's own record: each trial's status, attempts, wall time, error tail
    configs/<trial>.yaml   each trial's whole config (prompt: its options); `pretune CMD --config` reruns one
    trials/<trial>/     each trial's ordinary run folder (run.yaml, metrics.jsonl, results.json, model/, ...)
    logs/<trial>.log    each trial's output (stdout and stderr), every attempt appended
    submitit/           submitit's job files (--executor local / slurm)
    tracking/           the trials' MLflow store and W&B offline runs (train.report_to; docs/tracking.md)
    results.jsonl, results.csv, summary.md, curves.png, bars.png   the report (pretune.sweep.report)

A rerun of the same spec continues: a trial the state file records as done whose results are there is skipped;
one that was running or failed runs again, with ``--resume`` when its folder holds a checkpoint, else
``--overwrite`` (it starts over; only what that run wrote is removed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from ..config import ConfigError
from ..io.outputs import MARKER, check_folder, claim, clean_run_folder, owned_entries, write_atomic
from .nodes import launch_settings
from .report import REPORT_FILES, SweepResult, trial_metrics, write_report
from .spec import (
    TRACKING_DIR,
    SweepSpec,
    Trial,
    check_trials,
    expand,
    load_spec,
    trial_command,
    trial_config,
    trial_settings,
)

STATE_FILE = "sweep_state.json"
SPEC_FILE = "sweep.yaml"
SWEEP_ENTRIES = (SPEC_FILE, STATE_FILE, "configs", "trials", "logs", "submitit", TRACKING_DIR, *REPORT_FILES)
RESULT_OF = {"pretrain": "model", "finetune": "results.json", "prompt": "results.json"}  # present: it finished
EXECUTORS = ("processes", "local", "slurm")
TAIL_LINES = 20  # lines of a failed trial's output kept in the state file and results
STOP_GRACE_S = 120  # seconds an interrupted trial gets to write its checkpoint before it is killed


def cores() -> int:
    """CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def plan(spec: str | Path | dict | SweepSpec, *, out: str | None = None) -> tuple[SweepSpec, list[Trial]]:
    """Read the spec, expand its trials and check each trial's config without running anything (a ConfigError
    names the trial and the key); nothing is written."""
    spec = load_spec(spec, out=out)
    trials = expand(spec)
    check_trials(spec, trials)
    return spec, trials


# ----------------------------------------------------------------------------------------------
# executors: start a command, poll it, stop it
# ----------------------------------------------------------------------------------------------
def run_command(argv: list[str], *, env: dict, log_path: str, cwd: str | None = None) -> dict:
    """Run one trial's command line to its end, its stdout and stderr appended to ``log_path``; returns
    ``{"returncode", "seconds"}``. What a submitit job runs."""
    t0 = time.time()
    with open(log_path, "ab") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=cwd).returncode
    return {"returncode": rc, "seconds": time.time() - t0}


class Processes:
    """Trials as child processes of the sweep (``--executor processes``)."""

    def start(self, argv: list[str], env: dict, log_path: Path):
        with open(log_path, "ab") as f:
            return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})

    def poll(self, proc) -> int | None:
        return proc.poll()

    def stop(self, proc, grace: float) -> None:
        """SIGTERM: the trial finishes its step, writes a checkpoint and exits; killed after ``grace`` seconds."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Submitit:
    """Trials as submitit jobs: ``cluster="local"`` (its local executor) or ``"slurm"``; ``params`` go to
    ``AutoExecutor.update_parameters`` (timeout_min, slurm_partition, gpus_per_node, cpus_per_task, ...)."""

    def __init__(self, folder: Path, cluster: str, params: dict, *, launch: dict | None = None):
        try:
            import submitit
        except ImportError:
            raise ConfigError(f"--executor {cluster} runs trials through submitit, which is not installed: "
                              "pip install 'pretune[sweep]' (or pip install submitit)") from None
        self.executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
        try:
            self.executor.update_parameters(**params)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--executor {cluster}: submitit refused the parameters {params}: {e}") from None
        self.launch = launch  # multi-node trials (--slurm-nodes): nodes.launch_settings

    def start(self, argv: list[str], env: dict, log_path: Path):
        if self.launch:  # every task (one per node) starts its node's torchrun launcher
            from .nodes import run_on_nodes

            job = self.executor.submit(run_on_nodes, argv, env=env, log_path=str(log_path.resolve()), cwd=os.getcwd(),
                                       nproc_per_node=self.launch["nproc_per_node"], host=self.launch["host"])
        else:
            job = self.executor.submit(run_command, argv, env=env, log_path=str(log_path.resolve()), cwd=os.getcwd())
        return job, log_path

    def poll(self, handle) -> int | None:
        job, log_path = handle
        if not job.done():
            return None
        try:  # one result per task: a multi-node trial's nodes, the first failure counts
            return next((int(r["returncode"]) for r in job.results() if r["returncode"]), 0)
        except Exception as e:  # noqa: BLE001 - the job itself failed (killed, timed out, node lost): say so in its log
            with open(log_path, "a") as f:
                f.write(f"\nsubmitit job {job.job_id} failed (its files: {job.paths.folder}):\n{e}\n")
            return -1

    def stop(self, handle, grace: float) -> None:
        handle[0].cancel(check=False)


# ----------------------------------------------------------------------------------------------
# the folder and the state file
# ----------------------------------------------------------------------------------------------
def _read_state(out: Path) -> dict:
    try:
        data = json.loads((out / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data.get("trials", {}) if isinstance(data, dict) else {}


def _save_state(out: Path, trials: dict) -> None:
    write_atomic(out / STATE_FILE, json.dumps({"written_by": "pretune sweep", "trials": trials}, indent=1) + "\n",
                 fsync=False)


def _config_text(spec: SweepSpec, trial: Trial, folder: Path) -> str:
    if spec.command == "prompt":
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(OmegaConf.create(trial_settings(spec, trial, folder)))
    return trial_config(spec, trial, folder)


def _same_config(old: str, new: str) -> bool:
    """Two trial configs equal but for the run folder's spelling (``runs/x`` vs ``./runs/x``) and where the rows are
    tracked (the trackers, tags, group and store: logging, which a resumed run may change too)."""
    import yaml

    def norm(text: str):
        data = yaml.safe_load(text) or {}
        if isinstance(data.get("train"), dict):
            for key in ("out", "report_to", "tensorboard", "tags", "group", "tracking_dir"):
                data["train"].pop(key, None)
        return data

    return old == new or norm(old) == norm(new)


def _open_folder(spec: SweepSpec, trials: list[Trial], *, overwrite: bool, log) -> Path:
    """The sweep folder, ready: a new (or empty) folder, or an earlier run of this sweep (continued; a trial whose
    config changed since it ran is refused), or with ``overwrite`` what an earlier sweep wrote there removed."""
    out = Path(spec.out)
    ours = (out / STATE_FILE).is_file() and STATE_FILE in owned_entries(out)
    if ours and overwrite:
        removed = clean_run_folder(out)
        log(f"--overwrite: removed {', '.join(removed)} of the earlier sweep in {out}")
        ours = False
    if not ours:
        check_folder(out, overwrite=overwrite, what="sweep")
    else:
        for t in trials:
            old = out / "configs" / f"{t.name}.yaml"
            ran = (out / "trials" / t.name).is_dir()
            if ran and old.is_file() and not _same_config(old.read_text(), _config_text(spec, t, out / "trials" /
                                                                                        t.name)):
                raise ConfigError(f"{out}: trial {t.name} ran with another config ({old}) than the spec now gives; "
                                  "run the changed spec in another folder (--out), or start this sweep over with "
                                  "--overwrite")
    out.mkdir(parents=True, exist_ok=True)
    claim(out, SWEEP_ENTRIES, what="sweep")
    for sub in ("configs", "trials", "logs"):
        (out / sub).mkdir(exist_ok=True)
    return out


def finished(spec: SweepSpec, out: Path, name: str, state: dict) -> bool:
    """Whether the trial is done: the state file says so and its results are in its folder."""
    return state.get(name, {}).get("status") == "done" and (out / "trials" / name / RESULT_OF[spec.command]).exists()


def launch_mode(command: str, folder: Path) -> str | None:
    """How an unfinished trial starts: ``--resume`` (its folder holds a run with a checkpoint), ``--overwrite``
    (it holds something of an earlier attempt) or None (a new run)."""
    from ..train.state import list_checkpoints

    if command == "prompt" or not folder.is_dir() or not [p for p in folder.iterdir() if p.name != MARKER]:
        return None
    if (folder / "run.yaml").is_file() and list_checkpoints(folder):
        return "--resume"
    return "--overwrite"


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


# ----------------------------------------------------------------------------------------------
# the live table
# ----------------------------------------------------------------------------------------------
class _Table:
    """The live progress table (rich): every trial's state, time and metrics."""

    STYLE = {"pending": "dim", "running": "yellow", "done": "green", "failed": "red", "interrupted": "magenta"}

    def __init__(self, spec: SweepSpec, trials: list[Trial], state: dict, enabled: bool):
        self.spec, self.trials, self.state, self.live = spec, trials, state, None
        self.values: dict[str, dict] = {}
        if enabled:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(self.render(), console=Console(stderr=True), refresh_per_second=2, transient=False)
            self.live.start()

    def render(self):
        from rich.table import Table

        st = {t.name: self.state.get(t.name, {}) for t in self.trials}
        counts = {s: sum(v.get("status", "pending") == s for v in st.values()) for s in self.STYLE}
        table = Table(title=f"pretune sweep ({self.spec.command}): " + ", ".join(
            f"{n} {s}" for s, n in counts.items() if n), title_justify="left")
        table.add_column("trial", no_wrap=True)
        table.add_column("state", no_wrap=True)
        for col in ("time (s)", *self.spec.metrics):
            table.add_column(col, justify="right")
        shown = self.trials if len(self.trials) <= 40 else [t for t in self.trials if st[t.name].get("status")
                                                             not in (None, "pending")]
        now = time.time()
        for t in shown:
            s = st[t.name]
            status = s.get("status", "pending")
            secs = now - s["started"] if status == "running" and "started" in s else s.get("wall_seconds")
            label = status + (f" ({s['mode'].lstrip('-')})" if status == "running" and s.get("mode") else "")
            vals = self.values.get(t.name, {})
            table.add_row(t.name, f"[{self.STYLE.get(status, '')}]{label}", "" if secs is None else f"{secs:.0f}",
                          *("" if vals.get(m) is None else f"{vals[m]:.4g}" for m in self.spec.metrics))
        if len(shown) < len(self.trials):
            table.caption = f"{len(self.trials) - len(shown)} pending trials not shown"
        return table

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self.render())

    def close(self) -> None:
        if self.live is not None:
            self.live.update(self.render())
            self.live.stop()
            self.live = None


# ----------------------------------------------------------------------------------------------
# the sweep
# ----------------------------------------------------------------------------------------------
def run_sweep(spec: str | Path | dict | SweepSpec, *, out: str | None = None, jobs: int = 1,
              executor: str = "processes", threads: int | None = None, cluster: dict | None = None,
              overwrite: bool = False, show_progress: bool = True, log=print) -> SweepResult:
    """Run every unfinished trial of a sweep and aggregate all of them; returns the aggregated results.

    Args:
        spec: a sweep spec YAML file, the same content as a dict, or a SweepSpec (format: ``pretune.sweep``).
        out: the sweep folder (default: the spec's ``out``); rerunning in it continues the sweep.
        jobs: trials run at once.
        executor: ``processes`` (child processes), ``local`` (submitit's local executor) or ``slurm``
            (submitit on Slurm; needs ``pip install 'pretune[sweep]'``).
        threads: torch threads per trial (``train.threads``, OMP_NUM_THREADS); default ``max(1, cores // jobs)``
            (slurm: ``cluster["cpus_per_task"]``, else 1).
        cluster: submitit parameters (``timeout_min``, ``slurm_partition``, ``gpus_per_node``,
            ``cpus_per_task``, ``mem_gb``, ``slurm_account``, ...) for ``local`` / ``slurm``; ``nodes``: each trial
            a torchrun launch on that many nodes (:mod:`pretune.sweep.nodes`).
        overwrite: start over in a folder that holds an earlier sweep (what it wrote is removed, nothing else).
        show_progress: the live table (rich) on stderr.
        log: where the progress lines go (a line per finished trial; ``print`` by default).

    Every trial's config is checked before any runs (a ConfigError names the trial and the key). A failed trial
    is recorded (its output's tail in the state file and results, the whole output in ``logs/<trial>.log``) and
    the others go on; Ctrl-C (or SIGTERM) stops the running trials at a checkpoint and writes the report of what
    finished; run again to continue.
    """
    if executor not in EXECUTORS:
        raise ConfigError(f"executor {executor!r}: expected one of {', '.join(EXECUTORS)}")
    if jobs < 1:
        raise ConfigError(f"jobs={jobs}: expected at least 1 trial at a time")
    spec, trials = plan(spec, out=out)
    cluster = dict(cluster or {})
    launch = launch_settings(cluster, executor=executor, command=spec.command)  # --slurm-nodes: torchrun trials
    if threads is None:
        threads = max(1, cores() // jobs) if executor != "slurm" else int(cluster.get("cpus_per_task", 1))
        threads = max(1, threads // (launch["per_machine"] if launch else 1))  # the processes sharing a machine
    if threads < 1:
        raise ConfigError(f"threads={threads}: expected at least 1")
    out = _open_folder(spec, trials, overwrite=overwrite, log=log)
    from omegaconf import OmegaConf

    write_atomic(out / SPEC_FILE, OmegaConf.to_yaml(OmegaConf.create(spec.to_dict())))
    for t in trials:
        write_atomic(out / "configs" / f"{t.name}.yaml", _config_text(spec, t, out / "trials" / t.name), fsync=False)
    state = _read_state(out)
    todo = [t for t in trials if not finished(spec, out, t.name, state)]
    if len(todo) < len(trials):
        log(f"{len(trials) - len(todo)} of {len(trials)} trials already done in {out}; running the other {len(todo)}")
    for t in todo:
        if state.get(t.name, {}).get("status") in ("running", "done"):
            state[t.name]["status"] = "interrupted"
    if executor == "processes":
        launcher = Processes()
    else:
        cluster.setdefault("timeout_min", 24 * 60)
        if executor == "slurm":
            cluster.setdefault("cpus_per_task", threads)
        launcher = Submitit(out / "submitit", executor, cluster, launch=launch)
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    table = _Table(spec, trials, state, enabled=show_progress)
    for t in trials:
        if finished(spec, out, t.name, state):
            table.values[t.name] = trial_metrics(out / "trials" / t.name, spec.metrics)
    running: dict[str, tuple[Trial, object]] = {}

    def finish(t: Trial, rc: int) -> None:
        st = state[t.name]
        seconds = time.time() - st.pop("started")
        st.pop("mode", None)
        st["wall_seconds"] = st.get("wall_seconds", 0.0) + seconds
        st["returncode"] = rc
        log_path = out / "logs" / f"{t.name}.log"
        if rc == 0 and (out / "trials" / t.name / RESULT_OF[spec.command]).exists():
            st["status"] = "done"
            st.pop("error", None)
            table.values[t.name] = vals = trial_metrics(out / "trials" / t.name, spec.metrics)
            log(f"done    {t.name} ({seconds:.0f}s): " + ", ".join(
                f"{m} {'—' if v is None else f'{v:.4g}'}" for m, v in vals.items()))
        else:
            st["status"] = "failed"
            st["error"] = _tail(log_path)
            last = (st["error"].strip().splitlines() or ["(no output)"])[-1]
            log(f"FAILED  {t.name} (exit {rc}): {last}  [{log_path}]")
        _save_state(out, state)

    restore = _on_sigterm_interrupt()
    try:
        while todo or running:
            while todo and len(running) < jobs:
                t = todo.pop(0)
                folder = out / "trials" / t.name
                mode = launch_mode(spec.command, folder)
                folder.mkdir(parents=True, exist_ok=True)
                argv = trial_command(spec, t, folder, out / "configs" / f"{t.name}.yaml", threads=threads, mode=mode)
                st = state.setdefault(t.name, {})
                st.update(status="running", started=time.time(), mode=mode or "", attempts=st.get("attempts", 0) + 1)
                log_path = out / "logs" / f"{t.name}.log"
                with open(log_path, "a") as f:
                    f.write(f"=== pretune sweep, attempt {st['attempts']} ({time.strftime('%Y-%m-%d %H:%M:%S')}): "
                            + " ".join(argv) + "\n")
                _save_state(out, state)
                running[t.name] = (t, launcher.start(argv, env, log_path))
            for name, (t, handle) in list(running.items()):
                rc = launcher.poll(handle)
                if rc is not None:
                    del running[name]
                    finish(t, rc)
            table.refresh()
            if running:
                time.sleep(0.2)
    except KeyboardInterrupt:
        table.close()
        log(f"interrupted: stopping {len(running)} running trial(s) at a checkpoint ...")
        for name, (_, handle) in running.items():
            launcher.stop(handle, STOP_GRACE_S)
            st = state[name]
            st["wall_seconds"] = st.get("wall_seconds", 0.0) + time.time() - st.pop("started")
            st["status"] = "interrupted"
            st.pop("mode", None)
        _save_state(out, state)
        write_report(spec, trials, state, out)
        log(f"the sweep in {out} was interrupted; run the same command again to continue it (finished trials are "
            "kept, interrupted ones resume from their checkpoints)")
        raise
    finally:
        restore()
        table.close()
    return write_report(spec, trials, state, out)


def _on_sigterm_interrupt():
    """SIGTERM to the sweep stops it as Ctrl-C does; returns the function that restores the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)


def aggregate(out: str | Path) -> SweepResult:
    """The report of an existing sweep folder, rewritten from what its trials hold now (nothing runs)."""
    from omegaconf import OmegaConf

    out = Path(out)
    if not (out / SPEC_FILE).is_file():
        raise ConfigError(f"{out} holds no sweep ({SPEC_FILE} is missing)")
    spec = load_spec(OmegaConf.to_container(OmegaConf.load(out / SPEC_FILE)), out=str(out))
    return write_report(spec, expand(spec), _read_state(out), out)
