"""Prefix tuning (Li & Liang 2021): trainable key/value prefixes at every self-attention layer, visible to every
query (``Attention.extra_kv``); directly trained, or produced by an MLP from P embeddings (``prefix_projection``,
the paper's reparametrisation for stable training)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import PeftConfig
from ..core import PeftError, module_dict, self_attentions
from ..layers import PREFIX_DICT, PrefixEncoder, PrefixSite

NAME = "prefix"
PARTS = (PREFIX_DICT,)
MERGEABLE = False  # adds key/value columns
DEFAULT_LR = 1e-2  # when train.lr is not set (prefixes learn slowly from a small init; P-tuning v2: 5e-3..1e-2)


@dataclass
class Settings(PeftConfig):
    """Prefix tuning's settings (peft.*)."""

    n_virtual: int = 20  # virtual tokens: key/value prefix positions at every self-attention layer
    prefix_projection: int = 0  # hidden width of the reparametrisation MLP (0: train the prefixes directly)


def validate(cfg) -> None:
    if cfg.n_virtual < 1:
        raise PeftError(f"peft.n_virtual={cfg.n_virtual}: prefix tuning needs >= 1 virtual token")
    if cfg.prefix_projection < 0:
        raise PeftError(f"peft.prefix_projection={cfg.prefix_projection}: must be >= 0")


def inject(model, cfg, name: str, ctx) -> None:
    attns = self_attentions(model)
    widths = sorted({a.n_kv_heads * a.dh for a in attns})
    if len(widths) > 1:  # an encoder-decoder whose decoder_heads differ, with head_dim or n_kv_heads set
        raise PeftError(f"prefix tuning needs one key/value width in every self-attention layer, got {widths} "
                        "(the decoder's heads differ from the encoder's)")
    encoders = module_dict(model, PREFIX_DICT)
    for i, attn in enumerate(attns):
        if attn.extra_kv is None:
            attn.extra_kv = PrefixSite(ctx.state, encoders, i, attn.n_kv_heads, attn.dh)
    encoders[name] = PrefixEncoder(len(attns), cfg.n_virtual, attns[0].n_kv_heads * attns[0].dh, model.config.dim,
                                   cfg.prefix_projection)


def strip(model) -> None:
    for attn in self_attentions(model):
        if isinstance(attn.extra_kv, PrefixSite):
            attn.extra_kv = None
    if getattr(model, PREFIX_DICT, None) is not None:
        delattr(model, PREFIX_DICT)
