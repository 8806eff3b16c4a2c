"""New tokens under PEFT (``task.add_tokens`` with ``--peft``): only their embedding rows train, held by a small
tensor per adapter (peft's ``trainable_token_indices``, its TrainableTokensLayer); the base table stays frozen, bit
for bit.

    train_new_tokens(model, "default", [700, 701, 702])   # after inject: the rows' (3, E) tensor trains
    new_token_indices(model, "default")                    # -> [700, 701, 702] (saved with the adapter)

``TokenRows`` wraps the token embedding (``base_layer``); a head tied to it reads the same rows (its class gains
:class:`_TiedRowsHead`, which reads ``weight`` through the wrapper). Merging copies the rows into the table, which a
merged model keeps. Adapter files: pretune's layout keeps ``transformer.embed.trainable_tokens_delta`` and the
indices in its meta; peft's layout ``<hf embedding>.token_adapter.trainable_tokens_delta`` and
``trainable_token_indices`` in adapter_config.json, as peft 0.17+ writes them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .core import PeftError, peft_state
from .layers import PeftState

PART = "trainable_tokens_delta"  # the parameter-name part (in layers.PEFT_PARTS), as peft names it

__all__ = ["TokenRows", "train_new_tokens", "new_token_indices", "merge_new_tokens", "strip_new_tokens", "PART"]


class TokenRows(nn.Module):
    """A token embedding whose rows ``token_indices[name]`` come from adapter ``name``'s (n, E) tensor."""

    def __init__(self, base_layer: nn.Embedding, state: PeftState):
        super().__init__()
        self.base_layer = base_layer
        self.trainable_tokens_delta = nn.ParameterDict()  # name -> (n, E) rows
        self.token_indices: dict[str, list[int]] = {}
        self.merged: list[str] = []
        self._replaced: dict[str, torch.Tensor] = {}  # name -> the base rows a merge overwrote (to unmerge)
        self.state = state

    @property
    def num_embeddings(self) -> int:
        return self.base_layer.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.base_layer.embedding_dim

    def _names(self) -> list[str]:
        """The adapters whose rows apply (active or routed), merged ones left out (their rows are in the table)."""
        names = [n for n, rows in self.state.routes() if n in self.token_indices and n not in self.merged]
        for n, rows in self.state.routes():
            if rows is not None and n in names and len(rows) != self.state.batch_rows:
                raise PeftError(f"adapter {n!r} trains new token rows every row of the batch shares: it cannot run "
                                "beside other adapters in one batch")
        return names

    @property
    def weight(self) -> torch.Tensor:
        """(vocab, E): the base table with the adapters' rows in place (a tied head reads this)."""
        w = self.base_layer.weight
        for n in self._names():
            idx = torch.tensor(self.token_indices[n], device=w.device)
            w = w.index_copy(0, idx, self.trainable_tokens_delta[n].to(w.dtype))
        return w

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, E): the base lookup, the new tokens' positions taken from their rows."""
        x = self.base_layer(input_ids)
        for n in self._names():
            idx = torch.tensor(self.token_indices[n], device=input_ids.device)
            slot = torch.full((self.num_embeddings,), -1, dtype=torch.long, device=input_ids.device)
            slot[idx] = torch.arange(len(idx), device=input_ids.device)
            pos = slot[input_ids]  # (B, T): the row of each token in the delta, -1 for the others
            rows = F.embedding(pos.clamp(min=0), self.trainable_tokens_delta[n]).to(x.dtype)
            x = torch.where((pos >= 0).unsqueeze(-1), rows, x)
        return x

    @torch.no_grad()
    def merge(self, name: str) -> None:
        if name in self.token_indices and name not in self.merged:
            idx = torch.tensor(self.token_indices[name], device=self.base_layer.weight.device)
            self._replaced[name] = self.base_layer.weight[idx].clone()
            self.base_layer.weight[idx] = self.trainable_tokens_delta[name].to(self.base_layer.weight.dtype)
            self.merged.append(name)

    @torch.no_grad()
    def unmerge(self, name: str) -> None:
        if name in self.merged:
            idx = torch.tensor(self.token_indices[name], device=self.base_layer.weight.device)
            self.base_layer.weight[idx] = self._replaced.pop(name)
            self.merged.remove(name)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: {len(i)} rows" for n, i in self.token_indices.items())


class _TiedRowsHead:
    """Mixed into a tied head's class: ``weight`` is the embedding's, new rows included (the Parameter stays in
    ``_parameters``, so the state dict and the tie are as before)."""

    @property
    def weight(self) -> torch.Tensor:
        return self._token_rows.weight


_HEAD_CLASSES: dict[type, type] = {}


def _tie_head(head: nn.Module, rows: TokenRows) -> None:
    cls = type(head)
    if not issubclass(cls, _TiedRowsHead):
        if cls not in _HEAD_CLASSES:
            _HEAD_CLASSES[cls] = type(cls.__name__, (_TiedRowsHead, cls), {"__module__": cls.__module__})
        head.__class__ = _HEAD_CLASSES[cls]
    object.__setattr__(head, "_token_rows", rows)  # not a submodule: the embedding owns it


def _wrapped(model) -> TokenRows:
    embed = model.transformer.embed
    if isinstance(embed, TokenRows):
        return embed
    rows = TokenRows(embed, peft_state(model))
    model.transformer.embed = rows
    head = getattr(model, "head", None)
    base_head = getattr(head, "base", head)  # a RoutedHead's own head
    for h in (head, base_head):
        if h is not None and h._parameters.get("weight") is embed.weight:
            _tie_head(h, rows)
    return rows


def train_new_tokens(model, name: str, indices: Sequence[int], *, train: bool = True) -> int:
    """Adapter ``name`` holds (and, with ``train``, trains) the embedding rows ``indices``, starting from their
    current values; the base table stays frozen. A head tied to the embedding reads the same rows. Returns the
    number of trainable values."""
    indices = [int(i) for i in indices]
    embed = model.transformer.embed
    table = embed.base_layer if isinstance(embed, TokenRows) else embed
    bad = [i for i in indices if not 0 <= i < table.num_embeddings]
    if bad:
        raise PeftError(f"token indices {bad} are outside the embedding's {table.num_embeddings} rows")
    if len(set(indices)) != len(indices):
        raise PeftError(f"token indices {indices} name a row twice")
    head = getattr(model, "head", None)
    w = head._parameters.get("weight") if head is not None else None
    if w is not None and w is not table.weight and w.shape[0] == table.num_embeddings:
        raise PeftError("new tokens under PEFT need the LM head tied to the token embedding (tie_embeddings); with "
                        "an untied head their output rows would stay frozen: finetune fully instead")
    rows = _wrapped(model)
    with torch.no_grad():
        start = rows.base_layer.weight[torch.tensor(indices)].detach().clone().float()
    rows.trainable_tokens_delta[name] = nn.Parameter(start, requires_grad=train)
    rows.token_indices[name] = indices
    return start.numel()


def new_token_indices(model, name: str) -> list[int]:
    """The embedding rows adapter ``name`` holds ([] when none)."""
    embed = model.transformer.embed
    return list(embed.token_indices.get(name, [])) if isinstance(embed, TokenRows) else []


def merge_new_tokens(model, name: str) -> None:
    """Copy adapter ``name``'s rows into the embedding table (merged models keep them)."""
    embed = model.transformer.embed
    if isinstance(embed, TokenRows):
        embed.merge(name)


def strip_new_tokens(model) -> None:
    """Put the plain embedding back (nothing merged) and the tied head's own class."""
    embed = model.transformer.embed
    if not isinstance(embed, TokenRows):
        return
    model.transformer.embed = embed.base_layer
    for h in (getattr(model, "head", None), getattr(getattr(model, "head", None), "base", None)):
        if isinstance(h, _TiedRowsHead):
            h.__class__ = type(h).__mro__[2]  # (mixed class, _TiedRowsHead, the head's own class, ...)
            object.__delattr__(h, "_token_rows")


# -- peft's layout ------------------------------------------------------------------------------
PEFT_SUFFIX = ".token_adapter.trainable_tokens_delta"  # peft's key: <hf embedding>.token_adapter.<part>


def hf_embedding_module(model) -> str:
    """The Hugging Face module name of the token embedding (``transformer.wte``, ``model.embed_tokens``), found by
    exporting a marker through the family's weight table."""
    from ..interop import _family_for_config
    from .core import base_state

    fam = _family_for_config(model.config)
    state = base_state(model)
    marks = {k: (torch.ones if k == "transformer.embed.weight" else torch.zeros)((), dtype=torch.float64)
             .expand(v.shape) for k, v in state.items()}
    hit = [k for k, t in fam.weights_to_hf(marks, model.config).items()
           if k.endswith(".weight") and float(t.max()) > 0 and not k.startswith(("lm_head.", "cls."))]
    if not hit:
        raise PeftError("no Hugging Face name for the token embedding in this model's family")
    return min(hit, key=len)[: -len(".weight")]


def peft_tensors(model, name: str, prefix: str) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Adapter ``name``'s rows as peft saves them ({prefix + hf embedding + PEFT_SUFFIX: (n, E)}) and their
    indices (adapter_config.json's ``trainable_token_indices``); ({}, []) when it holds none."""
    indices = new_token_indices(model, name)
    if not indices:
        return {}, []
    delta = model.transformer.embed.trainable_tokens_delta[name].detach()
    return {f"{prefix}{hf_embedding_module(model)}{PEFT_SUFFIX}": delta}, indices


def load_peft_tensors(model, name: str, tensors: dict[str, torch.Tensor], indices, path) -> None:
    """Put a peft adapter's trainable-token rows into ``model`` (its ``trainable_token_indices``: a list for the
    input embedding, or {module: list}); the embedding grows first when the rows lie past its end."""
    from ..io.new_tokens import grow_vocab

    if isinstance(indices, dict):
        if len(indices) != 1:
            raise PeftError(f"{path}: trainable_token_indices for several modules ({sorted(indices)}); pretune reads "
                            "those of the token embedding")
        indices = next(iter(indices.values()))
    deltas = [t for k, t in tensors.items() if k.endswith(PEFT_SUFFIX) or k.endswith(PEFT_SUFFIX + f".{name}")]
    if len(deltas) != 1 or deltas[0].shape[0] != len(indices):
        raise PeftError(f"{path}: trainable_token_indices names {len(indices)} rows but the file holds "
                        f"{[tuple(t.shape) for t in deltas]} under *{PEFT_SUFFIX}")
    grow_vocab(model, max(indices) + 1)
    train_new_tokens(model, name, indices, train=False)
    with torch.no_grad():
        model.transformer.embed.trainable_tokens_delta[name].copy_(deltas[0])
