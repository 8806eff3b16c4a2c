"""``pretune pretrain``: raw text → tokenizer → token store → packed blocks → objective → trained checkpoint.

    cfg = load_run_config("configs/pretrain/bert-mlm.yaml", ["train.steps=200"])
    result = pretrain(cfg)            # result.model_dir holds the finetunable checkpoint

Under ``torchrun --nproc_per_node N`` the same call trains with DDP: rank 0 builds the token store,
every rank reads its own shard of each global batch, rank 0 writes checkpoints.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from ..runconfig import RunConfig, check_data, check_train, merge_layers, section

MIN_BLOCK = 4  # shortest block used for training (tokens, before special tokens)


@dataclass
class PretrainResult:
    run_dir: Path
    model_dir: Path
    steps: int
    train_loss: float
    eval: dict
    seconds: float
    tokens: int


def load_run_config(yaml_file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                    base: dict | None = None) -> RunConfig:
    """Build a pretraining RunConfig from defaults ← YAML file ← ``base`` ← ``section.key=value`` overrides.

    Args:
        yaml_file: optional YAML with top-level sections model/tokenizer/data/objective/train.
        overrides: dot-list strings, e.g. ``["train.lr=1e-3", "model.preset=tiny-gpt2", "data.train=[a.txt,b.txt]"]``
            (a leading ``--`` is accepted).
        base: a dict merged after the YAML file (the CLI's flags: the command line beats the file).
    Each section is checked once: ``data`` and ``train`` by their dataclasses, ``objective`` by the objective it
    names (``pretune.objectives.objective_settings``).
    """
    from ..objectives import objective_settings

    merged = merge_layers(RunConfig().to_dict(), yaml_file, overrides, base,
                          ["model", "tokenizer", "data", "objective", "train"])
    if not isinstance(merged["model"], dict):
        raise ConfigError(f"model must be a mapping (preset: NAME, field: value, ...), got {merged['model']!r}")
    cfg = RunConfig(model=merged["model"], tokenizer=str(merged.get("tokenizer") or ""),
                    data=section("data", type(RunConfig().data), merged.get("data") or {}),
                    objective=objective_settings(merged.get("objective") or {}),
                    train=section("train", type(RunConfig().train), merged.get("train") or {}))
    check_data(cfg.data)
    check_train(cfg.train)
    return cfg


def _store_key(cfg: RunConfig, tok_sha: str, sources: list[str]) -> str:
    d = cfg.data
    blob = json.dumps({"tok": tok_sha, "src": sources, "field": d.field, "split": d.doc_split, "clean": d.clean,
                       "errors": d.errors}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_token_store(cfg: RunConfig, tokenizer, sources: list[str], out_dir: Path, *, show_progress: bool = True):
    """Tokenize ``sources`` into a token store at ``out_dir`` (resumable; reused when already complete)."""
    from ..data.readers import count_bytes, expand_sources, iter_documents
    from ..data.store import build_store
    from ..io.tokenization import tokenizer_sha

    d = cfg.data
    paths = expand_sources(sources)
    docs = iter_documents(paths, field=d.field, doc_split=d.doc_split, errors=d.errors)
    if d.clean:
        from ..data.clean import CleanConfig, clean_documents

        docs = clean_documents(docs, CleanConfig())
    sha = tokenizer_sha(tokenizer)
    desc = _store_key(cfg, sha, [str(p) for p in paths])
    return build_store(docs, tokenizer.tk, out_dir, tokenizer_sha=sha, source_desc=desc,
                       total_bytes=count_bytes(paths, uncompressed=True), show_progress=show_progress)


def prepare(cfg: RunConfig, *, dist=None, show_progress: bool = True):
    """Load the tokenizer, build the model and objective, tokenize and pack the data.

    Returns (tokenizer, model, objective, ExampleSet, block_size)."""
    from ..data.packing import pack_blocks, split_index
    from ..loading import build_run_model
    from ..objectives import OBJECTIVES, build_objective
    from ..train.dist import DistInfo, barrier
    from ..train.loop import ExampleSet

    dist = dist or DistInfo()
    if not cfg.tokenizer:
        raise ConfigError("no tokenizer: set tokenizer=PATH (a tokenizer.json from `pretune tokenizer train`, "
                          "or a checkpoint/HF folder holding one)")
    if not cfg.data.train:
        raise ConfigError("no training data: set data.train=[FILES] (text, JSONL, CSV/TSV, Parquet, .gz; "
                          "folders and globs work)")
    init = cfg.model.get("init")
    need = OBJECTIVES[cfg.objective.name].head  # a checkpoint without it gets a fresh one (MiniLM ships without
    # its MLM head); a new model has the head its config names, which the objective checks
    model, tok = build_run_model(cfg.model, tokenizer=cfg.tokenizer, head={"head": need} if init and need else None,
                                 seed=cfg.train.seed, log=print if dist.is_main else lambda *a: None)
    teacher = None
    if getattr(cfg.objective, "teacher", ""):  # distillation: the frozen model the student learns from
        from ..loading import load

        with torch.random.fork_rng(devices=[]):  # building it draws an init: the student's run stays as it was
            teacher = load(cfg.objective.teacher, merge=True)
    objective = build_objective(cfg.objective, model, tok, teacher=teacher)
    records = objective.records()  # e.g. how a decoder lays out text (model/layout.py), saved with every checkpoint
    if any(getattr(model.config, k) != v for k, v in records.items()):
        model.config = model.transformer.config = model.config.replace(**records)
    mcfg = model.config

    longest = objective.block_size(mcfg.max_positions)  # a learned table with an offset (RoBERTa, BART) has fewer
    block_size = cfg.data.block_size or longest
    if block_size > longest:
        skipped = mcfg.max_seq_len - mcfg.max_positions  # rows a learned table starts after (RoBERTa, BART: 2)
        raise ConfigError(f"data.block_size={block_size} does not fit the model: objective {objective.name!r} adds "
                          f"{mcfg.max_positions - longest} token(s) (special tokens / target) and model.max_seq_len is "
                          f"{mcfg.max_seq_len}{f' ({skipped} rows before the first position)' if skipped else ''}, "
                          f"so blocks can hold at most {longest} tokens")

    run_dir = Path(cfg.train.out)
    store_dir = Path(cfg.data.store) if cfg.data.store else run_dir / "data"
    stores = {}
    for split, sources in (("train", cfg.data.train), ("eval", cfg.data.eval)):
        if not sources:
            continue
        path = store_dir / split
        if dist.is_main:
            build_token_store(cfg, tok, list(sources), path, show_progress=show_progress)
            if not cfg.data.store:  # the run's own cache: pretune wrote it (a shared data.store is the user's)
                from ..io.outputs import mark

                mark(run_dir, ["data"])
        barrier(dist)
        from ..data.store import TokenStore

        stores[split] = TokenStore.open(path)
    sep = objective.doc_separator()
    train_index = pack_blocks(stores["train"], block_size=block_size, mode=cfg.data.packing, doc_sep_id=sep)
    if "eval" in stores:
        eval_index = pack_blocks(stores["eval"], block_size=block_size, mode=cfg.data.packing, doc_sep_id=sep)
        n_train = len(train_index)
        ids_train = np.arange(n_train)
        ids_eval = np.arange(n_train, n_train + min(len(eval_index), cfg.data.eval_max))

        def get(i: int):
            return train_index[i] if i < n_train else eval_index[i - n_train]

        lengths = np.concatenate([train_index.lengths, eval_index.lengths])
    else:
        n = len(train_index)
        n_eval = 0 if cfg.data.eval_fraction == 0 else min(max(1, round(n * cfg.data.eval_fraction)), cfg.data.eval_max)
        if n - n_eval < 1:
            raise ConfigError(f"the training data packs into only {n} block(s) of {block_size} tokens: add data or "
                              "lower data.block_size")
        ids_train, ids_eval = split_index(train_index, eval_blocks=n_eval, seed=cfg.train.seed)
        get = train_index.__getitem__
        lengths = train_index.lengths
    # degenerate blocks (a 1-3 token document tail) carry no signal and break pair/span objectives
    ids_train = np.asarray(ids_train)[lengths[np.asarray(ids_train)] >= MIN_BLOCK]
    ids_eval = np.asarray(ids_eval, dtype=np.int64)
    ids_eval = ids_eval[lengths[ids_eval] >= MIN_BLOCK] if len(ids_eval) else ids_eval
    data = ExampleSet(get=get, train_ids=ids_train, eval_ids=ids_eval, lengths=lengths)
    return tok, model, objective, data, block_size


def pretrain(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, show_progress: bool = True,
             log=print) -> PretrainResult:
    """Run a whole pretraining job described by ``cfg`` (see runconfig.py); returns where the model went.

    ``train.out`` must be a new (or empty) folder; ``overwrite=True`` starts over in an earlier run's folder
    (removing what that run wrote, nothing else). With ``resume=True`` the newest intact checkpoint in
    ``<train.out>/checkpoints`` is restored and training continues exactly (same data order, corruption and
    dropout as an uninterrupted run); the config may differ from the stored run.yaml only in what
    ``runconfig.check_resume`` allows."""
    import dataclasses

    from ..io.checkpoint import save
    from ..io.outputs import mark, prepare_run_folder
    from ..model import count_parameters
    from ..train.dist import barrier, init_distributed, shutdown
    from ..train.elastic import record_launch, restart_mode
    from ..train.loop import Trainer
    from ..train.precision import precision_line, resolve_precision
    from ..train.trackers import Trackers, open_trackers

    dist = init_distributed()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if dist.device.type == "cpu":
        torch.set_flush_denormal(True)  # denormal softmax gradients can slow CPU matmuls ~20x
    requested = cfg.train.precision
    precision = resolve_precision(requested, dist.device, warn=log if dist.is_main else None)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    run_dir = Path(cfg.train.out)
    trackers = Trackers()
    try:
        # started again by torchrun after a failure (--max-restarts): the launch's own run resumes by itself
        resume, overwrite = restart_mode(run_dir, dist, resume=resume, overwrite=overwrite, log=log)
        if dist.is_main:
            prepare_run_folder(run_dir, cfg.to_dict(), resume=resume, overwrite=overwrite, log=log,
                               writes=() if cfg.data.store else ("data",))
        record_launch(run_dir, dist)
        barrier(dist)
        # process 0's MLflow / W&B runs (train.report_to), opened before the data work: a missing package stops here
        trackers = open_trackers(cfg.train, run_dir, config=cfg.to_dict(), job="pretrain", resume=resume,
                                 enabled=dist.is_main)
        tok, model, objective, data, block_size = prepare(cfg, dist=dist, show_progress=show_progress)
        if dist.is_main:
            counts = count_parameters(model)
            extra = sum(p.numel() for p in objective.parameters()  # a distillation teacher is frozen: not counted
                        if p.requires_grad and all(p is not q for q in model.parameters()))
            log(f"pretune pretrain: {cfg.objective.name} on {model.config.arch} model "
                f"({counts['total'] / 1e6:.2f}M parameters"
                f"{f' + {extra / 1e6:.2f}M objective-only' if extra else ''}), "
                f"{len(data.train_ids)} train / {len(data.eval_ids)} eval blocks of ≤ {block_size} tokens, "
                f"{dist.world} process(es) -> {run_dir}")
            log(precision_line(requested, precision, dist.device))
        trainer = Trainer(model=model, objective=objective, data=data, cfg=cfg.train, run_dir=run_dir,
                          tokenizer=tok, dist=dist, bucket=cfg.data.bucket, run_config=cfg,
                          show_progress=show_progress, trackers=trackers)
        result = trainer.fit(resume=resume, log=log)
        model, objective = trainer.consolidated(objective=True)  # FSDP: the gathered weights, plain modules
        model_dir = run_dir / "model"
        if dist.is_main:
            save(objective.finetunable(model), model_dir, tokenizer=tok)
            cfg.save(model_dir / "run.yaml")
            mark(model_dir, ["run.yaml"])
            for name, other in objective.companions().items():  # ELECTRA: the generator beside the discriminator
                save(other, run_dir / name, tokenizer=tok)
                mark(run_dir, [name])
            if cfg.train.plot and (run_dir / "metrics.jsonl").is_file():
                from ..train.logging import plot_losses

                plot_losses(run_dir / "metrics.jsonl", run_dir / "loss.png",
                            title=f"{cfg.objective.name} · {model.config.arch}")
            mark(run_dir, ["model", "loss.png"])
            trackers.log_artifacts(run_dir, ["loss.png", "run.yaml"])
        trackers.close()
        barrier(dist)
    finally:
        trackers.close(failed=True)  # after an error the tracked runs end as failed (nothing once closed)
        shutdown(dist)
    if dist.is_main:
        log(f"model -> {model_dir}  ({result.step} steps, {result.seconds:.1f}s, "
            f"{result.tokens / max(result.seconds, 1e-9):.0f} tokens/s)")
    return PretrainResult(run_dir=run_dir, model_dir=model_dir, steps=result.step, train_loss=result.train_loss,
                          eval=result.eval, seconds=result.seconds, tokens=result.tokens)
