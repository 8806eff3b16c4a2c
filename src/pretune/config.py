"""Model configuration: one typed dataclass, validated, serialisable to JSON.

No torch import here: configs are read by the CLI (``pretune show``) before any model exists.
Every choice is a ``Literal``; the model code turns each one into a single dict lookup
(``NORMS[cfg.norm]``, ``FFNS[cfg.ffn]``, ``POSITIONS[cfg.position]``).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

Arch = Literal["encoder", "decoder", "encoder-decoder"]
DecoderLayout = Literal["causal", "prefix_lm"]
Norm = Literal["layernorm", "rmsnorm", "rmsnorm_plus_one"]
NormPlacement = Literal["pre", "post", "sandwich"]
Position = Literal["none", "sinusoidal", "learned", "relative", "alibi", "rope", "disentangled"]
RopeScaling = Literal["none", "llama3"]
Ffn = Literal[
    "relu", "gelu", "gelu_tanh", "swish",  # original FFN: act(x W1 + b1) W2 + b2
    "glu", "bilinear", "reglu", "geglu", "geglu_tanh", "swiglu",  # gated: (act(xW) * xV) W2
]
Head = Literal["none", "lm", "mlm", "rtd", "classification", "regression", "tagging", "qa"]
TASK_HEADS = ("classification", "regression", "tagging", "qa")  # finetuning heads (model/heads.py)
Pooling = Literal["pooler", "cls", "mean", "last", "eos"]
TaskStack = Literal["encoder", "decoder"]
HeadAct = Literal["relu", "gelu", "gelu_tanh", "swish"]
ClsAct = Literal["tanh", "relu", "gelu", "gelu_tanh", "swish"]


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names it and what was expected."""


class StepError(ValueError):
    """Input a training step cannot use, met in the middle of a run (a reward function that raises or returns a
    non-number on a record): the trainer keeps the steps done in a checkpoint, then stops with this message."""


@dataclass
class ModelConfig:
    """Every architectural choice of a pretune transformer. Presets live in ``presets.py``."""

    # --- family -------------------------------------------------------------------------------
    arch: Arch = "encoder"  # encoder: BERT (bidirectional); decoder: GPT (causal); encoder-decoder: T5/BART
    vocab_size: int = 30522  # rows of the token embedding
    dim: int = 768  # model (residual stream) width
    n_layers: int = 12  # blocks in the encoder, or in the decoder of a decoder-only model
    n_decoder_layers: int | None = None  # encoder-decoder only: decoder blocks (None: same as n_layers)
    n_heads: int = 12  # attention heads (query heads under GQA)
    n_kv_heads: int | None = None  # key/value heads; < n_heads is grouped-query attention (None: n_heads)
    head_dim: int | None = None  # per-head width (None: dim // n_heads); T5 may set it independently
    decoder_heads: int | None = None  # encoder-decoder only: the decoder's attention heads, self and cross (None:
    # n_heads); BART may give its stacks different counts (the decoder's head_dim is then dim // decoder_heads)
    ffn_dim: int = 3072  # inner width of the feed-forward block
    decoder_ffn_dim: int | None = None  # encoder-decoder only: the decoder's FFN inner width (None: ffn_dim; BART)
    max_seq_len: int = 512  # longest sequence; bounds learned/sinusoidal position tables

    decoder_layout: DecoderLayout = "causal"  # decoder-only: how a source and its target share one sequence, as
    # the model was pretrained: causal (`source target`, GPT-2, Llama, imported LLMs) or prefix_lm (`source EOS
    # target`, bidirectional over the source, T5's decoder-only variants); see model/layout.py

    # --- block --------------------------------------------------------------------------------
    ffn: Ffn = "gelu"  # FFN variant; gated ones (glu, swiglu, ...) have two input projections
    norm: Norm = "layernorm"  # layernorm (BERT, GPT-2); rmsnorm (T5, Llama): no mean, no bias; rmsnorm_plus_one:
    # x / rms(x) * (1 + g), the weight stored as an offset from 1 and starting at 0 (Gemma)
    norm_eps: float = 1e-12  # epsilon inside the norm
    norm_placement: NormPlacement = "post"  # post: norm(x + f(x)) (BERT); pre: x + f(norm(x)) (GPT-2, T5, Llama);
    # sandwich: x + norm'(f(norm(x))), a second norm on each branch's output (Gemma 2; Ding et al. 2021, CogView)
    bias: bool = True  # biases in attention/FFN linears (BERT, GPT-2); False for T5, Llama
    qkv_bias: bool = False  # biases on the q/k/v projections even when bias=False (Qwen2: o_proj and FFN have none)
    qk_norm: bool = False  # norm (cfg.norm) on each head's queries and keys, over head_dim, before RoPE (Qwen3)
    norm_bias: bool = True  # LayerNorm has a bias (ignored for rmsnorm, which never has one)
    attn_scale: float | None = None  # None: 1/sqrt(head_dim); T5 folds the scale into its init and uses 1.0;
    # Gemma 2: query_pre_attn_scalar ** -0.5
    attn_softcap: float | None = None  # attention scores squashed to c * tanh(s / c) before the mask (Gemma 2: 50);
    # None: off. SDPA cannot do it: attention then runs the eager path (slower, more memory)
    sliding_window: int | None = None  # local attention: a query sees only keys fewer than this many positions away
    # (causal: t-w+1..t; bidirectional: |i-j| < w, so ModernBERT's local_attention=128 is 65); None: every key
    sliding_layers: list[int] | None = None  # the layers (0-based, in each stack) that use sliding_window; None:
    # every layer (Mistral); Gemma 2 alternates: [0, 2, 4, ...]
    embed_norm: bool = True  # norm after the embedding sum (BERT); pre-norm models use a final norm instead
    first_attn_norm: bool = True  # pre-norm: layer 0 normalises its attention input; False: layer 0 reads the
    # embedding norm's output as it is, with no norm of its own (ModernBERT)
    scale_embeddings: bool = False  # token embeddings times sqrt(dim), in their dtype (Gemma; Vaswani et al. 2017 §3.4)
    dropout: float = 0.1  # dropout on embeddings, attention output and FFN output
    attn_dropout: float = 0.1  # dropout on attention probabilities

    # --- positions ----------------------------------------------------------------------------
    position: Position = "learned"  # how order enters the model (see model/position.py)
    position_offset: int = 0  # learned: first position id (RoBERTa starts at padding_idx + 1 = 2)
    rope_base: float = 10000.0  # RoPE: theta_j = base^(-2(j-1)/d)
    rope_scaling: RopeScaling = "none"  # RoPE frequency scaling for long contexts; llama3: Llama 3.1+ (below)
    rope_factor: float = 8.0  # llama3: low frequencies (long wavelengths) are divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths > rope_original_max_seq_len / this: divided by rope_factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths < rope_original_max_seq_len / this: kept; smooth between
    rope_original_max_seq_len: int = 8192  # llama3: the context length the model was pretrained with before scaling
    rope_local_base: float | None = None  # RoPE base of the sliding-window layers (ModernBERT: 10000 beside a global
    # 160000); None: rope_base on every layer
    relative_buckets: int = 32  # T5 relative bias: number of buckets
    relative_max_distance: int = 128  # T5 relative bias: distances beyond this share the last bucket
    position_buckets: int = 256  # disentangled (DeBERTa): relative distances exact below position_buckets / 2, then
    # log buckets up to max_relative_positions (DeBERTa-v3: 256); 0: no buckets, clipped at max_relative_positions
    max_relative_positions: int = 512  # disentangled: the distance the last bucket reaches (DeBERTa: the
    # max_position_embeddings); farther keys share it

    # --- embeddings and heads -----------------------------------------------------------------
    token_types: int = 2  # segment (token-type) embeddings, 0 for none (BERT uses 2)
    embed_dim: int | None = None  # ALBERT factorised embeddings: vocab x embed_dim then embed_dim x dim
    tie_embeddings: bool = True  # output projection shares the token embedding matrix
    tied_logit_scale: bool = False  # T5 v1.0: scale hidden states by dim**-0.5 before a tied LM head
    logit_softcap: float | None = None  # LM logits squashed to c * tanh(z / c) (Gemma 2: 30); None: off; task heads
    # ignore it
    logit_bias: bool = False  # a fixed bias added to the LM logits: a buffer, saved and exported but never trained
    # (BART's final_logits_bias); task heads ignore it
    share_layers: bool = False  # ALBERT cross-layer sharing: one block's weights used n_layers times
    share_encoder_decoder: bool = False  # T5 "enc-dec, shared": decoder reuses encoder attention/FFN weights
    head: Head = "mlm"  # mlm: BERT transform + tied decoder with bias; lm: plain linear; none: body only;
    # rtd: ELECTRA's replaced-token detection (dense + head_act + one logit per token);
    # classification / regression / tagging / qa: finetuning heads (see model/heads.py)
    head_act: HeadAct = "gelu"  # activation inside the MLM head transform (and the task-head transform)
    head_dense_bias: bool = True  # bias on the dense layer of the MLM head / task-head transform (ModernBERT: False)
    head_transform: bool = False  # task heads put dense + head_act + norm before their output layer, on the pooled
    # vector or on each token (ModernBERT's prediction head); False: BERT's heads
    pooler: bool = False  # BERT pooler (dense + tanh on [CLS]), kept when importing checkpoints that have one
    pair_head: bool = False  # a 2-way classifier on the pooler output beside the MLM head: BERT's next-sentence /
    # ALBERT's sentence-order prediction, kept so a pretrained model exports whole (AlbertForPreTraining)
    pad_token_id: int = 0  # padding token (used by importers and by decoder start for encoder-decoders)
    decoder_start_token_id: int = 0  # first decoder input of an encoder-decoder (T5: the pad token)
    eos_token_id: int | None = None  # end of sequence: generation ends a row there (None: the tokenizer's)
    forced_bos_token_id: int | None = None  # generation: the first token after a one-token decoder start is always
    # this one (bart-large, mBART: the language id or <s>); None: off
    forced_eos_token_id: int | None = None  # generation: the token that reaches max_new_tokens is always this one
    # (BART: </s>, so a cut-off summary still ends); None: off

    # --- finetuning heads (head in TASK_HEADS) ------------------------------------------------
    num_labels: int = 0  # outputs of a classification/tagging head (regression: 1; qa: 2, start and end)
    labels: list[str] | None = None  # label names, index = class id (the label map saved with the model)
    pooling: Pooling | None = None  # sentence vector for classification/regression; None: by family
    # (pooler: BERT pooler; cls: first token + dense/tanh (RoBERTa); mean: masked mean; last: last real token (GPT);
    # eos: the last eos_token_id of each row + dense/tanh (BART))
    task_stack: TaskStack = "encoder"  # encoder-decoder task heads read the encoder, or the decoder fed the input
    # shifted right after decoder_start_token_id (BART's *ForSequenceClassification / *ForQuestionAnswering; its
    # sentence pooling defaults to eos)
    cls_act: ClsAct = "tanh"  # activation after pooling='cls''s dense layer: tanh (RoBERTa), gelu (ELECTRA's
    # classification head; recorded on ELECTRA bodies, so a classifier added later is ELECTRA's)
    classifier_dropout: float | None = None  # dropout before the task head (None: dropout)
    multi_label: bool = False  # classification: several labels per input, one sigmoid each (binary cross-entropy);
    # exported as transformers' problem_type="multi_label_classification"

    # ------------------------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dh(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers or self.n_layers

    @property
    def decoder_config(self) -> "ModelConfig":
        """What an encoder-decoder's decoder stack is built from: this config with n_heads and ffn_dim taken from
        decoder_heads and decoder_ffn_dim (the config itself when both are None)."""
        if self.decoder_heads is None and self.decoder_ffn_dim is None:
            return self
        return dataclasses.replace(self, n_heads=self.decoder_heads or self.n_heads, decoder_heads=None,
                                   ffn_dim=self.decoder_ffn_dim or self.ffn_dim, decoder_ffn_dim=None)

    @property
    def embedding_dim(self) -> int:
        return self.embed_dim or self.dim

    @property
    def sentence_pooling(self) -> str:
        """How a classification/regression head makes one vector per sequence (``pooling`` or the family default)."""
        if self.pooling is not None:
            return self.pooling
        if self.arch == "decoder":
            return "last"
        if self.arch == "encoder-decoder":
            return "eos" if self.task_stack == "decoder" else "mean"
        return "pooler" if self.pooler else "cls"

    @property
    def family(self) -> str:
        """The family in words: encoder-only, decoder-only or encoder-decoder."""
        return {"encoder": "encoder-only", "decoder": "decoder-only", "encoder-decoder": "encoder-decoder"}[self.arch]

    @property
    def layers_text(self) -> str:
        """The depth in words: "12", or "6 enc + 6 dec" for an encoder-decoder."""
        if self.arch == "encoder-decoder":
            return f"{self.n_layers} enc + {self.decoder_layers} dec"
        return f"{self.n_layers}"

    @property
    def max_positions(self) -> int:
        """Tokens a sequence may have: max_seq_len less the rows a learned table starts after (RoBERTa, BART: 2)."""
        return self.max_seq_len - (self.position_offset if self.position == "learned" else 0)

    @property
    def final_norm(self) -> bool:
        """Pre-norm stacks end with a norm (GPT-2 ln_f, T5 final_layer_norm); post-norm ones do not."""
        return self.norm_placement in ("pre", "sandwich")

    @property
    def gated_ffn(self) -> bool:
        return self.ffn in ("glu", "bilinear", "reglu", "geglu", "geglu_tanh", "swiglu")

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every Literal field and every cross-field constraint; raise ConfigError."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        positive = ["vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must divide dim ({self.dim}) unless head_dim is set")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"n_kv_heads ({self.kv_heads}) must divide n_heads ({self.n_heads})")
        if self.position == "rope" and self.dh % 2:
            raise ConfigError(f"rope needs an even head_dim, got {self.dh}")
        if self.rope_scaling != "none":
            if self.position != "rope":
                raise ConfigError(f"rope_scaling={self.rope_scaling!r} applies to position='rope' only, got "
                                  f"position={self.position!r}")
            if self.rope_factor < 1.0:
                raise ConfigError(f"rope_factor must be >= 1, got {self.rope_factor}")
            if not 0.0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ConfigError(f"llama3 RoPE scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
                                  f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}")
            if self.rope_original_max_seq_len <= 0:
                raise ConfigError(f"rope_original_max_seq_len must be > 0, got {self.rope_original_max_seq_len}")
        for name in ("attn_softcap", "logit_softcap"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 (or None: off), got {getattr(self, name)}")
        self._check_sliding_window()
        if self.position == "disentangled":
            self._check_disentangled()
        if self.rope_local_base is not None:
            if self.position != "rope" or self.sliding_window is None:
                raise ConfigError(f"rope_local_base applies to position='rope' with a sliding_window, got "
                                  f"position={self.position!r}, sliding_window={self.sliding_window!r}")
            if self.rope_local_base <= 0:
                raise ConfigError(f"rope_local_base must be > 0 (or None: rope_base), got {self.rope_local_base}")
        if not self.first_attn_norm:
            if self.norm_placement != "pre":
                raise ConfigError(f"first_attn_norm=False applies to norm_placement='pre' only, got "
                                  f"norm_placement={self.norm_placement!r}")
            if self.share_layers:
                raise ConfigError("first_attn_norm=False cannot be combined with share_layers (one block serves "
                                  "every layer)")
        if self.position == "sinusoidal" and self.embedding_dim % 2:
            raise ConfigError(f"sinusoidal positions need an even embedding width, got {self.embedding_dim}")
        for name in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.arch != "encoder-decoder":
            for name in ("n_decoder_layers", "decoder_heads", "decoder_ffn_dim", "share_encoder_decoder"):
                if getattr(self, name):
                    raise ConfigError(f"{name} applies to arch='encoder-decoder' only, got arch={self.arch!r}")
        if self.decoder_layout != "causal" and self.arch != "decoder":
            raise ConfigError(f"decoder_layout={self.decoder_layout!r} applies to arch='decoder' only, got "
                              f"arch={self.arch!r}")
        if self.position_offset and self.position != "learned":
            raise ConfigError(f"position_offset applies to position='learned' only, got position={self.position!r}")
        if self.head == "mlm" and self.arch != "encoder":
            raise ConfigError(f"head='mlm' needs arch='encoder' (got {self.arch!r}); use head='lm'")
        if self.head == "rtd" and self.arch != "encoder":
            raise ConfigError(f"head='rtd' (replaced-token detection) needs arch='encoder', got {self.arch!r}")
        if self.head in TASK_HEADS:
            want = {"regression": 1, "qa": 2}.get(self.head)
            if want is not None and self.num_labels != want:
                raise ConfigError(f"head={self.head!r} needs num_labels={want}, got {self.num_labels}")
            if self.num_labels < 1:
                raise ConfigError(f"head={self.head!r} needs num_labels >= 1, got {self.num_labels}")
            if self.labels is not None:
                if not isinstance(self.labels, (list, tuple)) or not all(isinstance(x, str) for x in self.labels):
                    raise ConfigError(f"labels must be a list of strings, got {self.labels!r}")
                if len(self.labels) != self.num_labels or len(set(self.labels)) != len(self.labels):
                    raise ConfigError(f"labels must be {self.num_labels} distinct names (num_labels), "
                                      f"got {self.labels!r}")
                self.labels = list(self.labels)
            if self.pooling == "pooler" and not self.pooler:
                raise ConfigError("pooling='pooler' needs a model with a BERT pooler (pooler=True); "
                                  "use 'cls' or 'mean'")
            if self.pooling == "last" and self.arch != "decoder":
                raise ConfigError(f"pooling='last' is for decoder-only models (got arch={self.arch!r})")
            if self.head in ("classification", "regression") and self.sentence_pooling == "eos" and (
                    self.eos_token_id is None):
                raise ConfigError("pooling='eos' (the default of task_stack='decoder') needs eos_token_id: the "
                                  "state at each row's last EOS is classified")
        if self.task_stack != "encoder" and self.arch != "encoder-decoder":
            raise ConfigError(f"task_stack={self.task_stack!r} applies to arch='encoder-decoder' only, got "
                              f"arch={self.arch!r}")
        for name in ("forced_bos_token_id", "forced_eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}={value} is not a token id (0 <= id < vocab_size={self.vocab_size})")
        if self.pair_head and (self.head != "mlm" or not self.pooler):
            raise ConfigError(f"pair_head (NSP/SOP) classifies the pooler output beside the MLM head: it needs "
                              f"head='mlm' and pooler=True, got head={self.head!r}, pooler={self.pooler}")
        if self.multi_label and self.head != "classification":
            raise ConfigError(f"multi_label applies to head='classification' only, got head={self.head!r}")
        if self.classifier_dropout is not None and not 0.0 <= self.classifier_dropout < 1.0:
            raise ConfigError(f"classifier_dropout must be in [0, 1), got {self.classifier_dropout}")
        if self.share_encoder_decoder and self.n_decoder_layers not in (None, self.n_layers):
            raise ConfigError("share_encoder_decoder needs n_decoder_layers equal to n_layers")
        self._check_decoder_widths()

    def _check_decoder_widths(self) -> None:
        """decoder_heads / decoder_ffn_dim: positive, and a decoder the encoder's checks would accept."""
        if self.decoder_heads is None and self.decoder_ffn_dim is None:
            return
        for name in ("decoder_heads", "decoder_ffn_dim"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 (or None: the encoder's), got {getattr(self, name)}")
        heads = self.decoder_heads
        if heads is not None:
            if self.head_dim is None and self.dim % heads:
                raise ConfigError(f"decoder_heads ({heads}) must divide dim ({self.dim}) unless head_dim is set")
            if self.n_kv_heads is not None and heads % self.n_kv_heads:
                raise ConfigError(f"n_kv_heads ({self.n_kv_heads}) must divide decoder_heads ({heads}): the decoder "
                                  "shares the encoder's key/value heads")
        if self.share_encoder_decoder and (heads not in (None, self.n_heads)
                                           or self.decoder_ffn_dim not in (None, self.ffn_dim)):
            raise ConfigError(f"share_encoder_decoder needs the decoder's heads and FFN width equal to the encoder's, "
                              f"got decoder_heads={heads}, decoder_ffn_dim={self.decoder_ffn_dim} (n_heads="
                              f"{self.n_heads}, ffn_dim={self.ffn_dim})")
        try:
            self.decoder_config  # noqa: B018 - every other check, on the decoder's view (rope's even head_dim, ...)
        except ConfigError as e:
            raise ConfigError(f"the decoder (decoder_heads={heads}, decoder_ffn_dim={self.decoder_ffn_dim}): "
                              f"{e}") from None

    def _check_disentangled(self) -> None:
        if self.kv_heads != self.n_heads or self.qk_norm:
            raise ConfigError("position='disentangled' needs plain multi-head attention (n_kv_heads = n_heads, no "
                              f"qk_norm), got n_kv_heads={self.kv_heads}, qk_norm={self.qk_norm}")
        if self.position_buckets < 0 or self.position_buckets == 1:
            raise ConfigError(f"position_buckets must be >= 2 (or 0: no buckets), got {self.position_buckets}")
        least = self.position_buckets // 2 + 2 if self.position_buckets else 1  # log((max - 1) / mid) > 0
        if self.max_relative_positions < least:
            raise ConfigError(f"max_relative_positions must be >= {least} (position_buckets // 2 + 2, or 1 without "
                              f"buckets), got {self.max_relative_positions}")

    def _check_sliding_window(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1 (or None: full attention), got {self.sliding_window}")
        if self.sliding_layers is None:
            return
        if self.sliding_window is None:
            raise ConfigError(f"sliding_layers={self.sliding_layers!r} needs sliding_window")
        n = max(self.n_layers, self.decoder_layers)
        if (not isinstance(self.sliding_layers, (list, tuple))
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in self.sliding_layers)
                or len(set(self.sliding_layers)) != len(self.sliding_layers)
                or not all(0 <= i < n for i in self.sliding_layers)):
            raise ConfigError(f"sliding_layers must be distinct layer indices in 0..{n - 1}, got "
                              f"{self.sliding_layers!r}")
        self.sliding_layers = sorted(self.sliding_layers)

    # ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> "ModelConfig":
        """Build a config from a mapping; unknown keys raise ConfigError naming the nearest valid key."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of config keys, got {type(data).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in valid:
                raise ConfigError(f"{source}: unknown config key {key!r}{_did_you_mean(key, valid)}")
        try:
            return cls(**data)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def replace(self, **overrides: Any) -> "ModelConfig":
        """A copy with some fields changed (validated, unknown keys rejected)."""
        merged = self.to_dict()
        merged.update(overrides)
        return type(self).from_dict(merged, source="overrides")

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump({"pretune_version": 1, **self.to_dict()}, f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ModelConfig":
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
        if isinstance(data, dict):
            data.pop("pretune_version", None)
        return cls.from_dict(data, source=str(path))


def _strict_init(init):
    """Wrap the dataclass __init__ so ``ModelConfig(n_layer=2)`` names the nearest valid key
    instead of raising a bare TypeError."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        valid = [f.name for f in dataclasses.fields(type(self))]
        for key in kwargs:
            if key not in valid:
                raise ConfigError(f"unknown config key {key!r}{_did_you_mean(key, valid)}")
        init(self, *args, **kwargs)

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)
    return __init__


ModelConfig.__init__ = _strict_init(ModelConfig.__init__)


def _did_you_mean(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"


def _check_type(name: str, value: Any, hint: Any) -> None:
    """Validate one field against its annotation (Literal, int, float, bool, Optional)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.4)
            hint_txt = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{name}={value!r} is not one of {list(args)}{hint_txt}")
        return
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        inner = [a for a in args if a is not type(None)]
        return _check_type(name, value, inner[0])
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = True
    if not ok:
        raise ConfigError(f"{name}={value!r} should be of type {hint.__name__}")
