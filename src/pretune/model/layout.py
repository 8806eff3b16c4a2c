"""How a model family lays text out: the one place that knows that an encoder-decoder splits a source from its
target while a decoder-only model puts both in one sequence.

    layout = layout_of(model.config)              # or layout_of(cfg, "prefix_lm") to ask for one explicitly
    example = layout.example(source, target, eos=eos, start=start)   # training features with labels
    h, targets = layout.lm_inputs(model, batch)   # hidden states aligned with the LM targets
    logp = layout.continuation_logprobs(model, ids, mask, choices)   # score continuations of inputs

Objectives (T5/BART/prefix-LM pretraining), tasks (seq2seq, choice, sentence pairs, QA), generation, scoring
and embedding ask their model's layout instead of testing ``cfg.arch`` themselves (a test enforces that no
code outside the model package, ``interop/``, ``config.py`` and ``presets.py`` compares an arch value).

Four layouts:

* ``encoder`` (BERT): reads one text bidirectionally; writes none (no text-to-text).
* ``encoder-decoder`` (T5, BART): the encoder reads ``source EOS``; the decoder reads ``start target`` and is
  trained to write ``target EOS``; generation feeds the source to the encoder once.
* ``causal`` (GPT-2, Llama, every imported LLM): ``source target EOS`` in one causal sequence, the loss on the
  target; a text target continues the source as running text (a leading space).
* ``prefix_lm`` (T5's decoder-only variants, Raffel et al. 2019 §3.2.1): ``source EOS target EOS`` with
  bidirectional attention over the source and its EOS (``prefix_lengths``), the loss on the target.

A decoder-only model's layout is ``ModelConfig.decoder_layout``: pretraining records how the model learned
(``clm`` -> causal; the T5/BART/prefix-LM objectives on a decoder -> prefix_lm); imported checkpoints are causal.
Finetuning follows the record unless the task says otherwise (``task.layout``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from ..config import ConfigError, ModelConfig

IGNORE = -100  # label of positions without a target (the cross-entropy's ignore_index)
PACK_WIDTHS = (64, 128, 256)  # row widths packed texts may be laid in (besides 1, 2 and 4 times the longest text)
ATTENTION_PAIR_COST = 1.5  # a query-key pair of attention costs about 1 / (this x dim) of a token's linears (forward
# and backward, dropout on: measured on MiniLM, dim 384, fp32 CPU); Layout.packed_hidden_states weighs widths by it

__all__ = ["Layout", "layout_of", "check_family", "pack_texts", "LAYOUTS", "IGNORE"]


class Layout:
    """The base: what every layout answers. Subclasses open with one line saying how they differ."""

    name: ClassVar[str]
    bidirectional: ClassVar[bool] = False  # the input text is read with bidirectional attention
    writes_text: ClassVar[bool] = True  # has a causal decoder: generation and text-to-text are possible
    encoder_decoder: ClassVar[bool] = False  # source and target live in two stacks (encoder memory + decoder)
    pair_style: ClassVar[str] = "gpt"  # default sentence-pair input format: bert, gpt or t5 (tasks/base.py)
    poolings: ClassVar[tuple[str, ...]] = ("mean", "last")  # sentence-embedding poolings that apply (first: default)
    target_lead: ClassVar[str] = ""  # text put before a target word (" ": it continues the source as running text)

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    # -- text-to-text: training ---------------------------------------------------------------------
    def source_room(self, max_len: int, target_len: int) -> int:
        """Tokens a source may have (before the layout's special tokens) when its target has ``target_len``."""
        return max_len - 1 - target_len

    def example(self, source: np.ndarray, target: np.ndarray, *, eos: int, start: int,
                continuation: bool = False) -> dict:
        """Training features (numpy) for ``source`` -> ``target`` token ids; ``labels`` hold the targets (-100 where
        there is none). ``continuation``: the target goes on the source's text (prefix-LM pretraining), so a
        decoder joins them with no separator and no final EOS."""
        raise NotImplementedError

    def prompt(self, source: np.ndarray, *, eos: int) -> dict:
        """Inference features (numpy) of a source whose target is to be written (or scored)."""
        raise NotImplementedError

    def count_targets(self, batch: dict) -> int:
        """LM targets in a batch of :meth:`example` features."""
        return int((batch["labels"] != IGNORE).sum())

    def lm_inputs(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states (N, dim), targets (N,)) of a batch of :meth:`example` features, aligned so that the LM
        head on row i predicts target i (-100: no target)."""
        raise NotImplementedError

    # -- text-to-text: generation and scoring ----------------------------------------------------------
    def prompt_ids(self, ids: list[int], *, eos: int | None, lead: list[int]) -> list[int]:
        """The ids a generation prompt starts from: ``lead`` (a decoder's BOS, when its tokenizer adds one) + ids;
        an encoder-decoder's encoder reads ids + EOS (what T5 was trained to read)."""
        return lead + ids

    def prompt_kwargs(self, input_ids: torch.Tensor) -> dict:
        """Extra model arguments of the first decoding step over a (left-padded) prompt (B, T)."""
        return {}

    def new_tokens(self, output: torch.Tensor, prompt_width: int) -> torch.Tensor:
        """The generated tokens of ``generate``'s output (decoders return the prompt first)."""
        return output[:, prompt_width:]

    def continuation_logprobs(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              continuations: torch.Tensor) -> torch.Tensor:
        """log p of every continuation token given every input.

        Args:
            input_ids, attention_mask: (B, S) right-padded :meth:`prompt` features.
            continuations: (C, L) token ids, -100 after each continuation's end.
        Returns:
            (B, C, L) log-probabilities, 0 where the continuation has ended.
        """
        raise NotImplementedError

    # -- reading text ---------------------------------------------------------------------------------
    def hidden_states(self, model, ids: torch.Tensor, mask: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, dim) last hidden states of the stack that reads the text (no head). ``position_ids`` and
        ``document_ids`` (B, T): rows holding several texts end to end (see :meth:`packed_hidden_states`)."""
        return model.transformer.decode(ids, mask, position_ids=position_ids, document_ids=document_ids)

    def packed_hidden_states(self, model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """:meth:`hidden_states` of right-padded texts (R, T), computed with the texts laid end to end.

        A batch of texts right-padded to its longest spends the stack's work on padding (a batch of sentence pairs:
        about half its rows). Here the texts are laid end to end in rows (first fit, longest first:
        :func:`pack_texts`), each attending only within itself (``document_ids``) with its positions starting at 0,
        as it would alone in its padded row, so every state is the one the padded rows give, up to rounding. The
        states come back in the padded layout (zeros at the padding), so pooling reads them as before. A wider row
        wastes fewer positions but attends over more keys, so the width is the one of :data:`PACK_WIDTHS` and 1, 2
        or 4 times the longest text whose positions and attention pairs cost least (pairs weighed by
        :data:`ATTENTION_PAIR_COST`). Dropout draws its masks over the packed rows, so a training step's noise (not
        its maths) differs from the padded one's. The padded rows are read as they are when they cost less, when the
        mask is not right padding, when the stack puts its own vectors before the text (prompt tuning), or when
        adapters are routed per row (``pretune.peft.route``: the rows would move under them)."""
        R, T = ids.shape
        lengths = mask.sum(1)
        stack = getattr(getattr(model, "transformer", None), "input_stack", None)
        per_row = getattr(getattr(model, "peft_state", None), "rows", None) is not None
        if (stack is None or stack.extra_inputs is not None or per_row or R < 2
                or not bool((mask.cumprod(1).sum(1) == lengths).all())):  # right padding only
            return self.hidden_states(model, ids, mask)
        lengths = lengths.tolist()
        longest = max(lengths)
        pair = 1.0 / (ATTENTION_PAIR_COST * self.cfg.dim)

        def cost(rows: int, width: int) -> float:  # the stack's work: positions, and attention pairs
            return rows * width * (1.0 + width * pair)

        best_cost, rows, L = cost(R, T), None, T
        if sum(lengths) * (1.0 + longest * pair) >= best_cost:  # the least any packing costs (rows no padding, no
            return self.hidden_states(model, ids, mask)  # narrower than the longest text): the padded rows win
        for width in sorted({w for w in (longest, 2 * longest, 4 * longest, *PACK_WIDTHS)
                             if longest <= w <= max(longest, self.cfg.max_positions)}):
            plan = pack_texts(lengths, width)
            if cost(len(plan), width) < best_cost:
                best_cost, rows, L = cost(len(plan), width), plan, width
        if rows is None:
            return self.hidden_states(model, ids, mask)
        P = len(rows)
        src = np.full((P, L), R * T, dtype=np.int64)  # each packed position's index in the padded rows (R*T: none)
        pos, doc = np.zeros((P, L), dtype=np.int64), np.zeros((P, L), dtype=np.int64)
        for p, texts in enumerate(rows):
            col = 0
            for d, r in enumerate(texts, start=1):
                n = lengths[r]
                src[p, col:col + n] = r * T + np.arange(n)
                pos[p, col:col + n], doc[p, col:col + n] = np.arange(n), d
                col += n
        real = src < R * T
        back = np.full(R * T, P * L, dtype=np.int64)  # each padded position's packed index (P*L: a zero row)
        back[src[real]] = np.flatnonzero(real)
        dev = ids.device
        packed = torch.cat([ids.reshape(-1), ids.new_zeros(1)])[torch.from_numpy(src).to(dev)]  # (P, L)
        h = self.hidden_states(model, packed, torch.from_numpy(real).to(dev).long(),
                               position_ids=torch.from_numpy(pos).to(dev), document_ids=torch.from_numpy(doc).to(dev))
        h = torch.cat([h.reshape(P * L, -1), h.new_zeros(1, h.shape[-1])])  # (P L + 1, dim)
        return h[torch.from_numpy(back).to(dev)].view(R, T, -1)  # (R, T, dim)

    def _needs(self, what: str) -> ConfigError:
        return ConfigError(f"{what} needs a model that writes text (a decoder or an encoder-decoder); this one is "
                           f"{self.name}")


class EncoderLayout(Layout):
    """Differs from the base: one bidirectional stack that reads text and writes none (BERT)."""

    name = "encoder"
    bidirectional = True
    writes_text = False
    pair_style = "bert"
    poolings = ("mean", "cls")

    def example(self, source, target, *, eos, start, continuation=False):
        raise self._needs("text-to-text")

    def prompt(self, source, *, eos):
        raise self._needs("text-to-text")

    def lm_inputs(self, model, batch):
        raise self._needs("a language-model loss")

    def continuation_logprobs(self, model, input_ids, attention_mask, continuations):
        raise self._needs("scoring continuations")

    def prompt_ids(self, ids, *, eos, lead):
        raise self._needs("generation")

    def hidden_states(self, model, ids, mask, *, position_ids=None, document_ids=None):
        return model.transformer.encode(ids, mask, position_ids=position_ids, document_ids=document_ids)


class EncoderDecoderLayout(Layout):
    """Differs from the base: the encoder reads ``source EOS``, the decoder ``start target`` (T5, BART)."""

    name = "encoder-decoder"
    bidirectional = True
    encoder_decoder = True
    pair_style = "t5"
    poolings = ("mean", "cls")  # the encoder's states (T5 has no [CLS]: "cls" is its first token)

    def source_room(self, max_len, target_len):
        return max_len - 1  # the target has its own stack

    def example(self, source, target, *, eos, start, continuation=False):
        src = np.concatenate([source, [eos]]).astype(np.int64)
        tgt = np.concatenate([target, [eos]]).astype(np.int64)
        return {"input_ids": src, "attention_mask": np.ones_like(src),
                "decoder_input_ids": np.concatenate([[start], tgt[:-1]]).astype(np.int64),
                "decoder_attention_mask": np.ones_like(tgt), "labels": tgt}

    def prompt(self, source, *, eos):
        src = np.concatenate([source, [eos]]).astype(np.int64)
        return {"input_ids": src, "attention_mask": np.ones_like(src)}

    def lm_inputs(self, model, batch):
        tr = model.transformer
        memory = tr.encode(batch["input_ids"], batch["attention_mask"])  # (B, S, dim)
        h = tr.decode(batch["decoder_input_ids"], batch["decoder_attention_mask"], memory=memory,
                      memory_mask=batch["attention_mask"])  # (B, T, dim)
        return h.reshape(-1, h.shape[-1]), batch["labels"].reshape(-1)

    def prompt_ids(self, ids, *, eos, lead):
        return ids + ([eos] if eos is not None else [])

    def new_tokens(self, output, prompt_width):
        return output[:, 1:]  # generate returns the decoder start token first

    def continuation_logprobs(self, model, input_ids, attention_mask, continuations):
        B, C = input_ids.shape[0], continuations.shape[0]
        dev = input_ids.device
        valid = continuations != IGNORE  # (C, L)
        tokens = continuations.clamp(min=0)
        tr = model.transformer
        memory = tr.encode(input_ids, attention_mask).repeat_interleave(C, dim=0)  # (B*C, S, dim)
        start = torch.full((C, 1), self.cfg.decoder_start_token_id, dtype=torch.long, device=dev)
        dec_in = torch.cat([start, tokens[:, :-1]], 1)
        fed = torch.cat([torch.ones(C, 1, dtype=torch.bool, device=dev), valid[:, :-1]], 1)
        dec_in = torch.where(fed, dec_in, torch.full_like(dec_in, self.cfg.pad_token_id))
        h = tr.decode(dec_in.repeat(B, 1), fed.long().repeat(B, 1), memory=memory,
                      memory_mask=attention_mask.repeat_interleave(C, dim=0))  # (B*C, L, dim)
        return _gather_logprobs(model, h, tokens, valid, B)

    def hidden_states(self, model, ids, mask, *, position_ids=None, document_ids=None):
        return model.transformer.encode(ids, mask, position_ids=position_ids, document_ids=document_ids)


class CausalLayout(Layout):
    """Differs from the base: ``source target EOS`` in one causal sequence (GPT-2, Llama, imported LLMs)."""

    name = "causal"
    target_lead = " "

    def _join(self, source, target, eos, continuation):
        return np.concatenate([source, target] if continuation else [source, target, [eos]]).astype(np.int64)

    def _prefix(self, source, continuation) -> int:
        """Positions before the first target token."""
        return len(source)

    def example(self, source, target, *, eos, start, continuation=False):
        ids = self._join(source, target, eos, continuation)
        labels = ids.copy()
        labels[: self._prefix(source, continuation)] = IGNORE
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}

    def prompt(self, source, *, eos):
        src = np.asarray(source, dtype=np.int64)
        return {"input_ids": src, "attention_mask": np.ones_like(src)}

    def count_targets(self, batch):
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def _decode(self, model, ids, mask, prefix_lengths):
        return model.transformer.decode(ids, mask)

    def lm_inputs(self, model, batch):
        if "document_ids" in batch:  # packed rows: examples attend within themselves, positions restart
            h = model.transformer.decode(batch["input_ids"], batch["attention_mask"],
                                         position_ids=batch["position_ids"], document_ids=batch["document_ids"])
        else:
            h = self._decode(model, batch["input_ids"], batch["attention_mask"], batch.get("prefix_lengths"))
        h, targets = h[:, :-1], batch["labels"][:, 1:]  # state t predicts token t + 1
        return h.reshape(-1, h.shape[-1]), targets.reshape(-1)

    def continuation_logprobs(self, model, input_ids, attention_mask, continuations):
        B, C = input_ids.shape[0], continuations.shape[0]
        dev = input_ids.device
        valid = continuations != IGNORE  # (C, L)
        tokens = continuations.clamp(min=0)
        lengths = attention_mask.sum(1)  # (B,)
        S, L = input_ids.shape[1], tokens.shape[1]
        rows = torch.full((B, C, S + L), self.cfg.pad_token_id, dtype=torch.long, device=dev)
        row_mask = torch.zeros(B, C, S + L, dtype=torch.long, device=dev)
        for b in range(B):  # left-aligned: the input, then the continuation; the rest padding
            n = int(lengths[b])
            rows[b, :, :n] = input_ids[b, :n]
            rows[b, :, n:n + L] = tokens
            row_mask[b, :, :n] = 1
            row_mask[b, :, n:n + L] = valid.long()
        hidden = self._decode(model, rows.view(B * C, S + L), row_mask.view(B * C, -1), lengths.repeat_interleave(C))
        at = (lengths[:, None] - 1 + torch.arange(L, device=dev)[None, :]).repeat_interleave(C, dim=0)  # (B*C, L)
        h = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1]))  # the states that predict token t
        return _gather_logprobs(model, h, tokens, valid, B)


class PrefixLMLayout(CausalLayout):
    """Differs from causal: ``source EOS target EOS``, bidirectional over the source and its EOS (T5's prefix LM)."""

    name = "prefix_lm"
    target_lead = ""

    def _join(self, source, target, eos, continuation):
        if continuation:  # prefix-LM pretraining: the continuation follows the prefix directly
            return np.concatenate([source, target]).astype(np.int64)
        return np.concatenate([source, [eos], target, [eos]]).astype(np.int64)

    def _prefix(self, source, continuation):
        return len(source) + (0 if continuation else 1)

    def example(self, source, target, *, eos, start, continuation=False):
        out = super().example(source, target, eos=eos, start=start, continuation=continuation)
        out["prefix_lengths"] = np.int64(self._prefix(source, continuation))
        return out

    def prompt(self, source, *, eos):
        src = np.concatenate([source, [eos]]).astype(np.int64)
        return {"input_ids": src, "attention_mask": np.ones_like(src), "prefix_lengths": np.int64(len(src))}

    def prompt_ids(self, ids, *, eos, lead):
        return lead + ids

    def prompt_kwargs(self, input_ids):
        # the whole (left-padded) prompt is the bidirectional prefix; padding stays hidden by the attention mask
        return {"prefix_lengths": torch.full((input_ids.shape[0],), input_ids.shape[1], device=input_ids.device)}

    def _decode(self, model, ids, mask, prefix_lengths):
        return model.transformer.decode(ids, mask, prefix_lengths=prefix_lengths)


def pack_texts(lengths: list[int], width: int) -> list[list[int]]:
    """Rows of at most ``width`` tokens holding texts of ``lengths`` tokens (none longer than ``width``), by first fit
    with the longest first: each row the indices of its texts, in the order they sit."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(width)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def _gather_logprobs(model, h: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, B: int) -> torch.Tensor:
    """log p(tokens) from the states h (B*C, L, dim) that predict them; (B, C, L), 0 past each continuation."""
    logits = model.head(h).float()  # (B*C, L, vocab)
    logp = logits.log_softmax(-1).gather(-1, tokens.repeat(B, 1)[..., None]).squeeze(-1)
    return logp.view(B, tokens.shape[0], -1) * valid


LAYOUTS: dict[str, type[Layout]] = {c.name: c for c in (EncoderLayout, EncoderDecoderLayout, CausalLayout,
                                                        PrefixLMLayout)}


FAMILY_NAMES = {"encoder": "an encoder-only", "decoder": "a decoder-only", "encoder-decoder": "an encoder-decoder"}


def check_family(cfg: ModelConfig, families: tuple[str, ...], *, who: str, why: str) -> None:
    """Raise a ConfigError when ``cfg``'s family (``cfg.arch``) is not one of ``families``, saying ``why`` it
    matters to ``who`` (an objective or a task) and which families serve it."""
    if cfg.arch in families:
        return
    served = " or ".join(FAMILY_NAMES[a] for a in families)
    raise ConfigError(f"{who} cannot train {FAMILY_NAMES[cfg.arch]} model (model.arch={cfg.arch!r}): {why} It needs "
                      f"{served} model.")


def layout_of(cfg: ModelConfig, override: str | None = None) -> Layout:
    """The layout of a model config: its family's, and for a decoder-only model ``cfg.decoder_layout`` (or
    ``override``: "causal" / "prefix_lm"; "auto", "" and None keep the recorded one)."""
    if cfg.arch == "encoder":
        return EncoderLayout(cfg)
    if cfg.arch == "encoder-decoder":
        return EncoderDecoderLayout(cfg)
    name = cfg.decoder_layout if override in (None, "", "auto") else override
    if name not in ("causal", "prefix_lm"):
        raise ConfigError(f"layout {name!r} is not one of auto, causal, prefix_lm")
    return LAYOUTS[name](cfg)
