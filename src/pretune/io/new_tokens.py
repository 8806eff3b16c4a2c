"""New special tokens (``task.add_tokens``): added to the tokenizer, never split, and given rows in the token
embedding and the LM head, each new row the mean of the existing rows.

The mean is what transformers' ``resize_token_embeddings(mean_resizing=True)`` starts from (Hewitt 2021, "Initializing
new word embeddings for pretrained language models"): it draws each new row from N(mean, 1e-9 * covariance), a
spread of ~1e-5 around the mean; we write the mean itself, so a run does not depend on a random draw."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..config import ConfigError
from .tokenization import Tokenizer

__all__ = ["add_special_tokens", "check_new_tokens", "grow_vocab"]


def check_new_tokens(tokens: Sequence[str], *, key: str = "task.add_tokens") -> None:
    """Raise ConfigError for a token that is empty, only whitespace, or given twice (no tokenizer needed)."""
    seen = set()
    for t in tokens:
        if not isinstance(t, str) or not t.strip():
            raise ConfigError(f"{key}: {t!r} is not a token; expected non-empty strings such as '[DELIM]'")
        if t.startswith("['") and t.endswith("']"):  # OmegaConf read [[DELIM]] as a list in a list
            raise ConfigError(f"{key}: {t!r} was read as a list; quote bracketed tokens (task.add_tokens="
                              f"'[\"[DELIM]\"]') or give them as --add-tokens [DELIM]")
        if t != t.strip():
            raise ConfigError(f"{key}: {t!r} has spaces around it; write the token without them")
        if t in seen:
            raise ConfigError(f"{key}: {t!r} is given twice")
        seen.add(t)


def add_special_tokens(model: nn.Module, tok: Tokenizer, tokens: Sequence[str], *,
                       log=print) -> tuple[Tokenizer, list[int]]:
    """Add ``tokens`` to ``tok`` as special tokens and give each a row in ``model``'s token embedding and LM head.

    Args:
        model: a TransformerLM; its ``transformer.embed`` (vocab, E) and, when untied, ``head.weight`` (vocab, E)
            grow to the new vocabulary, ``config.vocab_size`` with them. A tied head keeps sharing the embedding.
        tok: the run's tokenizer (left unchanged: a new wrapper is returned).
        tokens: the new token strings; one already in the vocabulary is an error naming its id.

    Returns:
        (the tokenizer with the tokens, their ids in order).
    """
    import tokenizers

    check_new_tokens(tokens)
    for t in tokens:
        if (i := tok.token_to_id(t)) is not None:
            raise ConfigError(f"task.add_tokens: {t!r} is already in the tokenizer's vocabulary (id {i}); "
                              "leave it out, the model already has a row for it")
    tk = tokenizers.Tokenizer.from_str(tok.tk.to_str())  # a copy: the caller's tokenizer stays as it was
    tk.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in tokens])
    new = Tokenizer(tk, roles=tok.role_overrides or None)
    new.chat_template = tok.chat_template
    ids = [new.token_to_id(t) for t in tokens]
    _grow(model, ids, max(new.vocab_size, model.config.vocab_size))
    log(f"task.add_tokens: {len(ids)} special token{'s' if len(ids) != 1 else ''} "
        f"({', '.join(f'{t}={i}' for t, i in zip(tokens, ids))}); vocab_size {model.config.vocab_size}, the new rows "
        "the mean of the others")
    return new, ids


def grow_vocab(model: nn.Module, vocab_size: int) -> None:
    """Grow ``model``'s embedding and LM head to ``vocab_size`` rows, the new ones the mean of the others (a base
    model before an adapter that holds new tokens' rows is loaded into it: the adapter's rows replace them)."""
    n_old = model.config.vocab_size
    if vocab_size > n_old:
        _grow(model, list(range(n_old, vocab_size)), vocab_size)


@torch.no_grad()
def _mean_rows(weight: torch.Tensor, ids: list[int], n: int) -> torch.Tensor:
    """``weight`` (rows, ...) grown to ``n`` rows, each row of ``ids`` the mean of the rows not in ``ids``."""
    out = torch.zeros((n, *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
    out[: weight.shape[0]] = weight
    keep = torch.ones(weight.shape[0], dtype=torch.bool, device=weight.device)
    keep[[i for i in ids if i < weight.shape[0]]] = False  # a padded vocabulary's unused rows count as new
    out[ids] = weight[keep].float().mean(0).to(weight.dtype)
    return out


def _grow(model: nn.Module, ids: list[int], n: int) -> None:
    old = model.transformer.embed
    embed = nn.Embedding(n, old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype)
    embed.weight.data = _mean_rows(old.weight, ids, n)
    model.transformer.embed = embed
    head = model.head
    if head is not None and getattr(head, "weight", None) is old.weight:  # tied: the head reads the embedding
        head.weight = embed.weight
    elif head is not None and getattr(head, "weight", None) is not None and head.weight.shape[0] == old.num_embeddings:
        head.weight = nn.Parameter(_mean_rows(head.weight, ids, n))  # an untied LM head: its own mean
    if head is not None and getattr(head, "bias", None) is not None and head.bias.shape[0] == old.num_embeddings:
        bias = _mean_rows(head.bias, ids, n)  # transformers: the new logits' biases the mean of the old
        if isinstance(head.bias, nn.Parameter):
            head.bias = nn.Parameter(bias)
        else:
            head.bias = bias  # a buffer (BART's final_logits_bias)
    model.config = model.transformer.config = model.config.replace(vocab_size=n)
