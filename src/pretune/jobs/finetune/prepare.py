"""Config → model, task, data: everything a finetuning run needs, with every value the config leaves to be derived
(steps from epochs, warmup, evaluation interval, learning rate) resolved and said how (:func:`prepare`), and the
config a run would use as YAML (:func:`resolved_yaml`, ``pretune finetune --print-config``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ...config import TASK_HEADS, ConfigError
from ...peft.config import base_dtype_for
from ...runconfig import check_train
from ...tasks.base import Record
from ...tasks.run import encode_records, read_splits, subsample
from ...train.precision import describe_device, resolve_precision
from . import defaults
from .config import FinetuneConfig
from .methods import AdapterMethod, FullMethod, method_for


@dataclass
class Prepared:
    """Everything a finetuning run needs, its config resolved (derived values filled in)."""

    cfg: FinetuneConfig  # train.steps / warmup_steps / eval_every / lr / batch_size as the run uses them
    model: torch.nn.Module
    tokenizer: object
    task: object  # a pretune.tasks.Task
    method: FullMethod | AdapterMethod
    records: dict[str, list[Record]]  # train, dev, test
    features: dict[str, list[dict]]
    metric: str  # the dev metric of model selection and early stopping
    derived: dict[str, str] = field(default_factory=dict)  # config key -> how its value was derived


def prepare(cfg: FinetuneConfig, *, show_progress: bool = True, log=print) -> Prepared:
    """Read and split the data, build the model with the task's head, set up the method (freezing, adapters),
    encode every split and resolve what the config leaves to be derived (steps from epochs, warmup, evaluation
    interval, learning rate, a batch larger than the data); ``Prepared.derived`` says how."""
    from ...loading import build_run_model
    from ...tasks import TASKS

    if not cfg.data.train:
        raise ConfigError("no training data: set data.train=FILE (JSONL, CSV/TSV or Parquet)")
    task_cls = TASKS[cfg.task.name]
    method = method_for(cfg)
    recs = read_splits(cfg.data.train, cfg.data.dev, cfg.data.test, dev_fraction=cfg.data.dev_fraction,
                       seed=cfg.train.seed, errors=cfg.data.errors)
    train_recs, dev_recs, test_recs = recs["train"], recs["dev"], recs["test"]
    derived: dict[str, str] = {}
    if cfg.data.train_limit:
        n_all = len(train_recs)
        train_recs = subsample(train_recs, cfg.data.train_limit, cfg.train.seed)
        derived["data.train_limit"] = (f"{len(train_recs)} of the {n_all} training records, drawn with train.seed="
                                       f"{cfg.train.seed}")
        log(f"data.train_limit: training on {len(train_recs)} of the {n_all} training records (drawn with "
            f"train.seed={cfg.train.seed})")
    # dev labels join the map too: a rare class absent from train must not make every evaluation fail
    labels = task_cls.label_set(cfg.task, train_recs + dev_recs)
    if task_cls.labels_in_task and not cfg.task.labels:
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, labels=list(labels)))
        derived["task.labels"] = "read from the training and dev data"
    model, tok = build_run_model(cfg.model, tokenizer=cfg.tokenizer, head=task_cls.head_config(cfg.task, labels),
                                 from_scratch=cfg.tune.from_scratch, seed=cfg.train.seed, log=log)
    if cfg.task.add_tokens:  # before the task reads the tokenizer: its layout may use them ([DELIM])
        from ...io.new_tokens import add_special_tokens

        tok, method.new_token_ids = add_special_tokens(model, tok, cfg.task.add_tokens, log=log)
    task_cls.setup_tokenizer(cfg.task, tok, log=log)  # sft: task.chat_template (which may use the new tokens)
    room = method.room(cfg, model.config)
    if cfg.task.max_len > room:
        log(f"task.max_len {cfg.task.max_len} -> {room}: the other positions go to the soft prompt")
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, max_len=room))
        derived["task.max_len"] = f"max_seq_len {model.config.max_seq_len} less the soft prompt"
    task = task_cls(cfg.task, model.config, tok)
    records = task.records()  # how the model reads text after this run (a decoder's layout), saved with it
    if any(getattr(model.config, k) != v for k, v in records.items()):
        model.config = model.transformer.config = model.config.replace(**records)
    feats = {}
    for split, recs in (("train", train_recs), ("dev", dev_recs), ("test", test_recs)):
        before = getattr(task, "truncated", 0)
        feats[split] = encode_records(task, recs, show_progress=show_progress, desc=f"encode {split}")
        cut = getattr(task, "truncated", 0) - before
        if cut:
            target = getattr(cfg.task, "max_target_len", None)
            log(f"{cut} of {len(recs)} {split} records were cut to fit task.max_len={task.max_len}"
                + (f" (task.max_target_len={target} for completions)" if target else ""))
    if cfg.data.packing:
        if not getattr(task, "packable", False):
            raise ConfigError(f"data.packing=true packs training examples of task sft; task {task.name!r} cannot")
        if cfg.peft.method in ("prefix", "prompt"):
            raise ConfigError(f"data.packing=true cannot be used with --peft {cfg.peft.method}: its virtual tokens "
                              "would be shared by every example of a row")
        n = len(feats["train"])
        feats["train"] = task.pack(feats["train"], task.max_len)
        derived["data.packing"] = f"{n} examples packed into {len(feats['train'])} rows of <= {task.max_len} tokens"
        log(f"data.packing: {n} training examples in {len(feats['train'])} rows of at most {task.max_len} tokens")
    requested = cfg.train.precision
    if getattr(task, "rollout", None) is not None:  # grpo: a length in steps of prompts it writes completions for
        cfg = _on_policy_train(cfg, task, derived, log)
    cfg = _resolve_train(cfg, len(feats["train"]), method, derived,
                         task_head=model.config.head in TASK_HEADS and model.head is not None, log=log)
    base_dtype = base_dtype_for(cfg.peft, requested, cfg.train.precision)
    if base_dtype != cfg.peft.base_dtype:
        derived["peft.base_dtype"] = (f"auto: {base_dtype}, as train.precision is {cfg.train.precision}"
                                      if cfg.peft.method else "auto: fp32, no PEFT method (nothing is frozen)")
        cfg = dataclasses.replace(cfg, peft=dataclasses.replace(cfg.peft, base_dtype=base_dtype))
    method.setup(model, tok, cfg, log)
    if getattr(task, "needs_reference", False):  # preference tuning: the policy against where it started
        task.reference_model = method.reference(model)
    metric = cfg.task.metric or task.default_metric
    cfg = dataclasses.replace(cfg, derived=dict(derived))  # run.yaml marks them
    return Prepared(cfg=cfg, model=model, tokenizer=tok, task=task, method=method,
                    records={"train": train_recs, "dev": dev_recs, "test": test_recs}, features=feats,
                    metric=metric, derived=derived)


def resolved_yaml(cfg: FinetuneConfig) -> str:
    """The config a finetuning run would use, as YAML: the data is read and the model built (nothing is
    trained or written), so the values derived from them appear, each marked with how it was derived."""
    from omegaconf import OmegaConf

    if not cfg.data.train or not (cfg.model.get("init") or cfg.model.get("preset")):
        note = ("# train.batch_size, tune.epochs (so train.steps), warmup_steps, eval_every and lr are derived from "
                "the data and the model when the run\n# starts: give data.train and model.init (or model.preset) to "
                "see the values it will use\n")
        return note + OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict()))
    job = prepare(cfg, show_progress=False, log=lambda *a: None)
    return job.cfg.to_yaml().rstrip("\n")


def _on_policy_train(cfg: FinetuneConfig, task, derived: dict, log) -> FinetuneConfig:
    """An on-policy task's (grpo's) length and batch: ``train.steps`` optimizer steps (a rollout every
    ``task.num_iterations``) of
    ``train.batch_size`` prompts, each a task default when left to choose; epochs do not apply."""
    tr, tune = cfg.train, cfg.tune
    if tune.epochs not in (defaults.AUTO, 0, 0.0):
        raise ConfigError(f"--epochs / tune.epochs={tune.epochs:g} does not apply to task {task.name}: each step "
                          "samples new completions, so its length is train.steps (--steps N) optimizer steps")
    if tr.parallel == "fsdp":
        raise ConfigError(f"task {task.name} samples with the whole model at every step, which FSDP shards over the "
                          "processes; use train.parallel=ddp (each process samples its prompts)")
    if not tr.batch_size:
        tr = dataclasses.replace(tr, batch_size=task.DEFAULT_PROMPTS)
        derived["train.batch_size"] = (f"task {task.name}'s default: {task.DEFAULT_PROMPTS} prompts a step, "
                                       f"x task.group_size={task.cfg.group_size} completions each")
    if not tr.steps:
        tr = dataclasses.replace(tr, steps=task.DEFAULT_STEPS)
        derived["train.steps"] = f"task {task.name}'s default ({task.DEFAULT_STEPS} optimizer steps)"
    mu = getattr(task, "iterations", 1)
    log(f"task {task.name}: {tr.steps} steps of {tr.batch_size} prompts x {task.cfg.group_size} sampled completions "
        f"of <= {task.cfg.max_new_tokens} tokens" + (f", each rollout trained on for {mu} steps" if mu > 1 else ""))
    return dataclasses.replace(cfg, train=tr, tune=dataclasses.replace(tune, epochs=defaults.AUTO))


def _resolve_train(cfg: FinetuneConfig, n_train: int, method, derived: dict, *, task_head: bool = False,
                   log=print) -> FinetuneConfig:
    """train.* (and tune.head_lr) as the run uses them: what the user left to choose chosen from the data and the
    method (:mod:`.defaults`, said in the run's first lines), each derivation recorded in ``derived``."""
    import os

    tr, tune = cfg.train, cfg.tune
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's processes: the batch is split over them
    choice = defaults.choose(n_train, batch_size=tr.batch_size, epochs=tune.epochs, steps=tr.steps,
                             grad_accum=tr.grad_accum * world)
    derived.update(choice.why)
    if choice.batch_size is not None:
        tr = dataclasses.replace(tr, batch_size=choice.batch_size)
    if tr.batch_size > n_train:
        bs = n_train - n_train % tr.grad_accum or tr.grad_accum
        derived["train.batch_size"] = f"the {n_train} training examples (train.batch_size={tr.batch_size} is larger)"
        tr = dataclasses.replace(tr, batch_size=bs)
    per_epoch = max(1, n_train // tr.batch_size)
    steps = tr.steps
    epochs = choice.epochs if choice.epochs is not None else tune.epochs
    if epochs == defaults.AUTO:  # train.steps was set: it decides the length
        epochs = 0.0
        derived["tune.epochs"] = f"0: train.steps={steps} was set and decides the run's length"
    elif epochs:
        steps = math.ceil(per_epoch * epochs)
        derived["train.steps"] = (f"tune.epochs={epochs:g} x {per_epoch} steps per epoch ({n_train} training "
                                  f"examples / batch {tr.batch_size}); tune.epochs=0 uses train.steps")
    tune = dataclasses.replace(tune, epochs=float(epochs))
    eval_every = tr.eval_every
    if not eval_every:
        eval_every = max(1, per_epoch // tune.evals_per_epoch)
        derived["train.eval_every"] = f"{per_epoch} steps per epoch / tune.evals_per_epoch={tune.evals_per_epoch}"
    save_every = tr.save_every
    if not save_every and tr.keep_last:
        save_every = eval_every
        derived["train.save_every"] = "train.eval_every: a resumable checkpoint after every dev evaluation"
    warmup = tr.warmup_steps
    if not warmup:
        warmup = int(tune.warmup_ratio * steps)
        derived["train.warmup_steps"] = f"tune.warmup_ratio={tune.warmup_ratio:g} x {steps} steps"
    lr, lr_words = tr.lr, ""
    if not lr:
        lr = method.default_lr
        derived["train.lr"] = f"the default of {method.name}"
        lr_words = f"lr {lr:g} ({method.name}'s)"
    said = choice.line(n_train, steps=steps, lr=lr_words if choice.why else "",
                       warmup=f"warmup {warmup} steps ({tune.warmup_ratio:.0%})" if choice.epochs is not None
                       and not tr.warmup_steps else "")
    if said:
        log(said)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # as train.dist.init_distributed picks it
    precision = resolve_precision(tr.precision, device)
    if tr.precision == "auto":
        derived["train.precision"] = f"auto on {describe_device(device)}"
    tr = dataclasses.replace(tr, steps=steps, eval_every=eval_every, save_every=save_every, warmup_steps=warmup, lr=lr,
                             precision=precision)
    check_train(tr)
    head_lr = tune.head_lr
    if not head_lr and task_head and method.default_head_lr(lr) != lr:
        head_lr = method.default_head_lr(lr)
        derived["tune.head_lr"] = f"the task head's default next to {method.name} (HEAD_LR, or train.lr if higher)"
    return dataclasses.replace(cfg, train=tr, tune=dataclasses.replace(tune, head_lr=head_lr))
