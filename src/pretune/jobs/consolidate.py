"""``pretune consolidate``: a plain model folder from any training checkpoint, sharded (FSDP, any number of
processes wrote it) or not, in one process: what ``model/`` holds at the end of a run, from the middle of one."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..io.checkpoint import (
    CONFIG_NAME,
    TOKENIZER_NAME,
    CheckpointError,
    empty_parameters,
    load,
    load_state,
    save,
    unique_state,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def checkpoint_model(ckpt: str | Path):
    """The full model a training checkpoint holds (a TransformerLM in eval mode) and the tokenizer file beside it
    (or None). A checkpoint of a run that trained only some parameters (PEFT, a frozen body) holds only those: it
    is refused, naming the run's final adapter as the way out."""
    from ..train.parallel import SHARDED_DIR, read_sharded

    ckpt = Path(ckpt)
    if not (ckpt / "trainer.pt").is_file():
        raise CheckpointError(f"{ckpt} is not a training checkpoint (no trainer.pt); a checkpoint is "
                              "<run>/checkpoints/step-NNNNNNNN")
    if (ckpt / "model").is_dir():
        return load(ckpt / "model"), ckpt / "model" / TOKENIZER_NAME
    partial = (f"{ckpt} holds only the tensors its run trained (some parameters were frozen: a PEFT method or "
               "tune.freeze), not a whole model; the run's model/ folder at its end holds the adapter (or resume "
               "the run to get there)")
    if (ckpt / "trainable.safetensors").is_file():
        raise CheckpointError(partial)
    if not (ckpt / SHARDED_DIR).is_dir() or not (ckpt / CONFIG_NAME).is_file():
        raise CheckpointError(f"{ckpt} holds neither model/ nor sharded/ with its config.json: not a checkpoint "
                              "this version of pretune wrote")
    from ..model import TransformerLM

    cfg = ModelConfig.load(ckpt / CONFIG_NAME)
    with empty_parameters():  # the tensors read below become the parameters (the weights held once)
        model = TransformerLM(cfg)
    try:
        tensors = read_sharded(ckpt / SHARDED_DIR)
    except Exception as e:  # noqa: BLE001 - the checkpoint reader fails on a torn file in several ways
        raise CheckpointError(f"{ckpt / SHARDED_DIR}: not readable ({str(e).strip().splitlines()[0][:200]})") from None
    weights = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    expected = unique_state(model)
    if any(k not in weights for k in expected):
        raise CheckpointError(partial)
    load_state(model, {k: weights[k] for k in expected}, source=str(ckpt / SHARDED_DIR))
    tok = ckpt / TOKENIZER_NAME
    return model.eval(), tok if tok.is_file() else None


def consolidate(ckpt: str | Path, out: str | Path, *, dtype: str = "fp32") -> Path:
    """Write the model of training checkpoint ``ckpt`` as a plain pretune folder ``out`` (atomically), in ``dtype``,
    with the tokenizer and the run's run.yaml."""
    from ..io.outputs import mark, write_atomic

    model, tok = checkpoint_model(ckpt)
    model = model.to(DTYPES[dtype])
    out = save(model, out, tokenizer=tok)
    if (Path(ckpt) / "run.yaml").is_file():
        write_atomic(out / "run.yaml", (Path(ckpt) / "run.yaml").read_bytes())
        mark(out, ["run.yaml"])
    return out
