"""Never lose a user's work: where pretune may write, and what it may replace there.

Every folder pretune writes holds a marker, ``.pretune.json``, listing the entries it wrote there. A command that
writes to a folder it is given (``--out``, ``train.out``) first calls :func:`check_folder`:

* a missing or empty folder is fine;
* a folder that holds anything else is refused, naming it and what is there, unless the user passes
  ``--overwrite``; even then only the entries pretune wrote there (its marker says which) are replaced or
  removed, never anything else (:func:`pretune.io.checkpoint.atomic_folder` writes that way);
* a run folder (it holds ``run.yaml``) is never taken over silently: a new run there needs ``--overwrite``,
  continuing it needs ``--resume``.

A single output file (predictions, embeddings, a tokenizer) that exists is refused unless ``--overwrite``
(:func:`check_file`). A path whose parent is a file, or that is a file where a folder is wanted, is an error
naming it, as is a folder that cannot be created or written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..config import ConfigError

MARKER = ".pretune.json"
LAUNCH_FILE = ".torchrun.json"  # which torchrun launch runs a run folder's run (pretune.train.elastic)
__all__ = ["MARKER", "LAUNCH_FILE", "OutputError", "write_atomic", "check_folder", "check_file", "owned_entries",
           "run_entries", "mark", "claim", "clean_run_folder", "prepare_run_folder", "RUN_ENTRIES"]

# what a pretraining or finetuning run writes into its folder (what --overwrite may remove; data/, the token store,
# is a cache keyed by its inputs and stays)
RUN_ENTRIES = ("run.yaml", "metrics.jsonl", "metrics.csv", "tb", "loss.png", "checkpoints", "model", "generator",
               "results.json", "test_predictions.jsonl", "reference_logps.safetensors", MARKER)


class OutputError(ConfigError):
    """An output path pretune refuses to write to; the message names it and what to do."""


def write_atomic(path: str | os.PathLike, data: str | bytes | Callable[[BinaryIO], None], *, fsync: bool = True
                 ) -> Path:
    """Write the file ``path`` through a temporary file beside it renamed into place, so that it is either the old
    file or the whole new one: ``data`` is text (UTF-8), bytes, or a function writing to the binary file. The file
    gets the permissions the umask allows (mkstemp makes 0600) and, with ``fsync``, reaches the disk before the
    rename; a failed write leaves no temporary file."""
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def owned_entries(folder: str | os.PathLike) -> set[str]:
    """The entries (top-level names) pretune wrote into ``folder``, from its marker (empty: no marker)."""
    try:
        data = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return set()
    entries = data.get("entries") if isinstance(data, dict) else None
    return {str(e) for e in entries} if isinstance(entries, list) else set()


def mark(folder: str | os.PathLike, entries, *, command: str = "", merge: bool = True) -> None:
    """Record that pretune wrote ``entries`` (top-level names) into ``folder`` (added to what it recorded before,
    or, with ``merge=False``, instead of it)."""
    folder = Path(folder)
    known = (owned_entries(folder) if merge else set()) | {str(e) for e in entries}
    tmp = folder / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"written_by": "pretune", "command": command, "entries": sorted(known)}, indent=1))
    os.replace(tmp, folder / MARKER)


def _check_parents(path: Path) -> None:
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"{path}: its parent {parent} is a file, not a folder; choose another path")
            if not os.access(parent, os.W_OK):
                raise OutputError(f"{path}: cannot write in {parent} (permission denied)")
            return


def check_folder(path: str | os.PathLike, *, overwrite: bool = False, resume: bool = False, what: str = "output",
                 flag: str = "--overwrite") -> Path:
    """May a command write the folder ``path``? Returns it; raises OutputError saying why not (see the module
    docstring). ``resume``: the command continues the run there (its run.yaml is expected)."""
    path = Path(path)
    _check_parents(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path} is a file; the {what} must be a folder (choose another path)")
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if not entries or resume:
        return path
    if (path / "run.yaml").is_file() and not overwrite:
        raise OutputError(f"{path} already holds a run (run.yaml): continue it with --resume, or start over with "
                          f"{flag} (which removes what the run wrote there, nothing else), or choose another folder")
    owned = run_entries(path)
    foreign = [e for e in entries if e not in owned and e != MARKER]
    if what == "run" and not foreign and set(entries) <= {"data", MARKER, LAUNCH_FILE}:
        return path  # only a run's token-store cache (keyed by its inputs, reused): a run stopped while preparing
    if not overwrite:
        shown = ", ".join(foreign[:5] or entries[:5]) + (" ..." if len(foreign or entries) > 5 else "")
        if foreign:
            raise OutputError(f"{path} is not empty and holds what pretune did not write ({shown}); choose another "
                              f"{what} folder, or pass {flag} to write beside those (they stay untouched)")
        raise OutputError(f"{path} already holds an earlier pretune output ({shown}); pass {flag} to replace it, "
                          "or choose another folder")
    return path


def check_file(path: str | os.PathLike, *, overwrite: bool = False, what: str = "output",
               flag: str = "--overwrite") -> Path:
    """May a command write the file ``path``? An existing file is refused unless ``overwrite``."""
    path = Path(path)
    _check_parents(path)
    if path.is_dir():
        raise OutputError(f"{path} is a folder; the {what} must be a file path (e.g. {path / 'out.jsonl'})")
    if path.exists() and not overwrite:
        raise OutputError(f"{path} already exists; pass {flag} to replace it, or choose another file")
    return path


def run_entries(folder: str | os.PathLike) -> set[str]:
    """The entries of a run folder that pretune wrote: its marker's, or, for a run folder from before markers
    (run.yaml, no marker), the run entries (``RUN_ENTRIES``) present."""
    folder = Path(folder)
    if (folder / MARKER).is_file() or not (folder / "run.yaml").is_file():
        return owned_entries(folder)
    return {e for e in RUN_ENTRIES if (folder / e).exists()} | ({"data"} if (folder / "data").is_dir() else set())


def clean_run_folder(path: str | os.PathLike) -> list[str]:
    """``--overwrite`` on a run folder: remove what pretune wrote there (``run_entries``) except its token-store
    cache ``data/``, nothing else; returns the names removed."""
    import shutil

    path = Path(path)
    removed = []
    for name in sorted(run_entries(path) - {"data", MARKER}):
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        else:
            continue
        removed.append(name)
    owned = owned_entries(path) - set(removed)
    if (path / MARKER).is_file():
        mark(path, owned, merge=False)
    return removed


def claim(folder: str | os.PathLike, entries, *, what: str = "run") -> None:
    """Before a job writes ``entries`` (top-level names) into ``folder``: refuse any that exists and was not
    written by pretune (a user's ``model/`` or ``data/`` beside an --overwrite), then record them as pretune's."""
    folder = Path(folder)
    owned = run_entries(folder)
    clash = sorted(e for e in entries if ((folder / e).exists() or (folder / e).is_symlink()) and e not in owned)
    if clash:
        raise OutputError(f"{folder} holds {', '.join(clash)}, which pretune did not write and this {what} would "
                          "write to; move it away or choose another folder")
    mark(folder, entries)


def prepare_run_folder(run_dir: str | os.PathLike, config: dict, *, resume: bool, overwrite: bool, log=print,
                       derived=(), writes=(), stored_as_now=None) -> Path:
    """Get a pretraining or finetuning run folder ready (the main process only): a new run needs an empty folder
    (or --overwrite, which removes what an earlier run wrote there, nothing else, and refuses a name the run would
    write that holds something of the user's); --resume needs the run's own folder and a config that differs from
    its run.yaml only where that is allowed (runconfig.check_resume). ``writes``: more entries the run writes
    (pretraining's token store ``data``). ``stored_as_now``: the run.yaml's config as the job writes it now (a job
    whose sections changed shape reads an older run.yaml through it)."""
    from ..runconfig import check_resume

    run_dir = check_folder(run_dir, overwrite=overwrite, resume=resume, what="run")
    if resume:
        stored = run_dir / "run.yaml"
        if not stored.is_file():
            raise OutputError(f"nothing to resume: {run_dir} holds no run (no run.yaml); start it without --resume")
        from omegaconf import OmegaConf

        try:
            old = OmegaConf.to_container(OmegaConf.load(stored))
        except Exception as e:  # noqa: BLE001 - any YAML failure: name the file
            raise OutputError(f"{stored}: not readable ({e}); cannot check the config the run started with") from None
        if stored_as_now is not None:
            old = stored_as_now(old)
        for line in check_resume(old, config, source=str(run_dir), derived=derived):
            log(f"resume: {line}")
        return run_dir
    if overwrite and run_dir.is_dir():
        removed = clean_run_folder(run_dir)
        if removed:
            log(f"--overwrite: removed {', '.join(removed)} of the earlier run in {run_dir}")
    run_dir.mkdir(parents=True, exist_ok=True)
    claim(run_dir, tuple(e for e in RUN_ENTRIES if e != MARKER) + tuple(writes))
    return run_dir
