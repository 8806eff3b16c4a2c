"""A tiny chat model (and a LoRA adapter of it) served on a free loopback port, once per module."""

from __future__ import annotations

import pytest

from helpers.serving import Running
from helpers.tiny_chat import tiny_chat_model


def make_adapter(base_folder, folder, seed: int = 1):
    """A LoRA adapter folder of the tiny model whose weights are random (not the zero init), so it changes text."""
    import torch

    import pretune
    from pretune import peft

    model = pretune.load_pretrained(base_folder).model
    peft.inject(model, peft.PeftConfig(method="lora", r=4, targets=["all-linear"]), seed=seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft.save_adapter(model, folder, base=str(base_folder))
    return folder


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_chat")
    tiny_chat_model(d / "tiny")
    make_adapter(d / "tiny", d / "lora")
    return d / "tiny", d / "lora"


@pytest.fixture(scope="module")
def served(tiny_folders):
    from pretune.serve import Limits, load_server

    base, lora = tiny_folders
    server = load_server(str(base), adapters={"lora": str(lora)}, limits=Limits(max_batch=8, max_queue=64))
    running = Running(server)
    yield running
    running.stop()
