"""Resumable training checkpoints: model + objective + optimizer + scheduler + RNG + data position + callbacks.

Layout of ``<run>/checkpoints/step-00000100/`` (written to a temp folder, then renamed)::

    model/                  a plain pretune checkpoint (config.json, model.safetensors, tokenizer.json), when every
                            parameter trains
    trainable.safetensors   instead of model/ when some parameters are frozen (PEFT, a frozen body): only the ones
                            that train (an adapter and its head), never a copy of the frozen base
    objective.safetensors   pretraining-only weights (NSP head, ELECTRA generator), if any
    trainer.pt              optimizer, scheduler, step, data position, RNG states, callbacks' plain state
                            (torch.load weights_only: tensors and plain values, nothing else unpickled)
    callbacks.safetensors   callbacks' tensors (keep-best's copy of the best weights), if any
    run.yaml                the resolved run config

A ``train.parallel=fsdp`` run writes ``sharded/`` (``torch.distributed.checkpoint``: every process's slice of the
trainable weights and AdamW state, plus the metadata to re-cut them for another number of processes) instead of
model/, trainable.safetensors and objective.safetensors (with config.json and tokenizer.json beside it, for
``pretune consolidate``); its trainer.pt holds no optimizer state.

Every file is read and checked before anything is put into the model, so a checkpoint that fails to load leaves
the model as it was and the next older one can be tried (``Trainer.resume``).
"""

from __future__ import annotations

import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..io.checkpoint import (
    CheckpointError,
    atomic_folder,
    disk_full,
    load_state,
    owned,
    read_weights,
    save,
    write_config_and_tokenizer,
)

STEP_DIR = re.compile(r"^step-(\d{8})$")
TEMP_DIR = re.compile(r"^\.step-\d{8}\.(tmp|old)-")  # what an interrupted checkpoint write leaves


def objective_state(objective, model) -> dict[str, torch.Tensor]:
    """The objective's own tensors (those not shared with the model, e.g. tied generator embeddings)."""
    shared = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    out = {}
    for k, v in objective.state_dict(keep_vars=True).items():
        if id(v) in shared or id(v) in seen:
            continue
        seen.add(id(v))
        out[k] = owned(v)
    return out


def trainable_state(model) -> dict[str, torch.Tensor] | None:
    """The parameters that train, by name, when some are frozen; None when every parameter trains."""
    params = dict(model.named_parameters())
    if all(p.requires_grad for p in params.values()):
        return None
    return {n: p for n, p in params.items() if p.requires_grad}


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp folders of an interrupted write are ignored)."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def clean_interrupted(run_dir: str | Path) -> list[str]:
    """Remove the temp folders interrupted checkpoint writes left in ``<run>/checkpoints``; returns their names."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    removed = []
    for p in sorted(d.iterdir()):
        if p.is_dir() and TEMP_DIR.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def save_training_state(run_dir: str | Path, *, step: int, model, objective, optimizer, scheduler, tokenizer,
                        position: dict, rng_states: list, run_config=None, keep_last: int = 2,
                        callbacks: list[dict] | None = None, stopped_early: bool = False, scaler=None,
                        sharded=None, dist=None, rollout: list | None = None) -> Path:
    """Write checkpoint ``step`` atomically and delete all but the newest ``keep_last`` up to it. ``callbacks``:
    each callback's state_dict (its tensors go to callbacks.safetensors, the rest to trainer.pt); ``stopped_early``:
    the run ended here by early stopping (a resume then trains no further); ``scaler``: fp16's loss scaler.
    ``sharded``: the (FSDP) module whose trainable weights and ``optimizer`` state every process writes its slice of;
    then every process calls this (``dist``), and process 0 writes the rest and commits the folder. ``rollout``:
    each process's rollout that the next steps train on (see _write_trainer)."""
    path = Path(run_dir) / "checkpoints" / f"step-{step:08d}"
    main = dist is None or dist.is_main
    try:
        if sharded is not None:
            def rest(tmp: Path) -> None:  # the model's config and tokenizer, so `pretune consolidate` can build it
                write_config_and_tokenizer(objective.finetunable(model).config, tokenizer, tmp)
                _write_trainer(tmp, None, scheduler, step, position, rng_states, run_config, stopped_early,
                               callbacks, scaler, world=len(rng_states), rollout=rollout)

            _write_sharded(path, sharded, optimizer, dist, rest)
        else:
            _write_checkpoint(path, model, objective, trainable_state(objective.finetunable(model)), tokenizer,
                              optimizer, scheduler, step, position, rng_states, run_config, stopped_early, callbacks,
                              scaler, rollout)
    except Exception as e:  # a full disk reads as a RuntimeError from torch's writer: say what it is
        full = disk_full(e, path)
        if full is None:
            raise
        raise full from e
    if main:
        _prune(run_dir, path, step, keep_last)
    return path


def _prune(run_dir, path: Path, step: int, keep_last: int) -> None:
    """Keep the newest keep_last checkpoints up to ``step``; a newer one (left by a run resumed from an older
    checkpoint, after a newer one failed to load) is of an abandoned future and goes; ``path`` always stays."""
    ckpts = list_checkpoints(run_dir)
    newer = [c for c in ckpts if _step(c) > step]
    older = [c for c in ckpts if _step(c) <= step and c != path]
    for old in newer + older[:max(0, len(older) - (max(1, keep_last) - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _step(ckpt: Path) -> int:
    return int(STEP_DIR.match(ckpt.name).group(1))


_META = {"format": "pt", "library": "pretune"}


def _write_checkpoint(path, model, objective, trainable, tokenizer, optimizer, scheduler, step, position, rng_states,
                      run_config, stopped_early, callbacks, scaler, rollout=None) -> None:
    with atomic_folder(path) as tmp:
        if trainable is None:
            save(objective.finetunable(model), tmp / "model", tokenizer=tokenizer)
        else:
            save_file({k: owned(v) for k, v in trainable.items()},
                      str(tmp / "trainable.safetensors"), metadata=_META)
        extra = objective_state(objective, model)
        if extra:
            save_file(extra, str(tmp / "objective.safetensors"), metadata=_META)
        _write_trainer(tmp, optimizer, scheduler, step, position, rng_states, run_config, stopped_early, callbacks,
                       scaler, rollout=rollout)


def _write_trainer(tmp: Path, optimizer, scheduler, step, position, rng_states, run_config, stopped_early, callbacks,
                   scaler, world: int | None = None, rollout: list | None = None) -> None:
    """trainer.pt (+ callbacks.safetensors, run.yaml): everything but the weights. ``optimizer`` None: its state is
    in sharded/, which ``world`` processes wrote. ``rollout``: each process's on-policy batches that the steps after
    this one train on (grpo's task.num_iterations > 1): dicts and lists of tensors, as weights_only reads them."""
    plain, tensors = [], {}
    for i, cb in enumerate(callbacks or []):
        plain.append({k: v for k, v in cb.items() if not isinstance(v, torch.Tensor)})
        tensors.update({f"{i}/{k}": owned(v) for k, v in cb.items()
                        if isinstance(v, torch.Tensor)})
    if tensors:
        save_file(tensors, str(tmp / "callbacks.safetensors"), metadata=_META)
    state = {"step": step, "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "scheduler": scheduler.state_dict(), "position": position, "rng": rng_states, "callbacks": plain,
             "stopped_early": stopped_early, "format": 1}
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    if world is not None:
        state["sharded"] = world
    if rollout is not None:
        state["rollout"] = rollout
    torch.save(state, tmp / "trainer.pt")
    if run_config is not None:
        run_config.save(tmp / "run.yaml")


def _write_sharded(path: Path, module, optimizer, dist, write_rest) -> None:
    """Every process writes its slice into one temp folder that process 0 made (and commits after
    ``write_rest(tmp)``); a failure leaves no checkpoint."""
    from .dist import all_gather_objects, barrier
    from .parallel import SHARDED_DIR, save_sharded

    main = dist is None or dist.is_main
    folder = atomic_folder(path) if main else None
    tmp = folder.__enter__() if main else None
    try:
        if dist is not None:
            tmp = Path(all_gather_objects(str(tmp) if main else None, dist)[0])
        save_sharded(tmp / SHARDED_DIR, module, optimizer)
        if dist is not None:
            barrier(dist)
        if main:
            write_rest(tmp)
    except BaseException as e:
        if main:
            folder.__exit__(type(e), e, e.__traceback__)
        raise
    if main:
        folder.__exit__(None, None, None)
    if dist is not None:
        barrier(dist)


def _read_trainer(path: Path) -> dict:
    file = path / "trainer.pt"
    if not file.is_file():
        raise CheckpointError(f"{path} is not a training checkpoint (no trainer.pt)")
    try:
        with warnings.catch_warnings():  # torch warns about a foreign file's pickle protocol before refusing it
            warnings.simplefilter("ignore")
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f" (it holds a {found.group(1)})" if found else ""
        raise CheckpointError(f"{file}: refused to unpickle it: a trainer state holds only tensors and plain "
                              f"values{what}; not written by pretune?") from None
    except Exception as e:  # noqa: BLE001 - torch's reader fails on a torn file in many ways (IndexError, ...)
        first = str(e).strip().split(". ")[0].splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file}: not readable ({first}); the file is truncated or corrupt") from None
    if not isinstance(state, dict) or not {"step", "optimizer", "scheduler", "position", "rng"} <= set(state):
        what = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{file}: not a pretune trainer state ({what})")
    return state


def load_training_state(path: str | Path, *, model, objective, optimizer, scheduler, scaler=None,
                        sharded=None) -> dict:
    """Restore a checkpoint written by :func:`save_training_state` in place; returns the trainer dict
    (step, position, rng, callbacks, stopped_early). Every file is read and checked before anything is put in (a
    missing, truncated or mis-shaped tensor is a CheckpointError naming it); only an optimizer state that does not
    fit is found after the weights were copied, and then the caller loads another checkpoint over them or stops.
    ``sharded``: the module of a ``train.parallel=fsdp`` run (every process calls this); its checkpoints are
    sharded/ folders, written by any number of processes."""
    path = Path(path)
    state = _read_trainer(path)
    if (sharded is not None) != ("sharded" in state):
        how = "train.parallel=fsdp" if "sharded" in state else "train.parallel=ddp (or single-process)"
        raise CheckpointError(f"{path} was written by a {how} run: resume it with the same train.parallel")
    if sharded is not None:
        return _load_sharded(path, state, sharded, optimizer, scheduler, scaler)
    target = objective.finetunable(model)
    trainable = trainable_state(target)
    if trainable is not None:
        file = path / "trainable.safetensors"
        if not file.is_file():
            raise CheckpointError(f"{path}: no trainable.safetensors, but this run trains only some parameters (a "
                                  "checkpoint of a run with another PEFT method or freezing?)")
        saved = read_weights(file)
        missing, extra = sorted(set(trainable) - set(saved)), sorted(set(saved) - set(trainable))
        if missing or extra:
            raise CheckpointError(f"{file}: the trained tensors differ from this run's (missing {missing[:3]}, "
                                  f"unexpected {extra[:3]}): a checkpoint of another method or model?")
        for k, t in saved.items():
            if tuple(t.shape) != tuple(trainable[k].shape):
                raise CheckpointError(f"{file}: {k} has shape {tuple(t.shape)}, expected {tuple(trainable[k].shape)}")
    else:
        saved = read_weights(path / "model" / "model.safetensors")
    own = objective_state(objective, model)
    own_saved = {}
    if own:
        f = path / "objective.safetensors"
        if not f.is_file():
            raise CheckpointError(f"{path}: objective.safetensors is missing (the objective has {len(own)} tensors)")
        own_saved = read_weights(f)
        missing = sorted(set(own) - set(own_saved))
        extra = sorted(set(own_saved) - set(own))
        if missing or extra:
            raise CheckpointError(f"{f}: objective tensors differ (missing {missing[:5]}, unexpected {extra[:5]}): "
                                  "was it written by a different objective?")
        for k, v in own_saved.items():
            if own[k].shape != v.shape:
                raise CheckpointError(f"{f}: {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    cbs = _callbacks(path, state)
    # everything read and checked: put it in
    if trainable is not None:
        with torch.no_grad():
            for k, t in saved.items():
                trainable[k].copy_(t)
    else:
        load_state(target, saved, source=str(path / "model"))
    if own_saved:
        with torch.no_grad():
            params = dict(objective.state_dict(keep_vars=True))
            for k, v in own_saved.items():
                params[k].copy_(v)
    try:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path / 'trainer.pt'}: its optimizer state does not fit this run ({e})") from None
    _load_scaler(path, state, scaler)
    state["callbacks"] = cbs
    return state


def _callbacks(path: Path, state: dict) -> list[dict]:
    """The callbacks' states, their tensors (callbacks.safetensors) put back in."""
    cb_file = path / "callbacks.safetensors"
    cbs = [dict(c) for c in state.get("callbacks") or []]
    if cb_file.is_file():
        for key, t in read_weights(cb_file).items():
            i, _, name = key.partition("/")
            if not i.isdigit() or int(i) >= len(cbs):
                raise CheckpointError(f"{cb_file}: tensor {key!r} belongs to no callback of the checkpoint")
            cbs[int(i)][name] = t
    return cbs


def _load_scaler(path: Path, state: dict, scaler) -> None:
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    # (a checkpoint of an fp32/bf16 run continued in fp16 starts from the scaler's default scale)


def _load_sharded(path: Path, state: dict, module, optimizer, scheduler, scaler) -> dict:
    from .parallel import SHARDED_DIR, load_sharded

    folder = path / SHARDED_DIR
    if not (folder / ".metadata").is_file():
        raise CheckpointError(f"{folder}: no .metadata (an incomplete sharded checkpoint)")
    cbs = _callbacks(path, state)
    try:
        load_sharded(folder, module, optimizer)
    except Exception as e:  # noqa: BLE001 - torch.distributed.checkpoint wraps reader errors in several types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{folder}: does not load into this run ({first[:300]})") from None
    try:
        scheduler.load_state_dict(state["scheduler"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path / 'trainer.pt'}: its scheduler state does not fit this run ({e})") from None
    _load_scaler(path, state, scaler)
    state["callbacks"] = cbs
    return state
