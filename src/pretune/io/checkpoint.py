"""Checkpoint folders: ``config.json`` + ``model.safetensors`` (+ ``tokenizer.json``).

Writes are atomic (a temporary folder renamed into place), loads are strict: a missing,
unexpected or mis-shaped tensor, a corrupt file or an unknown config key is an error naming it.
Weights are never unpickled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import ConfigError, ModelConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"
TASK_FILE = "task.json"  # a finetuned model's task settings: how its records become inputs (tasks.run.save_task)


class CheckpointError(ValueError):
    """A checkpoint folder cannot be loaded; the message names the file and tensor/key."""


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, contiguous and on the CPU, as a tensor that owns its storage: a copy where it is a view of a
    larger one (a frozen q/k/v or gate/up weight is a view of the stacked copy ``FusedLinears`` keeps), which
    safetensors refuses to write."""
    t = t.detach().contiguous().cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with each shared tensor once, under its first name (tied embeddings,
    shared encoder-decoder blocks are stored once; the model re-ties them when built)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t.detach()
    return out


@contextlib.contextmanager
def empty_parameters():
    """Within it, every parameter a module registers lives on the meta device: building a model costs neither its
    memory nor its random initialisation, and :func:`load_state` then makes each parameter the checkpoint's own
    tensor, so loading holds the weights once (not a random copy beside the file's). Buffers stay real (RoPE's
    frequencies are computed, not stored). Patches ``nn.Module.register_parameter`` for its duration, as
    ``accelerate.init_empty_weights`` does: build nothing else in other threads meanwhile.

    :func:`read_weights` reads a safetensors file into the process's memory (not a mapping of the file), so a
    parameter made of its tensor shares nothing with the file: writing to one never touches the other."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    # initialising a meta tensor would do nothing, but torch's first random op on one imports its Python meta
    # kernels (~800 modules, ~0.8 s, ~75 MB): the initialisers skip meta tensors instead, as transformers'
    # no_init_weights does
    inits = {name: fn for name, fn in vars(nn.init).items() if name.endswith("_") and callable(fn)}

    def skipping_meta(fn):
        def init(tensor, *args, **kwargs):
            return tensor if getattr(tensor, "is_meta", False) else fn(tensor, *args, **kwargs)
        return init

    nn.Module.register_parameter = on_meta
    for name, fn in inits.items():
        setattr(nn.init, name, skipping_meta(fn))
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for name, fn in inits.items():
            setattr(nn.init, name, fn)


def load_state(model: nn.Module, tensors: dict[str, torch.Tensor], *, source: str) -> None:
    """Copy ``tensors`` into ``model`` strictly: every expected tensor present, none unexpected,
    shapes equal. Raises CheckpointError naming the offending tensor and ``source``.

    Parameters on the meta device (a model built under :func:`empty_parameters`) are not copied into: each becomes
    the given tensor itself, in the parameter's dtype, contiguous and owning its storage (a copy only where it is
    not), wherever the parameter is tied. ``tensors`` then belongs to the model: pass tensors nothing else holds
    (read from a file)."""
    expected = unique_state(model)
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r} not in the model"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for k, t in expected.items():
        if tuple(tensors[k].shape) != tuple(t.shape):
            raise CheckpointError(f"{source}: tensor {k!r} has shape {tuple(tensors[k].shape)}, "
                                  f"the model expects {tuple(t.shape)}")
    adopted: dict[int, nn.Parameter] = {}  # id(meta parameter) -> the parameter that replaces it
    taken: set[int] = set()  # storages already adopted: a second key gets a copy (no accidental tie)
    with torch.no_grad():
        for k, t in model.state_dict(keep_vars=True).items():
            if k not in expected:
                continue  # a second name of a tied tensor
            if not t.is_meta:
                t.copy_(tensors[k])
                continue
            data = tensors[k].detach().to(device="cpu", dtype=t.dtype).contiguous()
            storage = data.untyped_storage()
            if storage.data_ptr() in taken or storage.nbytes() != data.numel() * data.element_size():
                data = data.clone()  # a view of a larger tensor would keep all of it alive
            taken.add(data.untyped_storage().data_ptr())
            adopted[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad)
    if adopted:
        for m in model.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) in adopted:
                    m._parameters[name] = adopted[id(p)]
    left = [k for k, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise CheckpointError(f"{source}: no tensor for {left[0]!r} (the model holds it outside its parameters)")


def atomic_folder(path: str | os.PathLike):
    """Context manager: yields a temporary folder beside ``path`` that becomes ``path`` on success and is removed
    on failure, so a crash never leaves a half-written folder. The folder gets a marker (``.pretune.json``, see
    ``pretune.io.outputs``) listing what pretune wrote; its files are flushed to disk before the rename. A new ``path``
    appears whole in one rename; an existing one stays in place (it may be the current folder or a symlink, and
    may hold the user's files, which commands refuse unless --overwrite): each of pretune's entries is replaced
    atomically, stale entries of its earlier output are removed, nothing else is touched."""
    return _AtomicFolder(Path(path))


class _AtomicFolder:
    def __init__(self, path: Path):
        self.path = Path(os.path.abspath(path))  # "." too: the temp folder goes beside it, not inside

    def __enter__(self) -> Path:
        from .outputs import _check_parents

        _check_parents(self.path)
        if self.path.exists() and not self.path.is_dir():
            raise CheckpointError(f"{self.path} is a file; cannot write a folder there")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a checkpoint is an ordinary folder
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        from .outputs import MARKER, mark, run_entries

        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            entries = sorted(p.name for p in self.tmp.iterdir() if p.name != MARKER)
            mark(self.tmp, entries)
            _fsync_tree(self.tmp)
            exists = self.path.is_dir()
            owned = run_entries(self.path) if exists else set()
            clash = sorted(set(entries) & (set(os.listdir(self.path)) - owned - {MARKER})) if exists else []
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        if not exists:  # a new folder: one rename puts it in place whole
            os.replace(self.tmp, self.path)
            _fsync_dir(self.path.parent)
            return
        if clash:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise CheckpointError(f"{self.path} holds {', '.join(clash)}, which pretune did not write and would have "
                                  "to replace; move it away or choose another folder")
        # an existing folder (the current one, a symlink, one holding the user's files) stays where it is: each of
        # pretune's entries is replaced atomically, stale ones of its earlier output go, anything else stays
        for name in sorted(owned - set(entries) - {MARKER}):
            _remove(self.path / name)
        for name in entries:
            target = self.path / name
            if target.exists() or target.is_symlink():
                aside = self.path / f".{name}.old-{os.getpid()}"
                os.replace(target, aside)
                os.replace(self.tmp / name, target)
                _remove(aside)
            else:
                os.replace(self.tmp / name, target)
        mark(self.path, entries, merge=False)
        _fsync_dir(self.path)
        shutil.rmtree(self.tmp, ignore_errors=True)


def disk_full(e: BaseException, where: str | os.PathLike) -> OSError | None:
    """``e`` as an ENOSPC OSError when it means the disk under ``where`` is full, else None. torch's checkpoint
    writer reports a full disk as a RuntimeError ("PytorchStreamWriter failed writing file") and safetensors as
    its own error ("No space left on device (os error 28)"), so the message and the free space are both asked."""
    import errno

    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return e
    text = str(e)
    said = any(m in text for m in ("No space left", "os error 28", "StorageFull", "ENOSPC"))
    writing = "failed writing" in text or "file write failed" in text
    if not said and writing:
        try:
            probe = Path(where)
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            said = shutil.disk_usage(probe).free < 64 * 2**20
        except OSError:
            said = False
    return OSError(errno.ENOSPC, "No space left on device", str(where)) if said else None


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` (and the folders) to disk before the rename that publishes them, so a power
    loss cannot leave a published checkpoint with empty files; give each file the permissions the user's umask
    asks for (safetensors and temp files are created 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fchmod(fd, 0o666 & ~umask)
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def save(model: nn.Module, path: str | os.PathLike, *, tokenizer: Any = None) -> Path:
    """Write ``model`` (a TransformerLM) to the folder ``path`` atomically.

    Args:
        model: the model; its ``config`` is saved as config.json.
        path: destination folder (replaced if it exists).
        tokenizer: optional ``tokenizers.Tokenizer`` or path to a tokenizer.json to copy beside it.
    """
    path = Path(path)
    with atomic_folder(path) as tmp:
        tensors = {k: owned(v) for k, v in unique_state(model).items()}
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "library": "pretune"})
        write_config_and_tokenizer(model.config, tokenizer, tmp)
    return path


def write_config_and_tokenizer(config, tokenizer: Any, folder: Path) -> None:
    """config.json, and tokenizer.json (+ its chat template and roles) when a tokenizer (object or file) is given."""
    config.save(folder / CONFIG_NAME)
    if tokenizer is not None:
        if isinstance(tokenizer, (str, os.PathLike)):
            shutil.copyfile(tokenizer, folder / TOKENIZER_NAME)
        else:
            tokenizer.save(str(folder / TOKENIZER_NAME))


def read_weights(file: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a safetensors file; a truncated or corrupt file raises CheckpointError naming it."""
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"{file}: weights file not found")
    try:
        try:
            # read into the process's own memory, not mapped from the file: a model whose parameters are these
            # tensors (load_state) never shares pages with a file that may be rewritten, and a weight it drops (one
            # re-pointed into a stacked copy) gives its memory back
            return load_file(str(file), backend="pread")
        except TypeError:  # safetensors < 0.8 only maps the file
            return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def load(path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Load a checkpoint folder written by ``save`` (config.json + model.safetensors).

    Returns the TransformerLM in eval mode. Raises ConfigError/CheckpointError naming what is wrong.
    """
    from ..model import TransformerLM

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint folder (expected {CONFIG_NAME} and {WEIGHTS_NAME})")
    if not (path / CONFIG_NAME).is_file():
        raise CheckpointError(f"{path}: missing {CONFIG_NAME}")
    config = ModelConfig.load(path / CONFIG_NAME)
    tensors = read_weights(path / WEIGHTS_NAME)
    with empty_parameters():
        model = TransformerLM(config)
    load_state(model, tensors, source=str(path / WEIGHTS_NAME))
    model.to(device=device, dtype=dtype)
    return model.eval()


__all__ = ["save", "load", "CheckpointError", "ConfigError", "unique_state", "load_state", "empty_parameters",
           "atomic_folder"]
