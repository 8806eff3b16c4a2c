"""``task.precompute_reference=true`` (dpo, kto): the reference model's log-probabilities of every training example,
computed once before training and kept in the run folder, so that no training step runs the reference pass.

The file is ``reference_logps.safetensors`` (one of the run's entries, ``io.outputs.RUN_ENTRIES``: ``--overwrite``
removes it, ``--resume`` reads it back instead of computing it again): a tensor ``ref_logps`` (N, 2), per training
example in the order of the training features, the summed log-probabilities of dpo's chosen and rejected completions,
or of kto's completion and its mismatched row. kto's mismatched row is then fixed (the completion of the previous
training example, TRL's rotation over the data set) instead of drawn from each batch, since the reference of a row
that changes every epoch cannot be computed once. Dev and test are scored with the reference pass, as without.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ...config import ConfigError

FILE = "reference_logps.safetensors"


def precompute_reference(job, run_dir: Path, *, resume: bool, is_main: bool, barrier, show_progress: bool,
                         log=print) -> None:
    """Attach ``ref_logps`` (2,) to each training feature of ``job`` (its task's ``reference_logps``), computed
    with a progress bar and written to ``run_dir / FILE`` by the main process, or read from there on resume."""
    from safetensors.torch import load, save

    from ...io.outputs import write_atomic

    task, feats = job.task, job.features["train"]
    if not task.needs_reference:
        raise ConfigError(f"task.precompute_reference=true: task.loss={task.cfg.loss} uses no reference model")
    if hasattr(task, "fix_mismatched"):  # kto: the mismatched rows must not change between epochs
        task.fix_mismatched(feats)
    meta = {"task": task.name, "examples": str(len(feats)), "config": json.dumps(job.cfg.model, sort_keys=True,
                                                                                 default=str)}
    path = run_dir / FILE
    refs = None
    if resume and path.is_file():
        data = path.read_bytes()
        refs = load(data)["ref_logps"]
        if refs.shape != (len(feats), 2):
            raise ConfigError(f"{path} holds {refs.shape[0]} reference log-probabilities, the run has {len(feats)} "
                              "training examples; start over with --overwrite")
        log(f"reference log-probabilities of {len(feats)} training examples read from {path}")
    elif is_main:
        refs = _compute(task, job.model, feats, batch_size=job.cfg.train.batch_size * 2, show_progress=show_progress)
        write_atomic(path, save({"ref_logps": refs}, metadata=meta))
        log(f"reference log-probabilities of {len(feats)} training examples -> {path} (task.precompute_reference)")
    barrier()
    if refs is None:  # another process of a torchrun run: the main process wrote them
        refs = load(path.read_bytes())["ref_logps"]
    for f, r in zip(feats, refs.numpy()):
        f["ref_logps"] = r


@torch.no_grad()
def _compute(task, model, feats: list[dict], *, batch_size: int, show_progress: bool) -> torch.Tensor:
    """(N, 2) fp32: the reference's summed log-probabilities of each feature's two rows (in order)."""
    from ...io.progress import progress

    device = next(model.parameters()).device
    out = torch.zeros(len(feats), 2)
    order = np.argsort([len(f["input_ids"]) for f in feats], kind="stable")  # like lengths together: less padding
    chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for chunk in progress(chunks, desc="reference", unit="batch", disable=not show_progress, leave=False):
        batch = task.collate([{k: v for k, v in feats[i].items() if k != "ref_logps"} for i in chunk])
        batch = {k: v.to(device) for k, v in batch.items()}
        ref = task.reference_logps(model, batch).float().cpu()  # (2n,): the first rows, then the second
        n = len(chunk)
        out[torch.as_tensor(chunk)] = torch.stack([ref[:n], ref[n:]], dim=1)
    return out
