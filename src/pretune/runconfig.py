"""Run configs: the sections every job shares (``train``, pretraining's ``data``) and the layering of them.

Precedence: preset → YAML file → command-line flags → ``section.key=value`` overrides. OmegaConf reads and
merges the YAML and dot-list layers (types, interpolation); every section is then validated by its typed
dataclass (``section``), so an unknown key or a bad value is an error naming the nearest valid one. A section
owned by what it names is built by ``owned_section`` from its owner's Settings: ``objective`` by each objective
(``pretune.objectives``: ``objective_settings``), ``task`` by each task (``pretune.tasks``: ``task_settings``),
``peft`` by the PEFT methods (``pretune.peft.config``: ``peft_settings``); the other finetuning sections are
``pretune.jobs.finetune``'s, and ``pretune.jobs.pretrain.load_run_config`` assembles a pretraining run. No torch
import here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from .config import ConfigError, ModelConfig, _did_you_mean


@dataclass
class DataConfig:
    """Where the pretraining text comes from and how it becomes fixed-length blocks."""

    train: list[str] = field(default_factory=list)  # text files, folders or globs (.txt/.jsonl/.csv/.tsv/.parquet, .gz)
    eval: list[str] = field(default_factory=list)  # held-out sources; empty: hold out eval_fraction of the blocks
    eval_fraction: float = 0.01  # share of blocks held out when `eval` is empty (at least 1 block, at most eval_max)
    eval_max: int = 512  # cap on held-out blocks, so evaluation stays cheap on a large corpus
    field: str = "text"  # JSONL/CSV/Parquet column holding the text
    doc_split: Literal["blank_line", "line", "file"] = "blank_line"  # what a document is in plain-text files
    errors: Literal["strict", "replace"] = "strict"  # non-UTF-8 bytes: stop with file+offset, or replace with U+FFFD
    clean: bool = False  # apply the C4 cleaning rules (pretune data clean) before tokenizing
    store: str = ""  # token store folder; empty: <train.out>/data (built once, resumable, reused by --resume)
    block_size: int = 0  # tokens per block before the objective's special tokens; 0: as many as the model allows
    packing: Literal["full", "doc"] = "full"  # RoBERTa FULL-SENTENCES (cross documents) or DOC-SENTENCES (never)
    bucket: bool = False  # batch blocks of similar length together (useful with packing=doc: less padding)


@dataclass
class TrainConfig:
    """The optimisation loop (shared by pretraining and finetuning)."""

    out: str = "runs/pretrain"  # run folder: checkpoints/, model/, metrics.jsonl, tb/, loss.png
    steps: int = 1000  # optimizer steps
    batch_size: int = 32  # examples per optimizer step, summed over processes and accumulation micro-batches
    grad_accum: int = 1  # micro-batches per step; the loss is normalised by target tokens across all of them
    lr: float = 5e-4  # peak learning rate
    weight_decay: float = 0.01  # AdamW decoupled weight decay (not on biases and norms)
    beta1: float = 0.9  # AdamW β1
    beta2: float = 0.999  # AdamW β2 (RoBERTa: 0.98 for large batches)
    eps: float = 1e-8  # AdamW ε
    amsgrad: bool = False  # AMSGrad variant: keep the max of the second-moment estimates
    schedule: Literal["linear", "cosine", "constant", "inverse_sqrt"] = "linear"  # after warmup; inverse_sqrt = T5
    warmup_steps: int = 0  # linear warmup (inverse_sqrt: constant lr for these steps, as T5)
    min_lr_ratio: float = 0.0  # linear/cosine decay floor as a fraction of lr
    clip: float = 1.0  # gradient-norm clipping; 0 disables
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # bf16: autocast matmuls to bfloat16, fp32 master
    # weights; auto: bf16 where the device computes it natively (CPU AMX / AVX512-BF16, CUDA), else fp32 (never fp16);
    # fp16: float16 autocast with a dynamic loss scale (overflowing steps skipped), for GPUs without bf16
    parallel: Literal["ddp", "fsdp"] = "ddp"  # under torchrun: ddp replicates the model; fsdp shards parameters,
    # gradients and AdamW state over the processes (FSDP2) and writes sharded checkpoints; one process: no wrapper
    activation_checkpointing: Literal["none", "blocks"] = "none"  # blocks: recompute each transformer block's
    # activations in the backward instead of keeping them (less memory, about one more forward of compute)
    cpu_offload: bool = False  # fsdp on GPUs: keep the sharded parameters, gradients and AdamW state in CPU memory
    compile: bool = False  # torch.compile each transformer block (slow first steps, faster after)
    eval_every: int = 200  # evaluate every N steps (and at the end); 0: only at the end
    eval_batches: int = 0  # cap on evaluation batches; 0: the whole held-out set
    save_every: int = 500  # write a resumable checkpoint every N steps (and at the end); 0: only at the end
    keep_last: int = 2  # resumable checkpoints kept in <out>/checkpoints; 0: write none (no --resume)
    log_every: int = 10  # training metrics to metrics.jsonl (and report_to's trackers) every N steps
    seed: int = 0  # model init, data order and corruption
    threads: int = 0  # torch CPU threads; 0: torch's default
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = field(default_factory=lambda: ["tensorboard"])
    # trackers each logged row also goes to (docs/tracking.md): tensorboard (<out>/tb), mlflow ($MLFLOW_TRACKING_URI,
    # else sqlite <tracking_dir>/mlruns.db), wandb (offline unless $WANDB_MODE is set); []: metrics.jsonl only
    tensorboard: bool | None = None  # the older switch, kept as an alias: true adds tensorboard to report_to, false
    # removes it; unset (null): report_to decides
    tags: list[str] = field(default_factory=list)  # labels of the tracked run (W&B tags; MLflow tags, empty values)
    group: str = ""  # runs tracked together: W&B's group, MLflow's tag pretune.group; a sweep sets its own name
    tracking_dir: str = ""  # where the local tracker stores go (mlruns.db, mlartifacts/, wandb/); empty: <out>;
    # a sweep sets its tracking/ folder, so that its trials share one store
    plot: bool = True  # draw <out>/loss.png at the end

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers this run writes to: ``report_to`` (duplicates dropped) with the ``tensorboard`` alias
        applied."""
        names = [n for n in dict.fromkeys(self.report_to) if n != "tensorboard" or self.tensorboard is not False]
        if self.tensorboard and "tensorboard" not in names:
            names.insert(0, "tensorboard")
        return tuple(names)


@dataclass
class RunConfig:
    """A whole pretraining run. ``model`` is a preset name plus field overrides, or an ``init`` checkpoint."""

    model: dict = field(default_factory=lambda: {"preset": "tiny-bert-base"})
    tokenizer: str = ""  # tokenizer.json (pretune tokenizer train) or a folder holding one
    data: DataConfig = field(default_factory=DataConfig)
    objective: Any = None  # the objective's own settings (pretune.objectives: OBJECTIVES[name].Settings)
    train: TrainConfig = field(default_factory=TrainConfig)

    SECTIONS = {"data": DataConfig, "train": TrainConfig}

    def to_dict(self) -> dict:
        objective = dataclasses.asdict(self.objective) if self.objective is not None else {"name": "mlm"}
        return {"model": dict(self.model), "tokenizer": self.tokenizer, "data": dataclasses.asdict(self.data),
                "objective": objective, "train": dataclasses.asdict(self.train)}

    def model_config(self, vocab_size: int | None = None, **extra: Any) -> ModelConfig:
        """The ModelConfig: preset (``model.preset``) with the other ``model.*`` keys as overrides."""
        from .presets import get_preset

        spec = dict(self.model)
        preset = spec.pop("preset", None)
        spec.pop("init", None)
        if vocab_size is not None:
            spec.setdefault("vocab_size", vocab_size)
        spec.update(extra)
        if preset:
            return get_preset(preset, **spec)
        return ModelConfig.from_dict(spec)

    def save(self, path: str | Path) -> None:
        from omegaconf import OmegaConf

        Path(path).write_text(OmegaConf.to_yaml(OmegaConf.create(self.to_dict())))


_KIND = {float: "a number", int: "an integer", bool: "true or false", str: "text", type(None): "null"}


def _check_type(section: str, name: str, value: Any, tp: Any) -> Any:
    where = f"{section}.{name}"
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # e.g. float | Literal["auto"]: the first arm that takes it
        for arm in get_args(tp):
            try:
                return _check_type(section, name, value, arm)
            except ConfigError:
                pass
        wants = [repr(a) for arm in get_args(tp) for a in (get_args(arm) if get_origin(arm) is Literal else ())]
        kinds = [_KIND.get(arm, str(arm)) for arm in get_args(tp) if get_origin(arm) is not Literal]
        raise ConfigError(f"{where}={value!r}: expected {' or '.join(kinds + wants)}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{where}={value!r} is not one of {list(get_args(tp))}"
                              f"{_did_you_mean(str(value), [str(a) for a in get_args(tp)])}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        (item,) = get_args(tp) or (str,)
        if get_origin(item) is Literal:  # e.g. list[Literal["tensorboard", "mlflow"]]: each item one of them
            return [_check_type(section, name, v, item) for v in value]
        return [str(v) for v in value]
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{where} must be null, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        return "" if value is None else str(value)  # `key=` on the command line reads as null
    return value


def section(section: str, cls: type, values: dict) -> Any:
    """A typed config section from a mapping: unknown keys and wrong types are errors naming the key. A section
    owned by what it names (``task``, ``peft``) picks its own class: ``cls.from_values(values)``."""
    owned = getattr(cls, "from_values", None)
    if owned is not None:
        return owned(values)
    return _typed(section, cls, values)


def _typed(section: str, cls: type, values: dict) -> Any:

    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    out = {}
    for k, v in values.items():
        if k not in names:
            raise ConfigError(f"unknown key {section}.{k}{_did_you_mean(k, names)}")
        out[k] = _check_type(section, k, v, hints[k])
    return cls(**out)


def _default(f) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def owned_section(section: str, cls: type, values: dict, *, kind: str, name: str, owners: dict[str, type],
                  selector: str = "name", others: Literal["default", "any"] = "default") -> Any:
    """A section whose keys belong to what it names (an objective, a task, PEFT methods): ``values`` as ``cls``, the
    Settings dataclass of ``kind`` ``name`` (``values[selector]`` named it), type-checked and validated
    (``cls.validate()``). A key ``cls`` lacks that another of ``owners`` (name -> its Settings) has is left out: with
    ``others="any"`` once that one has checked its value (a sweep may share settings across tasks, and a bad value is
    an error wherever it is set; the section then holds, and run.yaml shows, what applies), with
    ``others="default"`` only at that one's default (a run.yaml written before the settings were split lists every
    key), an error otherwise. A key nobody has is an error naming the nearest of ``cls``'s."""
    own = [f.name for f in fields(cls)]
    listed = ", ".join(sorted(set(own) - {selector}))
    kept = {}
    for key, value in values.items():
        if key in own:
            kept[key] = value
            continue
        holders = [o for o, c in owners.items() if key in {f.name for f in fields(c)}]
        if not holders:
            raise ConfigError(f"unknown key {section}.{key}{_did_you_mean(str(key), sorted(own))}; {kind} {name!r} "
                              f"has: {listed or 'no settings'}")
        if others == "any":
            _typed(section, owners[holders[0]], {selector: holders[0], key: value}).validate()
            continue
        default = _default(next(f for f in fields(owners[holders[0]]) if f.name == key))
        if value != default:
            raise ConfigError(f"{section}.{key}={value!r} does not apply to {kind} {name!r} (it is a setting of "
                              f"{', '.join(holders)}); {name}'s settings: {listed or 'none'}")
    settings = _typed(section, cls, kept)
    settings.validate()
    return settings


class Owned(type):
    """Metaclass of a config section that belongs to what it names (``TaskConfig``: a task, ``PeftConfig``: PEFT
    methods). Calling the section's base class, or ``dataclasses.replace(settings, name=X)``, makes the settings of
    what it names (``settings_for(X)``); a key only others have is left out, as ``owned_section`` leaves it out.
    The base class sets ``SELECTOR`` (the key that names) and the classmethods ``settings_for(value)`` and
    ``all_keys()``."""

    def __call__(cls, *args, **kwargs):
        base = next(c for c in reversed(cls.__mro__) if "SELECTOR" in c.__dict__)
        value = args[0] if args else kwargs.get(base.SELECTOR)
        if value is None and cls is not base:
            return super().__call__(*args, **kwargs)
        target = base.settings_for(getattr(base, base.SELECTOR) if value is None else value)
        own, everyone = {f.name for f in fields(target)}, base.all_keys()
        kept = {k: v for k, v in kwargs.items() if k in own or k not in everyone}
        return super(Owned, type(target)).__call__(target, *args, **kept)


def union_defaults(classes) -> dict:
    """Every key of the Settings dataclasses ``classes`` at its default: the layer under a config file and the
    command line for a section whose keys belong to what it names (the types of its text settings come from it).
    A key several classes have has one default (tests/test_catalog.py checks)."""
    out: dict = {}
    for c in classes:
        for f in fields(c):
            out.setdefault(f.name, _default(f))
    return out


def check_batch(t: TrainConfig, world: int = 1) -> None:
    """The batch rule, checked once wherever the number of processes is known: every optimizer step's
    ``batch_size`` examples split evenly over ``world`` processes x ``grad_accum`` micro-batches."""
    if t.batch_size < 1 or t.grad_accum < 1:
        raise ConfigError(f"train.batch_size ({t.batch_size}) and train.grad_accum ({t.grad_accum}) must be >= 1")
    if t.batch_size % (t.grad_accum * world):
        procs = f" x processes ({world})" if world > 1 else ""
        raise ConfigError(f"train.batch_size ({t.batch_size}) must be divisible by train.grad_accum "
                          f"({t.grad_accum}){procs}")


def check_train(t: TrainConfig) -> None:
    """The ``train`` section's own rules (the batch rule with one process)."""
    if t.steps < 1:
        raise ConfigError(f"train.steps ({t.steps}) must be >= 1")
    check_batch(t)
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be > 0")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be >= 0")
    if t.cpu_offload and t.parallel != "fsdp":
        raise ConfigError("train.cpu_offload=true offloads FSDP shards: it needs train.parallel=fsdp")
    if t.warmup_steps > t.steps:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} is longer than the run (train.steps={t.steps}); "
                          f"expected at most {t.steps}")


def check_data(d: DataConfig) -> None:
    if d.block_size < 0:
        raise ConfigError(f"data.block_size={d.block_size} must be ≥ 0 (0 = as long as the model allows)")
    if not 0 <= d.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")


def _bundled_path(name: str) -> str:
    """``${bundled:tasks/sms_spam/train.jsonl}`` in a config: the installed path of a bundled data file."""
    from . import bundled

    try:
        return str(bundled.path(name))
    except FileNotFoundError as e:
        raise ConfigError(f"${{bundled:{name}}}: {e}") from None


def merge_layers(defaults: dict, yaml_file: str | Path | None, overrides, base: dict | None,
                 sections: list[str]) -> dict:
    """defaults ← YAML file ← ``base`` (the command line's flags) ← dot-list overrides, merged by OmegaConf (the
    command line beats the file, as STYLE.md's preset → YAML → command line asks); unknown top-level keys
    are errors naming the nearest valid section. ``model: NAME`` is short for ``model: {preset: NAME}``;
    ``${bundled:PATH}`` is the path of a file of the bundled data (``pretune data bundled`` lists them)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not OmegaConf.has_resolver("bundled"):
        import warnings

        with warnings.catch_warnings():  # OmegaConf 2.4 renamed it register_resolver; 2.3 has only this name
            warnings.simplefilter("ignore", UserWarning)
            OmegaConf.register_new_resolver("bundled", _bundled_path)
    layers = [OmegaConf.create(defaults)]
    if yaml_file is not None:
        path = Path(yaml_file)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        import yaml

        try:
            loaded = OmegaConf.load(path)
        except yaml.YAMLError as e:  # a syntax error: name the line (1-based) and what the parser expected
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
            raise ConfigError(f"{where}: not valid YAML (line {mark.line + 1 if mark else '?'}, column "
                              f"{mark.column + 1 if mark else '?'}: {what or e})") from None
        except (OmegaConfBaseException, ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not a valid YAML config: {e}") from None
        if not OmegaConf.is_dict(loaded):
            raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(sections)})")
        if isinstance(loaded.get("model"), str):  # `model: tiny-gpt2` is short for `model: {preset: tiny-gpt2}`
            loaded.model = {"preset": loaded.model}
        layers.append(loaded)
    if base:
        layers.append(OmegaConf.create(base))
    dots = [o[2:] if o.startswith("--") else o for o in overrides]
    for o in dots:
        if "=" not in o:
            raise ConfigError(f"override {o!r} must look like section.key=value (e.g. train.lr=1e-3)")
    typed, strings = [], {}
    for o in dots:  # a text setting keeps its value as written: "Question: {q}" is text, not a YAML mapping
        key, _, value = o.partition("=")
        default = _lookup(defaults, key)
        if isinstance(default, str) and default != "auto":  # "auto" stands for a number chosen by the run
            _assign(strings, key, _unquote(value))
        else:
            typed.append(o)
    try:
        if typed:
            layers.append(OmegaConf.from_dotlist(typed))
        if strings:
            layers.append(OmegaConf.create(strings))
        # the model section is free-form (validated by ModelConfig); a preset change resets its overrides
        merged = OmegaConf.to_container(OmegaConf.merge(*layers), resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {e}") from None
    for k in merged:
        if k not in sections:
            raise ConfigError(f"unknown config section {k!r}{_did_you_mean(str(k), sections)}")
    model = merged.get("model") or {}
    merged["model"] = {"preset": model} if isinstance(model, str) else dict(model)
    return merged


def _lookup(tree: dict, dotted: str):
    """The value at ``a.b.c`` of nested dicts, or None."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _assign(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _unquote(value: str) -> str:
    """A value written with YAML quotes ('...' or "...") loses them, as from_dotlist would read it."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        import yaml

        try:
            out = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return out if isinstance(out, str) else value
    return value


# what may change when a run is resumed: logging and saving cadence, threads, the folder's path (a moved run); a
# longer run (then the schedule is recomputed for the new total, and values derived from the length, such as
# finetuning's warmup, follow)
RESUME_MAY_CHANGE = ("train.eval_every", "train.save_every", "train.log_every", "train.threads", "train.tensorboard",
                     "train.plot", "train.eval_batches", "train.keep_last", "train.out",
                     "train.report_to", "train.tags", "train.group", "train.tracking_dir",  # where rows also go
                     "train.precision",  # what `auto` resolves to differs between machines (not bitwise then)
                     "peft.base_dtype")  # follows the precision; a bf16 base computes what the fp32 one does
RESUME_MAY_GROW = ("train.steps", "tune.epochs")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "model":
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def check_resume(stored: dict, new: dict, *, source: str, derived=()) -> list[str]:
    """Compare a run's stored config (its run.yaml) with the config it is resumed with. Differences outside
    ``RESUME_MAY_CHANGE`` (and a longer ``RESUME_MAY_GROW``) are a ConfigError listing each key with both values;
    ``derived`` keys (values the job derives from others) may differ when the run grew. Returns the allowed
    differences, as lines to print."""
    old, cur = _flat(stored), _flat(new)
    grew = any(k in old and k in cur and cur[k] != old[k] for k in RESUME_MAY_GROW)
    refused, allowed = [], []
    for key in sorted(set(old) | set(cur)):
        a, b = old.get(key, "(unset)"), cur.get(key, "(unset)")
        if a == b:
            continue
        line = f"{key}: {a!r} -> {b!r}"
        if key in RESUME_MAY_CHANGE or (key in derived and grew):
            allowed.append(line)
        elif key in RESUME_MAY_GROW and isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > a:
            allowed.append(line + " (the schedule is recomputed for the new length)")
        else:
            refused.append(line)
    if refused:
        raise ConfigError(f"cannot resume {source} with a different config (" + "; ".join(refused) + "); resume "
                          "with the settings it was started with (only the eval/save/log intervals, threads, the "
                          "precision, peft.base_dtype and a longer train.steps / tune.epochs may change), or start a "
                          "new run (--overwrite or another folder)")
    return allowed
