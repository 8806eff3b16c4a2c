"""Helpers for the experiments whose trials pretrain: the corpus, tokenizer and token store the trials share, and
the compute of a run (for comparing objectives at equal compute, or reporting it).

``shared_corpus(folder, files, kind=..., vocab=...)`` trains the tokenizer on bundled corpus files and builds the
token store every trial reads, once, before any trial runs (trials running at once must not build one together).
``step_flops(base)`` builds a pretraining run as ``pretune pretrain`` would (``pretrain.prepare``: the tokenizer,
the model, the objective, the packed data of its token store) from a sweep's base config and counts the
floating-point operations of a training step on a few batches of its own data
(``pretune.objectives.flops.step_flops``: matrix products of the forward and backward pass, whatever models the
objective runs). ``measure_compute`` writes each finished trial's total (FLOPs per step x its steps) into its
``results.json`` under ``compute``, so a sweep's table carries ``compute.pflops``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

BATCHES = 4  # batches the count averages over (masked positions and padding vary from batch to batch)


def corpus_files(names) -> list[str]:
    """The absolute paths of bundled corpus files (``mobydick_ch1-20.txt.gz``), as the trials' ``data.train``."""
    from .. import bundled

    return [str(bundled.path(f"corpus/{name}").resolve()) for name in names]


def shared_corpus(folder: Path, files: list[str], *, kind: str, vocab: int, specials: str | None = None,
                  log=print) -> dict:
    """A tokenizer trained on ``files`` and their token store, in ``folder`` (reused when already there).

    Args:
        folder: the experiment's ``inputs/`` folder.
        files: the corpus files (``corpus_files``); the trials' ``data.train`` must list the same paths.
        kind, vocab, specials: ``pretune.io.tokenization.train_tokenizer``'s (wordpiece with BERT specials for
            encoders; unigram with T5's specials and sentinels for T5).

    Returns:
        ``{"tokenizer": path, "store": folder}`` as text, for the trials' ``tokenizer`` and ``data.store``.
    """
    from ..io.tokenization import Tokenizer, train_tokenizer
    from ..jobs.pretrain import build_token_store
    from ..runconfig import RunConfig

    folder.mkdir(parents=True, exist_ok=True)
    tok_file, store = folder / "tokenizer.json", folder / "store"
    if not tok_file.is_file():
        tok = train_tokenizer(files, kind=kind, vocab_size=vocab, specials=specials, show_progress=False)
        tok.save(tok_file)
        log(f"inputs: a {kind} tokenizer of {tok.vocab_size} tokens -> {tok_file}")
    build_token_store(RunConfig(), Tokenizer.load(tok_file), list(files), store / "train", show_progress=False)
    return {"tokenizer": str(tok_file.resolve()), "store": str(store.resolve())}


def step_flops(base: dict, *, batches: int = BATCHES, seed: int = 0) -> dict:
    """The mean counted FLOPs of one optimizer step of the pretraining run ``base`` describes.

    Args:
        base: the run's config as nested sections (a pretraining sweep's ``base``: model, objective, tokenizer,
            data with its ``store`` already built, train); ``train.out`` is not touched.
        batches: how many batches of ``train.batch_size`` blocks (drawn with ``seed``) the mean is over.

    Returns:
        ``{"flops_per_step", "forward", "backward", "batches"}``: FLOPs of a whole step (forward + backward), of
        its forward and of its backward pass.
    """
    import numpy as np
    import torch

    from ..jobs.pretrain import load_run_config, prepare
    from ..objectives.flops import step_flops as count

    cfg = load_run_config(base=base)
    with torch.random.fork_rng(devices=[]):
        _, model, objective, data, _ = prepare(cfg, show_progress=False)
        model.train()
        objective.train()
        rng = np.random.default_rng(seed)
        order = rng.permutation(data.train_ids)
        size = cfg.train.batch_size
        if len(order) < size:
            raise ValueError(f"{len(order)} training blocks cannot fill one batch of {size}")

        def random_block(r):
            return data.get(int(r.choice(data.train_ids)))

        counted = []
        for b in range(min(batches, len(order) // size)):
            examples = [objective.example(data.get(int(i)), rng, random_block) for i in order[b * size:(b + 1) * size]]
            counted.append(count(objective, model, objective.collate(examples)))
    n = len(counted)
    forward = sum(c.forward for c in counted) / n
    backward = sum(c.backward for c in counted) / n
    return {"flops_per_step": forward + backward, "forward": forward, "backward": backward, "batches": n}


def cached_step_flops(base: dict, folder: Path, *, batches: int = BATCHES, log=print) -> dict:
    """``step_flops(base, batches=batches)``, kept in ``folder/flops-<hash>.json`` so a rerun reuses it."""
    from ..io.outputs import write_atomic

    key = hashlib.sha256(json.dumps([base, batches], sort_keys=True, default=str).encode()).hexdigest()[:12]
    path = folder / f"flops-{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    result = step_flops(base, batches=batches)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(result, indent=1) + "\n", fsync=False)
    name = (base.get("objective") or {}).get("name", "?")
    log(f"compute: objective {name}: {result['flops_per_step'] / 1e9:.3g} GFLOPs per training step "
        f"(counted on {result['batches']} batches)")
    return result


def measure_compute(result, flops_per_step, log=print) -> bool:
    """Write ``compute`` (``flops_per_step``, ``steps``, ``flops``, ``pflops``) into the ``results.json`` of each
    finished trial of a pretraining sweep (``result``: its SweepResult) that lacks it, the steps read from the
    trial's ``run.yaml`` (a finished run ran all of them). ``flops_per_step``: a number, or a function of the trial's
    row (results.jsonl's: its ``params``) when the sweep's trials differ (a grid over ``objective.name``). Returns
    whether anything was written."""
    from ..io.outputs import mark, write_atomic

    wrote = False
    for row in result.rows:
        folder = Path(result.out) / "trials" / row["trial"]
        file = folder / "results.json"
        if row["status"] != "done" or file.is_file():
            continue
        steps = _run_steps(folder / "run.yaml")
        if steps is None:
            continue
        per_step = flops_per_step(row) if callable(flops_per_step) else flops_per_step
        total = per_step * steps
        data = {"compute": {"flops_per_step": per_step, "steps": steps, "flops": total, "pflops": total / 1e15}}
        write_atomic(file, json.dumps(data, indent=1) + "\n")
        mark(folder, ["results.json"])  # an --overwrite of the trial removes it with the run
        log(f"compute: {row['trial']}: {steps} steps x {per_step / 1e9:.3g} GFLOPs = {total / 1e15:.3g} PFLOPs")
        wrote = True
    return wrote


def _run_steps(run_yaml: Path) -> int | None:
    import yaml

    try:
        return int(yaml.safe_load(run_yaml.read_text())["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None


def link_model(link: Path, target: Path) -> str:
    """``link`` -> ``target`` (relative to the link's folder) as a symlink, made once (the target may not exist yet:
    a pretraining trial's ``model`` folder, linked before the sweep runs); returns the link's path, whose name then
    names the model in a finetuning sweep's trial names (``init=mlm-s0,seed=1``)."""
    if not link.is_symlink():
        try:
            os.symlink(target, link, target_is_directory=True)
        except OSError:  # no symlinks here: name the model folder itself (trial names then carry a digest)
            return str((link.parent / target).resolve(strict=False))
    return str(link.absolute())


def save_random_init(base: dict, seed: int, folder: Path) -> None:
    """The model of the pretraining run ``base`` describes at its initialisation with ``seed``, built as ``pretune
    pretrain`` builds it (``pretrain.prepare``; its token store must exist), saved as a checkpoint with the tokenizer
    in ``folder``: the no-pretraining reference."""
    import torch

    from ..io.checkpoint import save
    from ..jobs.pretrain import load_run_config, prepare

    cfg = load_run_config(base={**base, "train": {**base["train"], "seed": seed}})
    with torch.random.fork_rng(devices=[]):
        tok, model, _, _, _ = prepare(cfg, show_progress=False)
    save(model, folder, tokenizer=tok)


def pretraining_trials(spec: dict) -> list:
    """The trials (``pretune.sweep.Trial``: name, params, seed) a sweep spec (a dict without ``out``) expands to,
    so an experiment can link a later sweep to their folders (``<sweep>/trials/<name>/model``) before they run."""
    from ..sweep.spec import expand, load_spec

    return expand(load_spec({**spec, "out": "."}))
