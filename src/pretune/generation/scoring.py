"""Prompting without training, the model side: classification by label-word likelihood, and reasoning paths.

    result = classify(model, tok, FewShotPrompt(template, shots=shots, targets=words), verbalizer, records)
    result.predictions   # one label per record: argmax over labels of log p(gap + word | prompt)
    outcomes = chain_of_thought(model, tok, prompt, records, k=5, temperature=0.7, seed=0)  # self-consistency

**Token layout.** A prompt is tokenized in pieces and the pieces concatenated: ``lead`` (the special tokens
the tokenizer's post-processor puts at the start, e.g. Llama's ``<s>``; none for GPT-2/SmolLM2) + the shared
prefix (instruction and shots) + the query + the label word. Pieces are split at whitespace before the label
word and at the shot separator, so they mostly tokenize as the whole text would; where BPE would have merged
across a boundary (``"\\n\\n" + "Message"``) the piecewise ids are what the model scores. With ``--chat`` the
text before the query and after it come from the model's chat template, and the label word is the start of
the assistant's reply.

**Scoring (decoders).** ``strategy="cache"``: the prefix runs once and its key/value cache is shared; each batch
of queries (left-padded behind the prefix, with explicit positions) runs once on top of it, and the first token
of every label word is read from the query's last logits. Only label words of two or more tokens need one
more pass: the cache is repeated once per label and the remaining label tokens run on it. ``strategy="rows"``:
every (record, label) pair is a full prompt+word row (the simple way, kept as a reference and for timing).
Encoder-decoders read the whole prompt in the encoder and score the word as the decoder's target.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..data.readers import DataError
from ..data.records import Record
from ..model.cache import KVCache
from ..model.layout import layout_of
from .prompt import ChatTemplate, FewShotPrompt, PromptError, SelfConsistency, Verbalizer, apply_chat_template
from .prompt import self_consistency as _vote_paths

__all__ = ["ClassifyResult", "CotOutcome", "chain_of_thought", "classify", "context_window", "lead_ids", "prompt_ids",
           "sample_paths", "score_continuations", "score_seq2seq"]

Strategy = Literal["cache", "rows"]
Fit = Literal["error", "drop_shots"]
LengthNorm = Literal["sum", "mean"]


# ---------------------------------------------------------------------------------------------- tokens
def lead_ids(tok, add_bos: bool | None = None) -> list[int]:
    """Special ids put before a decoder prompt. None (auto): those the tokenizer's post-processor adds at the
    start (what ``transformers``' ``tokenizer(text)`` adds: Llama's ``<s>``, nothing for GPT-2 or SmolLM2);
    True: the BOS id; False: none."""
    if add_bos is False:
        return []
    if add_bos is True:
        if tok.bos_id is None:
            raise PromptError("add_bos=True but the tokenizer has no BOS token")
        return [tok.bos_id]
    plain = tok.tk.encode("a", add_special_tokens=False).ids
    full = tok.tk.encode("a", add_special_tokens=True).ids
    n = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    return full[:n]


def prompt_ids(text: str, tok, model, *, chat_source=None, system: str | None = None,
               add_bos: bool | None = None) -> list[int]:
    """Token ids of one prompt for ``model``, laid out by its layout (model/layout.py): decoders [BOS per
    ``add_bos``] + text; encoder-decoders text + EOS (what T5 was trained to read). ``chat_source``: render the
    text as a user turn of that chat template first (its special-token strings become their ids; nothing else is
    added)."""
    if chat_source is not None:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return tok.encode(apply_chat_template(chat_source, messages))
    layout = layout_of(model.config)
    lead = [] if layout.encoder_decoder else lead_ids(tok, add_bos)
    return layout.prompt_ids(tok.encode(text), eos=tok.eos_id, lead=lead)


def context_window(model, max_len: int | None = None) -> int:
    """Tokens a prompt may take: the model's ``max_seq_len``, or ``max_len`` when that is smaller."""
    window = int(model.config.max_seq_len)
    return min(window, max_len) if max_len else window


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _pad(rows: Sequence[Sequence[int]], *, left: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids padded with 0 (masked out) and the (B, T) mask, 1 on real tokens."""
    T = max((len(r) for r in rows), default=0)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            sl = slice(T - len(r), T) if left else slice(0, len(r))
            ids[i, sl] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, sl] = 1
    return ids.to(device), mask.to(device)


def _rows_of(cache: KVCache, index: torch.Tensor) -> KVCache:
    """A new cache whose row i is row ``index[i]`` of ``cache`` (which is left as it is)."""
    out = copy.deepcopy(cache)
    out.reorder(index)
    return out


# --------------------------------------------------------------------------------------------- scoring
@torch.inference_mode()
def score_continuations(model, prefix: Sequence[int], queries: Sequence[Sequence[int]],
                        continuations: Sequence[Sequence[Sequence[int]]], *, batch_size: int = 8,
                        strategy: Strategy = "cache", progress: Callable[[int], None] | None = None,
                        greedy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-likelihood of each continuation after ``prefix + query`` under a decoder LM.

    Args:
        model: a decoder TransformerLM with an LM head (in eval mode).
        prefix: ids shared by every prompt (may be empty).
        queries: N id lists, one per prompt; ``prefix + query`` must not be empty.
        continuations: N x L id lists (L candidates per prompt, each at least one token).
        batch_size: prompts per forward pass.
        strategy: "cache" (shared prefix, one query pass, one more only for multi-token words) or "rows".
        progress: called with the number of prompts done after each batch.
        greedy: also return, per continuation, whether each of its tokens is the argmax at its position (what
            lm-evaluation-harness calls ``is_greedy``).
    Returns:
        (N, L) float64: sum over the continuation's tokens of log p(token | everything before it); with ``greedy``
        a pair of it and the (N, L) bool tensor.
    """
    if layout_of(model.config).bidirectional:
        raise PromptError(f"score_continuations needs a decoder; the model is {model.config.family}")
    N = len(queries)
    if len(continuations) != N:
        raise PromptError(f"{N} queries but {len(continuations)} continuation lists")
    for i, (q, conts) in enumerate(zip(queries, continuations)):
        if not prefix and not q:
            raise PromptError(f"prompt {i} is empty: a decoder needs at least one token to score a word after")
        if not conts or any(len(c) == 0 for c in conts):
            raise PromptError(f"prompt {i}: every candidate continuation needs at least one token")
    out = torch.zeros(N, max((len(c) for c in continuations), default=0), dtype=torch.float64)
    top = torch.zeros(out.shape, dtype=torch.bool)  # every token of the continuation is the argmax
    if strategy == "rows":
        _score_rows(model, prefix, queries, continuations, out, top, batch_size, progress)
        return (out, top) if greedy else out
    if strategy != "cache":
        raise PromptError(f"strategy={strategy!r} is not one of cache, rows")
    dev = _device(model)
    position = model.transformer.decoder.position
    if position.has_bias or position.has_scores:
        batch_size = 1  # relative/ALiBi/disentangled terms use raw key columns, which mid-sequence padding would shift
    P = len(prefix)
    prefix_cache = None
    if P:
        prefix_cache = model(torch.tensor([list(prefix)], device=dev), use_cache=True).past_key_values
    order = sorted(range(N), key=lambda i: len(queries[i]))  # similar lengths together: little padding
    for b0 in range(0, N, batch_size):
        rows = order[b0:b0 + batch_size]
        qs, conts = [queries[i] for i in rows], [continuations[i] for i in rows]
        B = len(qs)
        ids, qmask = _pad(qs, left=True, device=dev)  # (B, Q): [pad.. query]
        mask = torch.cat([torch.ones(B, P, dtype=torch.long, device=dev), qmask], dim=1)  # (B, P + Q)
        pos = P + (qmask.cumsum(1) - 1).clamp(min=0)  # (B, Q): the query continues the prefix's positions
        multi = any(len(c) > 1 for row in conts for c in row)
        res = model(ids, attention_mask=mask, position_ids=pos, use_cache=multi or P > 0,
                    past_key_values=_rows_of(prefix_cache, torch.zeros(B, dtype=torch.long, device=dev)) if P else None)
        first = F.log_softmax(res.logits[:, -1].double(), dim=-1)  # (B, V): the token after each query
        best = first.argmax(-1).tolist()  # (B,)
        for b, row in enumerate(conts):
            for j, c in enumerate(row):
                out[rows[b], j] = first[b, c[0]]
                top[rows[b], j] = best[b] == c[0]
        if multi:
            pairs = [(b, j) for b in range(B) for j in range(len(conts[b])) if len(conts[b][j]) > 1]
            index = torch.tensor([b for b, _ in pairs], device=dev)
            rest = [conts[b][j] for b, j in pairs]  # one row per multi-token word: its tokens after the first
            cids, cmask = _pad([c[:-1] for c in rest], left=False, device=dev)  # (R, C)
            qlen = qmask.sum(1)[index]  # (R,)
            cpos = (P + qlen)[:, None] + torch.arange(cids.shape[1], device=dev)  # (R, C)
            cache = res.past_key_values
            cache.reorder(index)  # (R, ...): one row per (prompt, multi-token label)
            res2 = model(cids, attention_mask=torch.cat([mask[index], cmask], dim=1), position_ids=cpos,
                         past_key_values=cache, use_cache=True)
            lp = F.log_softmax(res2.logits.double(), dim=-1)  # (R, C, V)
            tgt, tmask = _pad([c[1:] for c in rest], left=False, device=dev)  # (R, C)
            got = (lp.gather(-1, tgt[..., None])[..., 0] * tmask).sum(1)  # (R,)
            hit = ((lp.argmax(-1) == tgt) | (tmask == 0)).all(1).tolist()  # (R,)
            for r, (b, j) in enumerate(pairs):
                out[rows[b], j] += got[r].cpu()
                top[rows[b], j] &= hit[r]
        if progress is not None:
            progress(B)
    return (out, top) if greedy else out


def _score_rows(model, prefix, queries, continuations, out, top, batch_size, progress):
    """Reference strategy: one right-padded row per (prompt, candidate); log p read at the candidate's tokens."""
    dev = _device(model)
    rows = [(i, j) for i in range(len(queries)) for j in range(len(continuations[i]))]
    step = max(1, batch_size * max(len(c) for c in continuations))  # about batch_size prompts per pass
    done = 0  # prompts whose every row is scored
    for r0 in range(0, len(rows), step):
        chunk = rows[r0:r0 + step]
        seqs = [[*prefix, *queries[i], *continuations[i][j]] for i, j in chunk]
        ids, mask = _pad(seqs, left=False, device=dev)  # (R, T)
        lp = F.log_softmax(model(ids, attention_mask=mask).logits.double(), dim=-1)  # (R, T, V)
        for r, (i, j) in enumerate(chunk):
            c = continuations[i][j]
            start = len(prefix) + len(queries[i])  # position of the candidate's first token
            pos = torch.arange(start - 1, start - 1 + len(c), device=dev)
            tgt = torch.tensor(c, device=dev)
            out[i, j] = lp[r, pos, tgt].sum().cpu()
            top[i, j] = bool((lp[r, pos].argmax(-1) == tgt).all())
        last_i, last_j = chunk[-1]
        finished = last_i + (last_j == len(continuations[last_i]) - 1)
        if progress is not None and finished > done:
            progress(finished - done)
        done = finished


@torch.inference_mode()
def score_seq2seq(model, inputs: Sequence[Sequence[int]], continuations: Sequence[Sequence[Sequence[int]]], *,
                  batch_size: int = 8, progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """Log-likelihood of each candidate as the decoder's target given the encoder input (encoder-decoders).

    inputs: N encoder id lists; continuations: N x L target id lists. Returns (N, L) float64 sums; the decoder
    starts from ``config.decoder_start_token_id``.
    """
    if not layout_of(model.config).encoder_decoder:
        raise PromptError(f"score_seq2seq needs an encoder-decoder; the model is {model.config.family}")
    dev = _device(model)
    start = model.config.decoder_start_token_id
    out = torch.zeros(len(inputs), max((len(c) for c in continuations), default=0), dtype=torch.float64)
    for b0 in range(0, len(inputs), batch_size):
        xs, conts = inputs[b0:b0 + batch_size], continuations[b0:b0 + batch_size]
        ids, mask = _pad(xs, left=False, device=dev)  # (B, S)
        memory = model.transformer.encode(ids, mask)  # (B, S, dim)
        pairs = [(b, j) for b in range(len(xs)) for j in range(len(conts[b]))]
        index = torch.tensor([b for b, _ in pairs], device=dev)
        dec, dmask = _pad([[start, *conts[b][j][:-1]] for b, j in pairs], left=False, device=dev)  # (R, C)
        tgt, _ = _pad([conts[b][j] for b, j in pairs], left=False, device=dev)
        logits = model(ids[index], mask[index], decoder_input_ids=dec, decoder_attention_mask=dmask,
                       encoder_hidden_states=memory[index]).logits
        lp = F.log_softmax(logits.double(), dim=-1).gather(-1, tgt[..., None])[..., 0]  # (R, C)
        got = (lp * dmask).sum(1).cpu()
        for r, (b, j) in enumerate(pairs):
            out[b0 + b, j] = got[r]
        if progress is not None:
            progress(len(xs))
    return out


# ------------------------------------------------------------------------------------- prompt assembly
@dataclass
class _Group:
    """Records that use the same number of shots: their shared prefix ids and per-record query ids."""

    n_shots: int
    prefix: list[int]
    members: list[int]  # record indices
    queries: list[list[int]]


class _Assembler:
    """Turns (FewShotPrompt, record) into prefix/query ids for a model, fitting the context window."""

    def __init__(self, model, tok, prompt: FewShotPrompt, *, chat: ChatTemplate | None, system: str | None,
                 add_bos: bool | None, max_len: int | None, fit: Fit):
        if fit not in ("error", "drop_shots"):
            raise PromptError(f"fit={fit!r} is not one of error, drop_shots")
        self.tok, self.prompt, self.chat, self.system = tok, prompt, chat, system
        self.encdec = layout_of(model.config).encoder_decoder  # the whole prompt goes to the encoder
        self.lead = [] if chat is not None or self.encdec else lead_ids(tok, add_bos)
        self.window, self.fit = context_window(model, max_len), fit
        self.why = (f"max_len={max_len}" if max_len and max_len < model.config.max_seq_len
                    else f"the model's max_seq_len={model.config.max_seq_len}")
        self._prefixes: dict[int, tuple[list[int], str, str]] = {}

    def _messages(self, content: str) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": content}]

    def _prefix(self, n: int) -> tuple[list[int], str, str]:
        """(prefix ids, prefix text, the chat template's text after the user content) for n shots."""
        if n not in self._prefixes:
            text, tail = self.prompt.prefix(n), ""
            if self.chat is not None:
                mark = "\x00query\x00"
                text, found, tail = apply_chat_template(self.chat, self._messages(text + mark)).partition(mark)
                if not found:
                    raise PromptError("the chat template dropped the user message; cannot build the prompt")
            self._prefixes[n] = (self.lead + self.tok.encode(text) if text else list(self.lead), text, tail)
        return self._prefixes[n]

    def query(self, rec: Record, n: int) -> list[int]:
        ctx, _ = self.prompt.template.context(rec)
        if self.chat is None:
            return self.tok.encode(ctx)
        _, head, tail = self._prefix(n)
        whole = apply_chat_template(self.chat, self._messages(self.prompt.prefix(n) + ctx))
        if whole != head + ctx + tail:
            raise PromptError("the chat template changes the user message (e.g. strips it), so the prompt cannot "
                              "be split into a shared part and a query")
        return self.tok.encode(ctx + tail)

    def encoder_input(self, rec: Record, n: int) -> list[int]:
        """Encoder-decoders: the whole prompt with the tokenizer's own special tokens (T5: a final </s>)."""
        return self.tok.tk.encode(self.prompt.text(rec, n_shots=n), add_special_tokens=True).ids

    def groups(self, records: Sequence[Record], extra: Sequence[int]) -> tuple[list[_Group], list[int]]:
        """Records grouped by the shots they keep; ``extra[i]``: tokens record i needs after its prompt."""
        K = len(self.prompt.shots)
        groups: dict[int, _Group] = {}
        used = []
        for i, rec in enumerate(records):
            n = K
            while True:
                q = self.encoder_input(rec, n) if self.encdec else self.query(rec, n)
                prefix = [] if self.encdec else self._prefix(n)[0]
                need = len(prefix) + len(q) + (0 if self.encdec else extra[i])
                if need <= self.window:
                    break
                if self.fit == "error" or n == 0:
                    shots = (f"with {n} shot{'s' if n != 1 else ''}" if n
                             else "even without shots" if K else "(zero-shot)")
                    hint = ("use fewer or shorter shots, or fit='drop_shots' (--fit drop-shots) to drop the earliest "
                            "shots until it fits" if self.fit == "error" and K else "shorten the input")
                    answer = f" ({extra[i]} of them for the answer)" if extra[i] else ""
                    raise DataError(f"{rec.where}: the prompt {shots} needs {need} tokens{answer}, more than the "
                                    f"context window of {self.window} ({self.why}); {hint}")
                n -= 1
            g = groups.setdefault(n, _Group(n, prefix, [], []))
            g.members.append(i)
            g.queries.append(q)
            used.append(n)
        return [groups[n] for n in sorted(groups, reverse=True)], used


# -------------------------------------------------------------------------------------- classification
CONTENT_FREE = ("N/A", "", "[MASK]")  # Zhao et al. 2021's content-free inputs, averaged


@dataclass
class ClassifyResult:
    """Label-word scores and predictions for a list of records."""

    labels: list[str]  # the verbalizer's labels, the column order of ``scores``
    scores: torch.Tensor  # (N, L) float64 log-likelihoods (summed or per-token mean)
    n_shots: list[int]  # shots each prompt kept (fewer than asked when dropped to fit the window)
    baseline: torch.Tensor | None = None  # (N, L) log p_cf(label): content-free label probabilities (see below)

    @property
    def calibrated(self) -> torch.Tensor:
        """(N, L) contextual calibration (Zhao et al. 2021), as log-probabilities over the label set: each label's
        probability given x (normalised over the labels) divided by its content-free probability ``p_cf`` (the
        mean, over the content-free inputs, of their label probabilities, each normalised over the labels), then
        renormalised: ``softmax(log p(.|x) - log p_cf)``. Dividing by p_cf (W = diag(p_cf)^-1, b = 0) removes the
        prompt's own preference for some label words (majority-label, recency and common-token bias)."""
        if self.baseline is None:
            raise PromptError("no content-free baseline: classify with content_free=('N/A', '', '[MASK]') to "
                              "calibrate")
        return F.log_softmax(F.log_softmax(self.scores, dim=-1) - self.baseline, dim=-1)

    @property
    def predictions(self) -> list[str]:
        """The argmax label per record (calibrated when there is a baseline); ties go to the first label."""
        best = (self.scores if self.baseline is None else self.calibrated).argmax(1)
        return [self.labels[i] for i in best.tolist()]

    @property
    def raw_predictions(self) -> list[str]:
        """The argmax of the uncalibrated scores."""
        return [self.labels[i] for i in self.scores.argmax(1).tolist()]


def classify(model, tok, prompt: FewShotPrompt, verbalizer: Verbalizer, records: Sequence[Record], *,
             chat: ChatTemplate | None = None, system: str | None = None, length_norm: LengthNorm = "sum",
             content_free: str | Sequence[str] | None = None, batch_size: int = 8, strategy: Strategy = "cache",
             max_len: int | None = None, fit: Fit = "error", add_bos: bool | None = None,
             progress: Callable[[int], None] | None = None) -> ClassifyResult:
    """Classify records by comparing label-word likelihoods under a prompt (no training).

    Args:
        model: a decoder or encoder-decoder TransformerLM with an LM head; tok: its pretune Tokenizer.
        prompt: template, shots (with their label words as targets), instruction and separator.
        verbalizer: label -> word; each record gets the label whose word is most likely after its prompt.
        records: the inputs (their gold labels are not read here).
        chat: wrap the prompt as a user message with this chat template; the word starts the assistant's reply.
        system: a system message for ``chat``.
        length_norm: "sum" (total log-probability of the word's tokens) or "mean" (per token, which stops
            long words from losing just for being long).
        content_free: content-free input text(s) (``CONTENT_FREE``: "N/A", "" and "[MASK]", as Zhao et al. 2021):
            also score the prompt (same shots) with every field set to each of them, average their label
            probabilities into ``p_cf`` and predict with the calibrated scores (``ClassifyResult.calibrated``).
        batch_size, strategy: see :func:`score_continuations`.
        max_len: a context window smaller than the model's; fit: "error" when a prompt does not fit, or
            "drop_shots": drop the earliest shots of that prompt until it fits (``n_shots`` says how many stayed).
        add_bos: see :func:`lead_ids`.
        progress: called with the number of records done after each batch.
    """
    if length_norm not in ("sum", "mean"):
        raise PromptError(f"length_norm={length_norm!r} is not one of sum, mean")
    layout = layout_of(model.config)
    if not layout.writes_text or getattr(model, "task_head", False) or model.config.head != "lm":
        raise PromptError(f"label-word scoring needs a decoder or encoder-decoder with an LM head; this model is "
                          f"{model.config.family} with head {model.config.head!r}")
    words = list(verbalizer.words.values())

    def continuations(rec: Record) -> list[list[int]]:
        if chat is not None:
            return [tok.encode(w) for w in words]  # the reply starts with the word
        if layout.encoder_decoder:
            return [tok.tk.encode(w, add_special_tokens=True).ids for w in words]  # T5: word </s>
        gap = prompt.template.context(rec)[1]
        return [tok.encode(gap + w) for w in words]

    def score(prefix, queries, conts, progress=None) -> torch.Tensor:
        if layout.encoder_decoder:
            s = score_seq2seq(model, queries, conts, batch_size=batch_size, progress=progress)
        else:
            s = score_continuations(model, prefix, queries, conts, batch_size=batch_size, strategy=strategy,
                                    progress=progress)
        if length_norm == "mean":
            s = s / torch.tensor([[len(c) for c in row] for row in conts], dtype=torch.float64)
        return s

    conts = [continuations(r) for r in records]
    asm = _Assembler(model, tok, prompt, chat=chat, system=system, add_bos=add_bos, max_len=max_len, fit=fit)
    groups, used = asm.groups(records, [max(map(len, c)) for c in conts])
    scores = torch.zeros(len(records), len(words), dtype=torch.float64)
    free_texts = [content_free] if isinstance(content_free, str) else list(content_free or [])
    if content_free is not None and not free_texts:
        raise PromptError("content_free is empty: give at least one content-free text (e.g. 'N/A')")
    baseline = None if not free_texts else torch.zeros_like(scores)
    frees = [Record(f"content-free input {t!r}", {f: t for f in prompt.template.fields}) for t in free_texts]
    was_training = model.training
    model.eval()
    try:
        for g in groups:
            scores[g.members] = score(g.prefix, g.queries, [conts[i] for i in g.members], progress)
            if baseline is not None:  # the same prompt (same shots) around each content-free input
                probs = []
                for free in frees:
                    q = asm.encoder_input(free, g.n_shots) if layout.encoder_decoder else asm.query(free, g.n_shots)
                    probs.append(F.softmax(score(g.prefix, [q], [continuations(free)])[0], dim=-1))
                p_cf = torch.stack(probs).mean(0)
                baseline[g.members] = torch.log(p_cf / p_cf.sum())
    finally:
        model.train(was_training)
    return ClassifyResult(verbalizer.labels, scores, used, baseline)


# ------------------------------------------------------------------------------------ chain of thought
def sample_paths(model, tok, prompt_ids: Sequence[int], *, n: int = 1, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, max_new_tokens: int = 128,
                 seed: int | None = None, stop: Sequence[str] = ()) -> list[str]:
    """``n`` completions of one prompt (decoding in ``generation.decode``), as text cut at EOS and at the first
    stop string."""
    from .decode import GenerationError, generate

    dev = _device(model)
    ids = torch.tensor([list(prompt_ids)], device=dev)
    eos = [i for i in dict.fromkeys([tok.eos_id, getattr(model.config, "eos_token_id", None)]) if i is not None]
    pad = tok.pad_id if tok.pad_id is not None else (eos[0] if eos else 0)
    try:
        out = generate(model, ids, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                       top_k=top_k, top_p=top_p, num_return_sequences=n, eos_token_id=eos or None, pad_token_id=pad,
                       stop=list(stop), tokenizer=tok, seed=seed)
    except GenerationError as e:
        raise PromptError(str(e)) from None
    skip = ids.shape[1] if not layout_of(model.config).encoder_decoder else 1  # the prompt, or the decoder start
    texts = []
    for row in out.tolist():
        new = row[skip:]
        end = min((new.index(e) for e in eos if e in new), default=len(new))
        new = new[:end]
        text = tok.decode(new, skip_special_tokens=True)
        cut = min((text.find(s) for s in stop if s and s in text), default=-1)
        texts.append(text[:cut] if cut >= 0 else text)
    return texts


@dataclass
class CotOutcome:
    """One record's chain-of-thought result."""

    n_shots: int
    result: SelfConsistency  # paths, extracted answers, vote (k=1: the greedy path)


def chain_of_thought(model, tok, prompt: FewShotPrompt, records: Sequence[Record], *, k: int = 1,
                     do_sample: bool | None = None, temperature: float = 0.7, top_k: int = 0, top_p: float = 1.0,
                     max_new_tokens: int = 128, seed: int = 0, pattern: str | None = None,
                     stop: Sequence[str] | None = None, chat: ChatTemplate | None = None, system: str | None = None,
                     max_len: int | None = None, fit: Fit = "error", add_bos: bool | None = None,
                     progress: Callable[[int], None] | None = None) -> list[CotOutcome]:
    """Chain-of-thought answers, with self-consistency when ``k > 1``.

    Each record's prompt is continued ``k`` times (``do_sample`` defaults to ``k > 1``; record i samples with
    seed ``seed + i``, so results are reproducible and independent of batch order); each path's answer is
    extracted (:func:`~pretune.generation.prompt.extract_answer` with ``pattern``) and the majority wins
    (:func:`~pretune.generation.prompt.majority_vote`; ties: the earliest path's answer).
    ``stop`` defaults to the prompt's separator (the model starting a new example), none with ``chat``.
    The prompt plus ``max_new_tokens`` must fit the context window (``fit`` as in :func:`classify`).
    """
    if not layout_of(model.config).writes_text:
        raise PromptError("chain-of-thought needs a model that generates (decoder or encoder-decoder)")
    do_sample = k > 1 if do_sample is None else do_sample
    if stop is None:
        stop = [prompt.sep] if chat is None and prompt.sep else []
    asm = _Assembler(model, tok, prompt, chat=chat, system=system, add_bos=add_bos, max_len=max_len, fit=fit)
    encdec = layout_of(model.config).encoder_decoder
    groups, used = asm.groups(records, [0 if encdec else max_new_tokens] * len(records))
    prompts: dict[int, list[int]] = {i: g.prefix + q for g in groups for i, q in zip(g.members, g.queries)}
    was_training = model.training
    model.eval()
    out = []
    try:
        for i in range(len(records)):
            res = _vote_paths(lambda n, i=i: sample_paths(
                model, tok, prompts[i], n=n, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                max_new_tokens=max_new_tokens, seed=seed + i, stop=stop), k, pattern=pattern)
            out.append(CotOutcome(used[i], res))
            if progress is not None:
                progress(1)
    finally:
        model.train(was_training)
    return out
