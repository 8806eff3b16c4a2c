"""Text-to-text objectives: T5's span corruption and its variants, BART denoising, prefix LM.

Each turns a block into a (source, target) pair, which the model's layout (model/layout.py) packs: an
encoder-decoder reads ``source + EOS`` and predicts ``target + EOS`` (decoder input = start token + target); a
decoder-only model reads ``source EOS target EOS`` as one sequence with a prefix-LM mask (bidirectional over the
source, as in T5's decoder-only variants, Raffel et al. 2019 §3.2.1) and is trained on the target part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ConfigError
from ..model.layout import layout_of
from . import bart, t5
from .base import IGNORE, Objective, Settings, _in_unit
from .lm import lm_loss_sum


@dataclass
class NoiseSettings(Settings):
    """T5's i.i.d. corruptions (bert_style, iid_mask, iid_spans, drop_tokens): how many tokens are noised."""

    rate: float = 0.15  # share of tokens corrupted (T5: 15%)
    dynamic: bool = True  # new corruption every time a block is seen vs the same one every epoch (static)

    def validate(self):
        _in_unit(self, "rate", low_open=True)


@dataclass
class SpanSettings(NoiseSettings):
    """T5 span corruption."""

    mean_span: float = 3.0  # mean length of a corrupted span (T5: 3)

    def validate(self):
        super().validate()
        if self.mean_span < 1:
            raise ConfigError(f"objective.mean_span={self.mean_span} must be >= 1")


@dataclass
class ShuffleSettings(Settings):
    """T5 deshuffling: no knob but the shuffle itself."""

    dynamic: bool = True  # a new order every time a block is seen vs the same one every epoch (static)


@dataclass
class DenoiseSettings(Settings):
    """BART denoising: which noising functions, how much."""

    infill_ratio: float = 0.3  # text infilling: share of tokens covered by Poisson spans (one mask each)
    poisson_lambda: float = 3.0  # text infilling: mean span length
    mask_ratio: float = 0.0  # token masking: share of tokens replaced by the mask
    delete_ratio: float = 0.0  # token deletion: share of tokens removed
    permute_sentences: bool = True  # sentence permutation
    rotate: bool = False  # document rotation (to a random word start)
    dynamic: bool = True  # new noise every time a block is seen vs the same one every epoch (static)

    def validate(self):
        _in_unit(self, "infill_ratio", "mask_ratio", "delete_ratio")
        if self.poisson_lambda <= 0:
            raise ConfigError(f"objective.poisson_lambda={self.poisson_lambda} must be > 0")


@dataclass
class PrefixSettings(Settings):
    """Prefix LM: where each block is split into prefix and continuation."""

    prefix_split: float = 0.0  # split point as a fraction of the block; 0: uniform at random
    dynamic: bool = True  # a new split point every time a block is seen vs the same one every epoch (static)

    def validate(self):
        _in_unit(self, "prefix_split")


class Seq2Seq(Objective):
    """Base: ``corrupt(tokens, rng, block) -> (source, target)``; subclasses define the corruption. The model's
    layout (model/layout.py) packs the pair: an encoder-decoder splits it over its two stacks, a decoder-only model
    reads it as one prefix-LM sequence (and its checkpoint records ``decoder_layout=prefix_lm``)."""

    archs = ("encoder-decoder", "decoder")
    head = "lm"
    why = "it maps a corrupted input to a target text, which needs a decoder;"
    continuation = False  # the target continues the source's text (prefix LM): no separator, no final EOS

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        self.eos = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.sep_id
        if self.eos is None:
            raise ConfigError(f"objective {self.name!r} needs an EOS (or SEP) token; the tokenizer has neither")
        self.start = model_cfg.decoder_start_token_id
        self.layout = layout_of(model_cfg, "prefix_lm")  # decoders: T5's prefix LM (Raffel et al. 2019 §3.2.1)

    def records(self) -> dict:
        return {"decoder_layout": "prefix_lm"} if not self.layout.encoder_decoder else {}

    def n_special_tokens(self) -> int:
        return 1

    def block_size(self, max_seq_len: int) -> int:
        if self.layout.encoder_decoder:
            return max_seq_len - 1
        return (max_seq_len - 2) // 2  # source and target share one sequence

    def doc_separator(self):
        return self.eos

    def corrupt(self, tokens: np.ndarray, rng: np.random.Generator, block) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def example(self, block, rng, random_block):
        src, tgt = self.corrupt(block.tokens.astype(np.int64), rng, block)
        return self.layout.example(src.astype(np.int64), tgt.astype(np.int64), eos=self.eos, start=self.start,
                                   continuation=self.continuation)

    def counts(self, batch):
        return {"lm": self.layout.count_targets(batch)}

    def loss(self, model, batch, totals):
        h, targets = self.layout.lm_inputs(model, batch)
        n = int((targets != IGNORE).sum())
        s, correct = lm_loss_sum(model, h, targets, n)
        stats = {"lm_loss": float(s.detach())}
        if correct is not None:
            stats["lm_correct"] = float(correct)
        return s / totals["lm"], stats


def _sentinels(tok, name: str) -> list[int]:
    if not tok.sentinel_ids:
        raise ConfigError(f"objective {name!r} needs T5 sentinel tokens <extra_id_0>, <extra_id_1>, ... but the "
                          f"tokenizer has none; train one with `pretune tokenizer train --kind unigram` (T5 specials) "
                          f"or pass --sentinels 100")
    return list(tok.sentinel_ids)


def _mask_id(tok, name: str) -> int:
    if tok.mask_id is not None:
        return int(tok.mask_id)
    if tok.sentinel_ids:
        return int(tok.sentinel_ids[0])  # T5-style vocabularies have no [MASK]: a sentinel plays its part
    raise ConfigError(f"objective {name!r} needs a mask token ([MASK]/<mask>) or T5 sentinels; "
                      "the tokenizer has neither")


class SpanCorruption(Seq2Seq):
    """T5: spans (mean length 3) covering 15% of tokens → one sentinel each; target = sentinel + span ..."""

    name = "span"
    Settings = SpanSettings

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        self.sentinels = _sentinels(tokenizer, self.name)

    def corrupt(self, tokens, rng, block):
        return t5.span_corruption(tokens, rng, sentinel_ids=self.sentinels, noise_density=self.cfg.rate,
                                  mean_span=self.cfg.mean_span)


class IidSpans(SpanCorruption):
    """T5 "i.i.d. noise, replace spans": tokens noised independently; consecutive ones share a sentinel."""

    name = "iid_spans"
    Settings = NoiseSettings

    def corrupt(self, tokens, rng, block):
        return t5.iid_replace_spans(tokens, rng, sentinel_ids=self.sentinels, noise_density=self.cfg.rate)


class BertStyle(Seq2Seq):
    """T5 "BERT-style": 15% of tokens → 80% mask / 10% random / 10% kept; target = the original text."""

    name = "bert_style"
    Settings = NoiseSettings

    def corrupt(self, tokens, rng, block):
        return t5.bert_style(tokens, rng, mask_id=_mask_id(self.tok, self.name), vocab_size=self.tok.vocab_size,
                             noise_density=self.cfg.rate, special_ids=self.special_ids)


class IidMask(Seq2Seq):
    """T5 "i.i.d. noise, mask tokens": each noised token → mask; target = the original text."""

    name = "iid_mask"
    Settings = NoiseSettings

    def corrupt(self, tokens, rng, block):
        return t5.iid_mask_tokens(tokens, rng, mask_id=_mask_id(self.tok, self.name), noise_density=self.cfg.rate)


class DropTokens(Seq2Seq):
    """T5 "i.i.d. noise, drop tokens": noised tokens removed from the input; target = the dropped tokens."""

    name = "drop_tokens"
    Settings = NoiseSettings

    def corrupt(self, tokens, rng, block):
        return t5.drop_tokens(tokens, rng, noise_density=self.cfg.rate)


class Deshuffle(Seq2Seq):
    """T5 "deshuffling": input = the tokens in random order; target = the original text."""

    name = "deshuffle"
    Settings = ShuffleSettings

    def corrupt(self, tokens, rng, block):
        return t5.deshuffle(tokens, rng)


class Denoise(Seq2Seq):
    """BART: masking, deletion, Poisson(λ) infilling, sentence permutation, rotation; target = original."""

    name = "denoise"
    Settings = DenoiseSettings

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        self.noise = bart.DenoiseConfig(mask_ratio=cfg.mask_ratio, delete_ratio=cfg.delete_ratio,
                                        infill_ratio=cfg.infill_ratio, poisson_lambda=cfg.poisson_lambda,
                                        permute_sentences=cfg.permute_sentences, rotate=cfg.rotate)
        needs_mask = cfg.mask_ratio > 0 or cfg.infill_ratio > 0
        self.mask = _mask_id(tokenizer, self.name) if needs_mask else None
        self.word_start_vocab = tokenizer.word_start_mask() if cfg.rotate else None

    def corrupt(self, tokens, rng, block):
        starts = np.asarray(block.sent_starts, dtype=np.int64)
        words = self.word_start_vocab[tokens] if self.word_start_vocab is not None else None
        return bart.denoise(tokens, rng, self.noise, mask_id=self.mask, sent_starts=starts, word_starts=words)


class PrefixLM(Seq2Seq):
    """LM on (prefix → continuation): split each block; the model reads the prefix and predicts the rest.
    Decoder-only: one sequence with a bidirectional prefix (no separator); encoder-decoder: prefix → encoder."""

    name = "prefix_lm"
    Settings = PrefixSettings
    why = "the continuation is generated by a decoder;"
    corrupts = True  # the split point is random
    continuation = True

    def block_size(self, max_seq_len: int) -> int:
        return max_seq_len - 1 if self.layout.encoder_decoder else max_seq_len

    def corrupt(self, tokens, rng, block):
        return t5.prefix_lm_split(tokens, rng, split=self.cfg.prefix_split or None)
