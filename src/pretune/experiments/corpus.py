"""What the pretraining experiments (``ffn-variants``, ``masking``) share: the bundled corpus split into training and
held-out text, a tokenizer trained on the training text, the token stores every trial reads, and a downstream
sweep that finetunes each pretrained model on a bundled classification task.

The downstream sweep pairs each pretraining trial with one finetuning trial of the same seed: its grid is over
``model.init`` = ``<inputs>/pretrained/seed${train.seed}/<name>``, a link (made by :func:`link_pretrained`) to the
model folder of the pretraining trial ``<name>`` with that seed. ``${train.seed}`` is resolved when the trial's
config is loaded, so the finetuning trial ``init=<name>,seed=S`` starts from the model pretrained with seed S, and
the sweep aggregates the finetuned scores of each pretrained setting over its seeds.
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import bundled_file, head_records

CORPUS = ("enwiki_sample.txt.gz", "austen_emma_pride.txt.gz", "web_bible_gospels.txt.gz", "mobydick_ch1-20.txt.gz")
TASK = "tasks/sms_spam"  # the downstream task: SMS spam (13 % spam), scored by test macro-F1
DOWNSTREAM_METRICS = ["test.macro_f1", "test.accuracy"]
LINKS = "pretrained"  # <inputs>/pretrained/seed<S>/<name> -> a pretraining trial's model folder


def pretraining_inputs(folder: Path, *, corpus: tuple[str, ...], heldout: float, kind: str, vocab: int,
                       log=print) -> dict:
    """The training and held-out text, a tokenizer and the token stores, made once in ``folder`` (reused when there).

    Args:
        folder: the experiment's ``inputs/``.
        corpus: bundled corpus files (``corpus/<name>``).
        heldout: the share of each file's documents held out (its last documents; a file of fewer than 20
            documents, the Gospels, is all training text).
        kind, vocab: the tokenizer (``bpe``: GPT-2's byte-level BPE; ``wordpiece``: BERT's) and its vocabulary size.

    Returns:
        ``train``, ``heldout`` (text files), ``tokenizer`` (tokenizer.json), ``store`` (the token store folder, with
        ``train/`` and ``eval/``): absolute paths as text, as a sweep spec takes them.
    """
    from .. import bundled
    from ..data.readers import iter_documents
    from ..io.outputs import write_atomic

    folder.mkdir(parents=True, exist_ok=True)
    paths = {"train": folder / "train.txt", "heldout": folder / "heldout.txt", "tokenizer": folder / "tokenizer.json",
             "store": folder / "store"}
    if not (paths["train"].is_file() and paths["heldout"].is_file()):
        train, held = [], []
        for name in corpus:
            docs = list(iter_documents([bundled.path(f"corpus/{name}")]))
            n_held = round(len(docs) * heldout) if len(docs) >= 20 else 0
            train += docs[:len(docs) - n_held]
            held += docs[len(docs) - n_held:]
        write_atomic(paths["heldout"], "\n\n".join(held) + "\n", fsync=False)
        write_atomic(paths["train"], "\n\n".join(train) + "\n", fsync=False)
        log(f"{len(train)} training and {len(held)} held-out documents -> {folder}")
    if not paths["tokenizer"].is_file():
        from ..io.tokenization import train_tokenizer

        train_tokenizer([paths["train"]], kind=kind, vocab_size=vocab, show_progress=False).save(paths["tokenizer"])
    # the token stores every trial reads (built here once: trials running at once must not build them together);
    # a trial finds them by the same source paths (data.train, data.eval) and tokenizer
    from ..io.tokenization import Tokenizer
    from ..jobs.pretrain import build_token_store
    from ..runconfig import RunConfig

    tok = Tokenizer.load(paths["tokenizer"])
    for split, text in (("train", paths["train"]), ("eval", paths["heldout"])):
        build_token_store(RunConfig(), tok, [str(text.resolve())], paths["store"] / split, show_progress=False)
    return {k: str(p.resolve()) for k, p in paths.items()}


def task_files(folder: Path, records: dict[str, int] | None) -> dict:
    """The downstream task's files as ``task_train``, ``task_dev``, ``task_test``: the bundled ones, or
    (``records``: split -> n) their first records, written to ``folder`` (a fast size's small data)."""
    if not records:
        return {f"task_{split}": bundled_file(f"{TASK}/{split}.jsonl") for split in ("train", "dev", "test")}
    return {f"task_{split}": head_records(bundled_file(f"{TASK}/{split}.jsonl"), folder / f"task-{split}.jsonl", n)
            for split, n in records.items()}


def link_pretrained(folder: Path, targets: dict[tuple[str, int], Path]) -> str:
    """Make ``folder/pretrained/seed<S>/<name>`` a (relative) link to each target model folder, keyed (name, seed);
    the targets need not exist yet (a later sweep writes them). Returns ``folder/pretrained`` as text."""
    root = folder / LINKS
    for (name, seed), target in targets.items():
        link = root / f"seed{seed}" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        rel = os.path.relpath(target, link.parent)
        if link.is_symlink() and os.readlink(link) == rel:
            continue
        if link.is_symlink():
            link.unlink()
        os.symlink(rel, link, target_is_directory=True)
    return str(root.resolve())


def trial_models(spec: dict, sweep_folder: Path, name_of) -> dict[tuple[str, int], Path]:
    """(name, seed) -> the model folder of each trial of a pretraining sweep spec run in ``sweep_folder``;
    ``name_of(params)`` names a trial's setting (its link's name)."""
    from ..sweep.spec import expand, load_spec

    trials = expand(load_spec({**spec, "out": str(sweep_folder)}))
    return {(name_of(t.params), t.seed): sweep_folder / "trials" / t.name / "model" for t in trials}


def downstream_spec(links: str, names: list[str], inputs: dict, *, seeds: list[int], max_len: int, epochs: int,
                    batch_size: int, lr: float, precision: str) -> dict:
    """The finetuning sweep over the linked pretrained models: each model ``name`` finetuned with the seed it was
    pretrained with (see the module docstring), on the task files of ``inputs`` (:func:`task_files`)."""
    return {
        "command": "finetune",
        "base": {"task": {"name": "classification", "max_len": max_len},
                 "data": {split: inputs[f"task_{split}"] for split in ("train", "dev", "test")},
                 "tune.epochs": epochs, "tune.evals_per_epoch": 1,
                 "train": {"lr": lr, "batch_size": batch_size, "precision": precision, "keep_last": 0,
                           "plot": False, "tensorboard": False}},
        "grid": {"model.init": [f"{links}/seed${{train.seed}}/{name}" for name in names]},
        "seeds": seeds,
        "metrics": DOWNSTREAM_METRICS,
    }


def downstream_name(params: dict) -> str | None:
    """The linked model's name of a downstream setting (``.../seed${train.seed}/relu`` -> ``relu``)."""
    init = params.get("model.init")
    return Path(init).name if isinstance(init, str) else None
