"""Resumable training checkpoints: model + objective + optimizer + scheduler + RNG + data position.

Layout of ``<run>/checkpoints/step-00000100/`` (written to a temp folder, then renamed)::

    model/                  a plain pretune checkpoint (config.json, model.safetensors, tokenizer.json)
    objective.safetensors   pretraining-only weights (NSP head, ELECTRA generator), if any
    trainer.pt              optimizer, scheduler, step, data position, RNG states, callbacks' plain state
                            (torch.load weights_only)
    callbacks.safetensors   callbacks' tensors (keep-best's copy of the best weights), if any
    run.yaml                the resolved run config
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint import CheckpointError, atomic_folder, load_state, save

STEP_DIR = re.compile(r"^step-(\d{8})$")


def objective_state(objective, model) -> dict[str, torch.Tensor]:
    """The objective's own tensors (those not shared with the model, e.g. tied generator embeddings)."""
    shared = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    out = {}
    for k, v in objective.state_dict(keep_vars=True).items():
        if id(v) in shared or id(v) in seen:
            continue
        seen.add(id(v))
        out[k] = v.detach().contiguous().cpu()
    return out


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp folders of an interrupted write are ignored)."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def save_training_state(run_dir: str | Path, *, step: int, model, objective, optimizer, scheduler, tokenizer,
                        position: dict, rng_states: list, run_config=None, keep_last: int = 2,
                        callbacks: list[dict] | None = None) -> Path:
    """Write checkpoint ``step`` atomically and delete all but the newest ``keep_last``. ``callbacks``: each
    callback's state_dict (its tensors go to callbacks.safetensors, the rest to trainer.pt)."""
    path = Path(run_dir) / "checkpoints" / f"step-{step:08d}"
    plain, tensors = [], {}
    for i, cb in enumerate(callbacks or []):
        plain.append({k: v for k, v in cb.items() if not isinstance(v, torch.Tensor)})
        tensors.update({f"{i}/{k}": v.detach().contiguous().cpu() for k, v in cb.items()
                        if isinstance(v, torch.Tensor)})
    with atomic_folder(path) as tmp:
        save(objective.finetunable(model), tmp / "model", tokenizer=tokenizer)
        extra = objective_state(objective, model)
        if extra:
            save_file(extra, str(tmp / "objective.safetensors"), metadata={"format": "pt", "library": "pretune"})
        if tensors:
            save_file(tensors, str(tmp / "callbacks.safetensors"), metadata={"format": "pt", "library": "pretune"})
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "position": position, "rng": rng_states, "callbacks": plain, "format": 1}, tmp / "trainer.pt")
        if run_config is not None:
            run_config.save(tmp / "run.yaml")
    for old in list_checkpoints(run_dir)[:-max(1, keep_last)]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_training_state(path: str | Path, *, model, objective, optimizer, scheduler) -> dict:
    """Restore a checkpoint written by :func:`save_training_state` in place; returns the trainer dict
    (step, position, rng). Strict: a missing or mis-shaped tensor is an error naming it."""
    path = Path(path)
    trainer_file = path / "trainer.pt"
    if not trainer_file.is_file():
        raise CheckpointError(f"{path} is not a training checkpoint (no trainer.pt)")
    from ..checkpoint import read_weights

    load_state(model, read_weights(path / "model" / "model.safetensors"), source=str(path / "model"))
    own = objective_state(objective, model)
    if own:
        f = path / "objective.safetensors"
        if not f.is_file():
            raise CheckpointError(f"{path}: objective.safetensors is missing (the objective has {len(own)} tensors)")
        saved = load_file(str(f))
        missing = sorted(set(own) - set(saved))
        extra = sorted(set(saved) - set(own))
        if missing or extra:
            raise CheckpointError(f"{f}: objective tensors differ (missing {missing[:5]}, unexpected {extra[:5]}): "
                                  "was it written by a different objective?")
        with torch.no_grad():
            params = dict(objective.state_dict(keep_vars=True))
            for k, v in saved.items():
                if params[k].shape != v.shape:
                    raise CheckpointError(f"{f}: {k} has shape {tuple(v.shape)}, expected {tuple(params[k].shape)}")
                params[k].copy_(v)
    state = torch.load(trainer_file, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    cb_file = path / "callbacks.safetensors"
    if cb_file.is_file():  # the callbacks' tensors back into their states
        cbs = [dict(c) for c in state.get("callbacks") or []]
        for key, t in read_weights(cb_file).items():
            i, _, name = key.partition("/")
            cbs[int(i)][name] = t
        state["callbacks"] = cbs
    return state
