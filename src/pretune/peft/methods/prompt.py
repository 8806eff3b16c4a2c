"""Prompt tuning (Lester et al. 2021): n_virtual trainable embeddings put before the input of the stack that
reads it (``Stack.extra_inputs``); initialised from vocabulary embeddings (sampled rows, or the words of a text)
or at random."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PeftConfig
from ..core import PeftError, module_dict
from ..layers import PROMPT_DICT, PromptSite, SoftPrompt

NAME = "prompt"
PARTS = (PROMPT_DICT,)
MERGEABLE = False  # adds input positions
DEFAULT_LR = 3e-2  # when train.lr is not set (Lester et al. 2021: 0.3 with Adafactor; AdamW needs less)


@dataclass
class Settings(PeftConfig):
    """Prompt tuning's settings (peft.*)."""

    n_virtual: int = 20  # virtual tokens: trainable embeddings put before the input
    prompt_init: str = "vocab"  # vocab (rows of random vocabulary embeddings), random, or text:WORDS


def validate(cfg) -> None:
    if cfg.n_virtual < 1:
        raise PeftError(f"peft.n_virtual={cfg.n_virtual}: prompt tuning needs >= 1 virtual token")
    if not (cfg.prompt_init in ("vocab", "random") or cfg.prompt_init.startswith("text:")):
        raise PeftError(f"peft.prompt_init={cfg.prompt_init!r}: expected vocab, random or text:WORDS")


def positions_taken(cfg) -> int:
    """Input positions the soft prompt occupies (a learned/sinusoidal position table must have room for them)."""
    return cfg.n_virtual


def inject(model, cfg, name: str, ctx) -> None:
    prompts = module_dict(model, PROMPT_DICT)
    stack = model.transformer.input_stack
    if stack.extra_inputs is None:
        stack.extra_inputs = PromptSite(ctx.state, prompts)
    prompts[name] = SoftPrompt(cfg.n_virtual, model.config.embedding_dim)
    embed = model.transformer.embed.weight
    if stack.embed_scale is not None:  # Gemma: the stack scales the token embeddings, so like ones start scaled
        embed = embed.detach() * stack.embed_scale
    _init_prompt(prompts[name], embed, cfg, ctx.tokenizer, ctx.generator)


def _init_prompt(prompt: SoftPrompt, embed: torch.Tensor, cfg, tokenizer, gen) -> None:
    """Lester et al. 2021: initialise from vocabulary embeddings (sampled rows, or the words of a text)."""
    n = prompt.n_virtual
    with torch.no_grad():
        if cfg.prompt_init == "random":
            prompt.embedding.copy_(torch.randn(n, embed.shape[1], generator=gen) * embed.std().item())
            return
        if cfg.prompt_init.startswith("text:"):
            if tokenizer is None:
                raise PeftError("peft.prompt_init=text:... needs the tokenizer")
            ids = tokenizer.encode(cfg.prompt_init[5:]) if hasattr(tokenizer, "encode") else []
            ids = [i for i in (ids.ids if hasattr(ids, "ids") else ids)]
            if not ids:
                raise PeftError(f"peft.prompt_init={cfg.prompt_init!r} encodes to no tokens")
            ids = (ids * (n // len(ids) + 1))[:n]
        else:
            ids = torch.randint(0, embed.shape[0], (n,), generator=gen).tolist()
        prompt.embedding.copy_(embed[torch.tensor(ids, device=embed.device)].float())


def strip(model) -> None:
    for stack in (model.transformer.encoder, model.transformer.decoder):
        if stack is not None and isinstance(stack.extra_inputs, PromptSite):
            stack.extra_inputs = None
    if getattr(model, PROMPT_DICT, None) is not None:
        delattr(model, PROMPT_DICT)
