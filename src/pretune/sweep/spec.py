"""A sweep spec (YAML or a dict) -> the trials it asks for, each checked before any runs.

A trial is one ordinary ``pretune pretrain|finetune|prompt`` run: the base settings, one point of the grid, one
case, one random draw, one seed. Its settings are a config layer (pretrain, finetune: merged over the base config
file into ``<out>/configs/<trial>.yaml``) or the prompt command's options (``--key value``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError, _did_you_mean

COMMANDS = ("pretrain", "finetune", "prompt")
SPEC_KEYS = ("command", "base", "grid", "cases", "random", "seeds", "metrics", "out")
DISTRIBUTIONS = {  # name -> what its arguments are (for messages)
    "log_uniform": "[low, high], both > 0: uniform in log space (learning rates)",
    "uniform": "[low, high]",
    "int_uniform": "[low, high]: an integer, both ends included",
    "choice": "[a, b, ...]: one of the values, each equally likely",
}
# keys the sweep sets itself in every trial: the run folder, the seed (from `seeds`) and the threads (from --jobs)
SET_BY_SWEEP = {"pretrain": {"train.out": "the trial folder", "train.seed": "`seeds: [...]`",
                             "train.threads": "the sweep (--threads / cores // --jobs)"},
                "prompt": {"seed": "`seeds: [...]`", "json": "the trial folder", "out": "the trial folder",
                           "overwrite": "the sweep", "quiet": "the sweep"}}
SET_BY_SWEEP["finetune"] = SET_BY_SWEEP["pretrain"]
TRACKING_DIR = "tracking"  # the sweep's local tracker stores (mlruns.db, mlartifacts/, wandb/), shared by its trials
SIGNIFICANT = 4  # random draws are rounded to this many significant digits (readable names, exact configs)


@dataclass
class SweepSpec:
    """A parsed, checked sweep spec (see ``pretune.sweep``'s docstring for the YAML format)."""

    command: str  # pretrain | finetune | prompt
    metrics: list[str]  # result names reported per trial: test.accuracy, eval.mlm_loss, metrics.accuracy, ...
    out: str = "runs/sweep"  # the sweep folder: trials/, configs/, logs/, results.jsonl, summary.md, *.png
    config: str = ""  # the base config file (pretrain, finetune); empty: the command's defaults
    base: dict = field(default_factory=dict)  # dotted key -> value, the same in every trial
    grid: dict = field(default_factory=dict)  # dotted key -> list of values (cartesian product)
    cases: list = field(default_factory=list)  # settings that vary together: each a dict (dotted key -> value),
    # combined with every grid point (an objective with its own steps and head); empty: none
    random_n: int = 0  # random-search draws (each combined with every grid point)
    random_seed: int = 0  # seed of the draws
    space: dict = field(default_factory=dict)  # dotted key -> (distribution, [arguments])
    seeds: list[int] = field(default_factory=lambda: [0])  # every setting runs once per seed
    source: str = "sweep spec"  # where the spec came from, for messages

    def to_dict(self) -> dict:
        """The spec as YAML-ready data (what ``<out>/sweep.yaml`` holds)."""
        base = ({"config": self.config} if self.config else {}) | self.base
        out = {"command": self.command, "base": base, "grid": self.grid, "seeds": self.seeds,
               "metrics": self.metrics, "out": self.out}
        if self.cases:
            out["cases"] = [dict(c) for c in self.cases]
        if self.random_n:
            out["random"] = {"n": self.random_n, "seed": self.random_seed,
                             "space": {k: {d: a} for k, (d, a) in self.space.items()}}
        return out


@dataclass(frozen=True)
class Trial:
    """One run of the sweep: a setting (the varied parameters) and a seed."""

    name: str  # its folder under <out>/trials, e.g. "lr=0.001,r=8,seed=0"
    setting: str  # the varied parameters without the seed, e.g. "lr=0.001,r=8" ("base" when nothing varies)
    params: dict  # dotted key -> value of the varied parameters (grid, case and random), not the seed
    seed: int


# ----------------------------------------------------------------------------------------------
# reading a spec
# ----------------------------------------------------------------------------------------------
def _register_resolvers() -> None:
    """``${bundled:PATH}`` (a bundled data file) and ``${realmodel:minilm|smollm2}`` (an offline checkpoint)."""
    from omegaconf import OmegaConf

    from ..runconfig import _bundled_path

    def realmodel(name: str) -> str:
        from ..io import realmodels

        finders = {"minilm": realmodels.minilm_dir, "smollm2": realmodels.smollm2_dir}
        if name not in finders:
            raise ConfigError(f"${{realmodel:{name}}}: expected one of {', '.join(finders)}")
        try:
            return str(finders[name]())
        except FileNotFoundError as e:
            raise ConfigError(f"${{realmodel:{name}}}: {e}") from None

    import warnings

    for name, fn in (("bundled", _bundled_path), ("realmodel", realmodel)):
        if not OmegaConf.has_resolver(name):
            with warnings.catch_warnings():  # OmegaConf 2.4 renamed it register_resolver; 2.3 has only this name
                warnings.simplefilter("ignore", UserWarning)
                OmegaConf.register_new_resolver(name, fn)


def _read_yaml(path: Path) -> dict:
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not path.is_file():
        raise ConfigError(f"sweep spec {path} does not exist")
    _register_resolvers()
    try:
        loaded = OmegaConf.load(path)
        data = OmegaConf.to_container(loaded, resolve=True)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    except ConfigError:
        raise
    except (OmegaConfBaseException, ValueError, UnicodeDecodeError) as e:
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else e
        raise ConfigError(f"{path}: {cause}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with the keys {', '.join(SPEC_KEYS)}")
    return data


def _flatten(values: dict, prefix: str = "") -> dict:
    """Nested sections -> dotted keys: ``{train: {lr: 1e-3}}`` -> ``{"train.lr": 1e-3}``."""
    out = {}
    for k, v in values.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _find_config(path: str, spec_dir: Path | None) -> str:
    """A base config path: as given (relative to the working folder), else relative to the spec file's folder."""
    if Path(path).is_file() or spec_dir is None:
        return path
    beside = spec_dir / path
    return str(beside) if beside.is_file() else path


def load_spec(spec: str | Path | dict, *, out: str | None = None) -> SweepSpec:
    """Read and check a sweep spec: a YAML file's path, or the same content as a dict. ``out`` replaces the
    spec's ``out``. Every mistake is a ConfigError naming the spec key and what was expected."""
    if isinstance(spec, SweepSpec):
        return spec if out is None else SweepSpec(**{**spec.__dict__, "out": out})
    if isinstance(spec, dict):
        data, source, spec_dir = dict(spec), "sweep spec", None
    else:
        data, source, spec_dir = _read_yaml(Path(spec)), str(spec), Path(spec).parent

    def bad(key: str, want: str, got: Any) -> ConfigError:
        return ConfigError(f"{source}: {key}: expected {want}, got {got!r}")

    for k in data:
        if k not in SPEC_KEYS:
            raise ConfigError(f"{source}: unknown key {k!r}{_did_you_mean(str(k), list(SPEC_KEYS))} (a sweep spec "
                              f"has {', '.join(SPEC_KEYS)})")
    command = data.get("command")
    if command not in COMMANDS:
        raise bad("command", f"one of {', '.join(COMMANDS)}", command)

    base = data.get("base") or {}
    if isinstance(base, str):
        base = {"config": base}
    if not isinstance(base, dict):
        raise bad("base", "a config file path, or a mapping of config keys (and `config: FILE`)", base)
    config = base.pop("config", "") or ""
    if not isinstance(config, str):
        raise bad("base.config", "a config file path", config)
    if config and command == "prompt":
        raise ConfigError(f"{source}: base.config: `pretune prompt` takes no config file; give its options in "
                          "base (model, data, template, labels, shots, ...)")
    if config:
        config = _find_config(config, spec_dir)
        if not Path(config).is_file():
            raise ConfigError(f"{source}: base.config: the config file {config} does not exist")
    base = _flatten(base)

    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise bad("grid", "a mapping of config keys to lists of values", grid)
    grid = _flatten(grid)
    for k, values in grid.items():
        if not isinstance(values, list) or not values:
            raise bad(f"grid.{k}", "a non-empty list of values", values)

    cases = data.get("cases") or []
    if not isinstance(cases, list) or not all(isinstance(c, dict) and c for c in cases):
        raise bad("cases", "a list of settings that vary together, each a non-empty mapping of config keys to values",
                  cases)
    cases = [_flatten(c) for c in cases]
    for i, case in enumerate(cases):
        if clash := sorted(set(case) & set(grid)):
            raise ConfigError(f"{source}: {clash[0]} is in both grid and cases[{i}]; give it in one of them")
    if len({json.dumps(c, sort_keys=True, default=str) for c in cases}) != len(cases):
        raise bad("cases", "distinct settings (two cases are the same)", cases)

    random_n, random_seed, space = 0, 0, {}
    if data.get("random") is not None:
        rnd = data["random"]
        if not isinstance(rnd, dict):
            raise bad("random", "a mapping {n: N, seed: S, space: {key: {distribution: [args]}}}", rnd)
        for k in rnd:
            if k not in ("n", "seed", "space"):
                raise ConfigError(f"{source}: unknown key random.{k}{_did_you_mean(str(k), ['n', 'seed', 'space'])}")
        random_n, random_seed = rnd.get("n"), rnd.get("seed", 0)
        if isinstance(random_n, bool) or not isinstance(random_n, int) or random_n < 1:
            raise bad("random.n", "the number of random draws (an integer >= 1)", random_n)
        if isinstance(random_seed, bool) or not isinstance(random_seed, int):
            raise bad("random.seed", "an integer", random_seed)
        raw = rnd.get("space")
        if not isinstance(raw, dict) or not raw:
            raise bad("random.space", "a mapping of config keys to {distribution: [args]}", raw)
        for k, dist in raw.items():
            space[k] = _distribution(f"{source}: random.space.{k}", dist)
        if clash := sorted(set(space) & set(grid)):
            raise ConfigError(f"{source}: {clash[0]} is in both grid and random.space; give it in one of them")
        if clash := sorted(set(space) & {k for c in cases for k in c}):
            raise ConfigError(f"{source}: {clash[0]} is in both cases and random.space; give it in one of them")

    seeds = data.get("seeds", [0])
    seeds = [seeds] if isinstance(seeds, int) and not isinstance(seeds, bool) else seeds
    if (not isinstance(seeds, list) or not seeds
            or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds) or len(set(seeds)) != len(seeds)):
        raise bad("seeds", "a list of distinct integers (each setting runs once per seed)", seeds)

    metrics = data.get("metrics")
    metrics = [metrics] if isinstance(metrics, str) else metrics
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise bad("metrics", "a result name or a list of them (finetune: test.accuracy, dev.macro_f1; pretrain: "
                  "eval.loss, eval.mlm_loss; prompt: metrics.accuracy)", metrics)

    out_dir = out if out is not None else data.get("out", "runs/sweep")
    if not isinstance(out_dir, str) or not out_dir:
        raise bad("out", "a folder path", out_dir)

    spec = SweepSpec(command=command, metrics=metrics, out=out_dir, config=config, base=base, grid=grid, cases=cases,
                     random_n=random_n, random_seed=random_seed, space=space, seeds=list(seeds), source=source)
    _check_reserved(spec)
    return spec


def _distribution(where: str, dist: Any) -> tuple[str, list]:
    if not isinstance(dist, dict) or len(dist) != 1:
        raise ConfigError(f"{where}: expected one distribution, {{name: [args]}} with name one of "
                          f"{', '.join(DISTRIBUTIONS)}; got {dist!r}")
    (name, args), = dist.items()
    if name not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: unknown distribution {name!r}{_did_you_mean(str(name), list(DISTRIBUTIONS))} "
                          f"(one of {', '.join(DISTRIBUTIONS)})")
    want = f"{name}: {DISTRIBUTIONS[name]}"
    if name == "choice":
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}: expected {want}; got {args!r}")
        return name, args
    numbers = isinstance(args, list) and len(args) == 2 and all(
        isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
    if not numbers or args[0] > args[1] or (name == "log_uniform" and args[0] <= 0) or (
            name == "int_uniform" and not all(isinstance(a, int) for a in args)):
        raise ConfigError(f"{where}: expected {want}; got {args!r}")
    return name, list(args)


def _check_reserved(spec: SweepSpec) -> None:
    reserved = SET_BY_SWEEP[spec.command]
    for where, keys in (("base", spec.base), ("grid", spec.grid), ("random.space", spec.space),
                        *((f"cases[{i}]", c) for i, c in enumerate(spec.cases))):
        for key in keys:
            norm = key.replace("-", "_")
            if norm in reserved:
                raise ConfigError(f"{spec.source}: {where}.{key}: set by the sweep from {reserved[norm]}; leave it "
                                  "out of the spec")


# ----------------------------------------------------------------------------------------------
# the trials
# ----------------------------------------------------------------------------------------------
def _round(x: float) -> float:
    return float(f"{x:.{SIGNIFICANT}g}")


def draws(spec: SweepSpec) -> list[dict]:
    """The random-search draws: ``random.n`` dicts (key -> value), the same for the same ``random.seed``."""
    import numpy as np

    rng = np.random.default_rng(spec.random_seed)
    out = []
    for _ in range(spec.random_n):
        point = {}
        for key, (name, args) in spec.space.items():
            if name == "log_uniform":
                point[key] = _round(float(np.exp(rng.uniform(np.log(args[0]), np.log(args[1])))))
            elif name == "uniform":
                point[key] = _round(float(rng.uniform(args[0], args[1])))
            elif name == "int_uniform":
                point[key] = int(rng.integers(args[0], args[1], endpoint=True))
            else:
                point[key] = args[int(rng.integers(len(args)))]
        out.append(point)
    return out


def _text(value: Any) -> str:
    """A parameter value as it appears in a trial's name."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.{SIGNIFICANT}g}"
    if isinstance(value, (list, tuple)):
        return "+".join(_text(v) for v in value)
    if isinstance(value, str) and ("/" in value or "\\" in value):
        value = Path(value).name  # a path: its file name
    text = re.sub(r"[^A-Za-z0-9._+\-]+", "-", str(value)).strip("-") or "empty"
    return text if len(text) <= 24 else text[:16] + "-" + hashlib.sha1(text.encode()).hexdigest()[:6]


def _short_names(keys: list[str]) -> dict[str, str]:
    """Each varied key's name in trial names: its last part (``train.lr`` -> ``lr``) unless two share it."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def _digest(params: dict) -> str:
    return hashlib.sha1(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:6]


def expand(spec: SweepSpec) -> list[Trial]:
    """Every trial of the spec, in order: grid points (the cartesian product, in the spec's key order) x cases x
    random draws x seeds. Settings that come out equal (a repeated random draw) run once."""
    grid_keys = list(spec.grid)
    points = [dict(zip(grid_keys, combo)) for combo in itertools.product(*(spec.grid[k] for k in grid_keys))]
    random_points = draws(spec) or [{}]
    case_keys = list(dict.fromkeys(k for c in spec.cases for k in c))
    short = _short_names(grid_keys + case_keys + list(spec.space))
    trials, seen = [], set()
    for point, case, drawn in itertools.product(points, spec.cases or [{}], random_points):
        params = {**point, **case, **drawn}
        setting = ",".join(f"{short[k]}={_text(v)}" for k, v in params.items()) or "base"
        key = json.dumps(params, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        for seed in spec.seeds:
            trials.append(Trial(name=f"{setting},seed={seed}" if params else f"seed={seed}", setting=setting,
                                params=params, seed=seed))
    names = [t.name for t in trials]
    if len(set(names)) != len(names):  # two values with the same text (long strings cut): tell them apart
        trials = [Trial(name=f"{t.name}-{_digest(t.params)}", setting=f"{t.setting}-{_digest(t.params)}",
                        params=t.params, seed=t.seed) for t in trials]
    return trials


# ----------------------------------------------------------------------------------------------
# a trial as a run: its config (pretrain, finetune) or options (prompt), and its command line
# ----------------------------------------------------------------------------------------------
def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def trial_settings(spec: SweepSpec, trial: Trial, folder: str | Path) -> dict:
    """The dotted settings of a trial over its base: the base's keys, its parameters, its seed and folder."""
    if spec.command == "prompt":
        return {**spec.base, **trial.params, "seed": trial.seed}
    return {**spec.base, **trial.params, "train.seed": trial.seed, "train.out": str(folder)}


def tracking_defaults(spec: SweepSpec) -> dict:
    """How a sweep's trials are tracked (``train.report_to``), unless its config file or base says otherwise: one
    tracked run per trial, grouped by the sweep's folder name (W&B's group, MLflow's tag ``pretune.group``), in one
    local store for the whole sweep, ``<out>/tracking`` (``$MLFLOW_TRACKING_URI`` still wins)."""
    return {"group": Path(spec.out).name, "tracking_dir": str(Path(spec.out).resolve() / TRACKING_DIR)}


def trial_config(spec: SweepSpec, trial: Trial, folder: str | Path) -> str:
    """A pretrain/finetune trial's whole config as YAML: the base config file with the trial's settings merged
    over it (interpolations such as ``${bundled:...}`` kept); ``pretune CMD --config FILE`` runs it."""
    from omegaconf import OmegaConf

    layers = [OmegaConf.create({"train": tracking_defaults(spec)})]  # under the config file and the spec's base
    if spec.config:
        loaded = OmegaConf.load(spec.config)
        if isinstance(loaded.get("model"), str):  # `model: tiny-gpt2` is short for `model: {preset: tiny-gpt2}`
            loaded.model = {"preset": loaded.model}
        layers.append(loaded)
    layers.append(OmegaConf.create(_nested(trial_settings(spec, trial, folder))))
    return OmegaConf.to_yaml(OmegaConf.merge(*layers))


def _option(key: str) -> str:
    return "--" + key.replace("_", "-")


def prompt_arguments(settings: dict) -> list[str]:
    """The prompt command's arguments from its settings: ``model`` is the positional MODEL, ``key: value`` is
    ``--key value`` (underscores as hyphens), ``true`` a bare switch, ``false``/null left out, a list repeats the
    option (``stop: [a, b]``)."""
    args = [str(settings["model"])] if "model" in settings else []
    for key, value in settings.items():
        if key == "model" or value is None or value is False:
            continue
        if value is True:
            args.append(_option(key))
        elif isinstance(value, list):
            for v in value:
                args += [_option(key), str(v)]
        else:
            args += [_option(key), str(value)]
    return args


def trial_command(spec: SweepSpec, trial: Trial, folder: Path, config_file: Path, *, threads: int,
                  mode: str | None) -> list[str]:
    """The command line of a trial: ``python -m pretune CMD ... --quiet``; ``mode`` is ``--resume``,
    ``--overwrite`` or None (a new run)."""
    cmd = [sys.executable, "-m", "pretune", spec.command]
    if spec.command == "prompt":  # not resumable: a rerun replaces its two files
        return cmd + prompt_arguments(trial_settings(spec, trial, folder)) + [
            "--json", str(folder / "results.json"), "--out", str(folder / "predictions.jsonl"), "--overwrite",
            "--quiet"]
    return cmd + ["--config", str(config_file), f"train.threads={threads}", "--quiet"] + ([mode] if mode else [])


def check_trials(spec: SweepSpec, trials: list[Trial]) -> None:
    """Build every trial's config in this process without running anything (pretrain: ``load_run_config``,
    finetune: ``load_finetune_config``; prompt: the command's argument parser, in one subprocess): an unknown
    key or a bad value is a ConfigError naming the trial and the key, before any trial runs."""
    if spec.command == "prompt":
        return _check_prompt(spec, trials)
    if spec.command == "pretrain":
        from ..jobs.pretrain import load_run_config as load
    else:
        from ..jobs.finetune import load_finetune_config as load
    import tempfile

    from omegaconf.errors import OmegaConfBaseException

    checked: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        for trial in trials:
            try:
                text = trial_config(spec, trial, Path(spec.out) / "trials" / trial.name)
            except OmegaConfBaseException as e:
                raise ConfigError(f"{spec.source}: trial {trial.name}: cannot merge its settings over "
                                  f"{spec.config or 'the defaults'}: {e}") from None
            if text in checked:
                continue
            path = Path(tmp) / "trial.yaml"
            path.write_text(text)
            try:
                load(path, ())
            except ConfigError as e:
                raise ConfigError(f"{spec.source}: trial {trial.name}: {e}") from None
            except (AttributeError, TypeError, ValueError) as e:  # a value of the wrong shape (a section as text)
                raise ConfigError(f"{spec.source}: trial {trial.name}: its config is not valid ({e}); "
                                  f"{_configs_hint(spec)}") from None
            checked.add(text)


def _configs_hint(spec: SweepSpec) -> str:
    return (f"check the keys of base and grid against `pretune {spec.command} --print-config` (sections are "
            "mappings: `train.lr: 1e-3` or `train: {lr: 1e-3}`)")


def _check_prompt(spec: SweepSpec, trials: list[Trial]) -> None:
    import subprocess

    argvs = [prompt_arguments(trial_settings(spec, t, Path(spec.out) / "trials" / t.name)) for t in trials]
    proc = subprocess.run([sys.executable, "-m", "pretune.cli.sweep", "--check-prompt"], input=json.dumps(argvs),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"{spec.source}: could not check the prompt options: {proc.stderr.strip()[-500:]}")
    for trial, error in zip(trials, json.loads(proc.stdout)):
        if error:
            raise ConfigError(f"{spec.source}: trial {trial.name}: {error}")
