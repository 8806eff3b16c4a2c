"""Decoding with a key/value cache: greedy, sampling (temperature, top-k, top-p), beam search, stop strings.

``generate(model, input_ids)`` returns token ids the way transformers' ``generate`` does:

* decoder-only: the prompt (with its left padding) followed by the new tokens, (B * n, T + new);
* encoder-decoder: the decoder start token followed by the new tokens, (B * n, 1 + new);

where n is ``num_return_sequences``. A row that ends (EOS, or a stop string) before the others is
filled with ``pad_token_id`` to the common length. The prompt is run once; each later step feeds only
the newest token and reads the past from the cache (``model.KVCache``, written in place).

Batched prompts are left-padded (pad tokens first, ``attention_mask`` 0 there): every row's next token
then sits in the same column. Position ids count real tokens only (the cumulative sum of the mask, as
transformers does), so a padded row sees the positions it would see alone; relative position biases
(T5, ALiBi) depend only on distances, which padding does not change.

Stop strings follow transformers' ``stop_strings``: a row stops at the first step after which the text
of its new tokens contains one of the strings; the string (and the rest of the token that completed it)
stays in the output. Unlike transformers, text the prompt ends with never counts towards a match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..config import ConfigError
from ..model import KVCache
from ..model.cache import StaticKVCache
from ..model.fast.decode_step import FlatDecoder
from ..model.layout import layout_of
from .beam import beam_search

__all__ = ["generate", "GenerationError"]


class GenerationError(ConfigError):
    """Bad generation arguments: the message names the argument, its value and what was expected (a
    ConfigError, so the command line reports it as an error rather than a traceback)."""


# ---------------------------------------------------------------------------------------------
# the model, one step at a time
# ---------------------------------------------------------------------------------------------
class Runner:
    """Feeds a model the tokens it has not seen yet and returns next-token logits.

    Holds the token ids so far (``ids``, (B, length)), the attention mask and position ids of a
    left-padded decoder batch, the encoder output of an encoder-decoder, and the KV cache.
    """

    def __init__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                 max_new_tokens: int, use_cache: bool, decoder_start: int, static_cache: bool = False,
                 compile: bool = False, layout=None):
        self.model = model
        self.layout = layout or layout_of(model.config)
        self.enc_dec = self.layout.encoder_decoder
        B, T = input_ids.shape
        dev = input_ids.device
        padded = attention_mask is not None and not bool(attention_mask.all())
        self.source = input_ids  # encoder-decoders: the encoder input, encoded at the first step
        self.memory = self.memory_mask = None  # its encoder output (B, S, dim) and mask (B, S) from then on
        self.mask = self.positions = self.count = None
        if self.enc_dec:
            self.memory_mask = attention_mask if padded else None
            prompt = torch.full((B, 1), decoder_start, dtype=torch.long, device=dev)
        else:
            prompt = input_ids
            if padded:  # left padding: a mask that grows by a 1 per step, positions from its cumsum
                width = T + max_new_tokens
                self.mask = torch.ones(B, width, dtype=torch.long, device=dev)
                self.mask[:, :T] = attention_mask
                self.positions = torch.zeros(B, width, dtype=torch.long, device=dev)
                self.positions[:, :T] = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # pads: 0, masked anyway
                self.count = attention_mask.sum(-1)  # (B,) real tokens = the next position
        self.prompt_len = prompt.shape[1]
        self.ids = torch.empty(B, self.prompt_len + max_new_tokens, dtype=torch.long, device=dev)
        self.ids[:, : self.prompt_len] = prompt
        self.length = self.prompt_len  # columns of ids in use
        self.fed = 0  # columns the cache has seen
        self.step = None  # the compiled decoding step (compile=True)
        self.stepped = False  # whether it ran (with its guards checked) for this runner
        if static_cache or compile:  # fixed shapes: every step after the prompt is the same computation
            capacity = _static_capacity(self.prompt_len + max_new_tokens)
            key_mask = None
            if self.mask is not None:
                key_mask = torch.ones(B, capacity, dtype=torch.bool, device=dev)
                key_mask[:, :T] = attention_mask.bool()
            self.cache = StaticKVCache(capacity, device=dev, key_mask=key_mask)
            model.transformer.decoder.position.reserve(capacity)
            if compile:
                self.step = _compiled_step(dev)
        else:
            self.cache = model.new_cache(self.prompt_len + max_new_tokens) if use_cache else None
        # eager steps after the prompt with a growing cache: a flat loop over the layers where the model allows one
        # (the same logits); built at the first such step, after the prompt filled the stacked-weight caches
        self.flat_ok = isinstance(self.cache, KVCache) and not self.enc_dec
        self.flat: FlatDecoder | None = None

    def logits(self) -> torch.Tensor:
        """Next-token logits (B, vocab) in fp32 after the tokens so far."""
        start = self.fed if self.cache is not None else 0
        x = self.ids[:, start: self.length]
        static = isinstance(self.cache, StaticKVCache)
        # the prompt runs eagerly (its own shape); every later step through the compiled step, if any
        forward = _last_logits
        if self.step is not None and self.fed > 0:
            forward = self._unguarded if self.stepped else self._first_step
            self.stepped = True
        if self.enc_dec:
            if self.memory is None:
                out = self.model(self.source, self.memory_mask, decoder_input_ids=x, past_key_values=self.cache,
                                 use_cache=self.cache is not None, logits_to_keep=1)
                self.memory = out.encoder_last_hidden_state  # encoded once, reused by every later step
                logits = out.logits[:, -1]
            else:
                logits = forward(self.model, self.source, self.memory_mask, decoder_input_ids=x.contiguous(),
                                 encoder_hidden_states=self.memory, past_key_values=self.cache,
                                 use_cache=self.cache is not None, logits_to_keep=1)
        else:
            mask = None if self.mask is None or static else self.mask[:, : self.length]  # static: the cache's
            pos = None if self.positions is None else self.positions[:, start: self.length].contiguous()
            if self.flat_ok and start > 0 and x.shape[1] == 1 and self.flat is None:
                self.flat = FlatDecoder.of(self.model)
                self.flat_ok = self.flat is not None
            if self.flat_ok and start > 0 and x.shape[1] == 1:
                logits = self.flat.step(x.contiguous(), self.cache, mask, pos)
            else:
                extra = self.layout.prompt_kwargs(self.ids[:, : self.prompt_len]) if start == 0 else {}  # prefix LM
                logits = forward(self.model, x.contiguous(), mask, position_ids=pos, past_key_values=self.cache,
                                 use_cache=self.cache is not None, logits_to_keep=1, **extra)
        self.fed = self.length
        return logits.float()

    def _first_step(self, *args, **kwargs) -> torch.Tensor:
        """The compiled step with its guards checked: compiles when no compiled graph fits these inputs."""
        try:
            return self.step(*args, **kwargs)
        except Exception as e:  # e.g. no C++ compiler, or an operator inductor cannot lower
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise GenerationError(f"compile=True: torch.compile failed ({type(e).__name__}: {first}); generate "
                                  "without compile (on the CPU inductor needs a C++ compiler such as g++)") from e

    def _unguarded(self, *args, **kwargs) -> torch.Tensor:
        """The compiled step without re-checking torch.compile's guards (~1 ms per step on SmolLM2). Safe here:
        this runner's first compiled step checked them all (and compiled if nothing matched), and every later
        step passes the same model and the same kinds of tensors (shapes, dtypes and strides fixed by the static
        cache; beam search's reorder keeps them)."""
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self.step(*args, **kwargs)

    def append(self, tokens: torch.Tensor) -> None:
        """Add one token per row, (B,)."""
        self.ids[:, self.length] = tokens
        if self.positions is not None:
            self.positions[:, self.length] = self.count
            self.count += 1
        self.length += 1

    def reorder(self, index: torch.Tensor, *, same_source: bool) -> None:
        """Keep rows ``index`` (B_new,). ``same_source``: every row stays with copies of its own prompt
        (beam search), so encoder outputs and cross-attention caches need no reordering."""
        self.ids = self.ids.index_select(0, index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
            self.positions = self.positions.index_select(0, index)
            self.count = self.count.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index, cross=not same_source)
        if self.enc_dec and not same_source:
            self.source = self.source.index_select(0, index)
            if self.memory is not None:
                self.memory = self.memory.index_select(0, index)
            if self.memory_mask is not None:
                self.memory_mask = self.memory_mask.index_select(0, index)

    def output(self) -> torch.Tensor:
        return self.ids[:, : self.length]


def _static_capacity(n: int) -> int:
    """Columns of a static cache for n tokens: the next power of two, at least 64, so that prompts and lengths
    that differ share one compiled step (a handful of capacities cover every length; the extra masked columns
    cost little next to the weight reads of a decoding step)."""
    return max(64, 1 << (n - 1).bit_length())


def _last_logits(model, *args, **kwargs) -> torch.Tensor:
    """The model's LM logits at the last position, (B, vocab)."""
    return model(*args, **kwargs).logits[:, -1]


def _last_logits_cpp(model, *args, **kwargs) -> torch.Tensor:  # the same, compiled with other options (CPU)
    return model(*args, **kwargs).logits[:, -1]


_COMPILED: dict[str, Callable] = {}


def _compiled_step(device: torch.device) -> Callable:
    """``_last_logits`` under ``torch.compile`` for one device type, created once per process: a decoding step
    over a StaticKVCache has the same shapes every time, so it compiles once per (model, batch, capacity) and
    then runs without Python overhead per operation. On the CPU the compiled graph is called through inductor's
    C++ wrapper (``cpp_wrapper``), which takes most of the remaining per-step launch cost away."""
    kind = device.type
    if kind not in _COMPILED:
        if kind == "cpu":
            _COMPILED[kind] = torch.compile(_last_logits_cpp, dynamic=False, options={"cpp_wrapper": True})
        else:
            _COMPILED[kind] = torch.compile(_last_logits, dynamic=False)
    return _COMPILED[kind]


# ---------------------------------------------------------------------------------------------
# logits processing (the order of transformers' processors: min length, temperature, top-k, top-p)
# ---------------------------------------------------------------------------------------------
class Scorer:
    """Turns logits into the scores tokens are chosen from: EOS forbidden before ``min_new_tokens``; a forced first
    token (after a one-token start) and a forced last token (the one that reaches ``max_new_tokens``), as
    transformers' ForcedBOS/ForcedEOS processors; when sampling, temperature, then top-k, then top-p (nucleus)
    filtering."""

    def __init__(self, *, eos: list[int], min_new_tokens: int, do_sample: bool, temperature: float,
                 top_k: int | None, top_p: float | None, min_keep: int = 1, forced_bos: int | None = None,
                 forced_eos: list[int] | None = None, prompt_len: int = 1, max_new_tokens: int = 0):
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.min_new_tokens = min_new_tokens if eos else 0
        self.forced_bos = forced_bos if prompt_len == 1 else None  # only when the start is one token (BART's </s>)
        self.forced_eos = forced_eos or None
        self.last = max_new_tokens - 1  # the step whose token reaches max_new_tokens
        self.temperature = temperature if do_sample and temperature != 1.0 else None
        self.top_k = top_k if do_sample and top_k else None
        self.top_p = top_p if do_sample and top_p is not None and top_p < 1.0 else None
        self.min_keep = min_keep  # beam sampling keeps len(eos) + 1 tokens so a beam can continue

    def __call__(self, scores: torch.Tensor, n_new: int) -> torch.Tensor:
        """scores: (N, vocab) logits or log-probs; n_new: tokens generated so far."""
        if n_new < self.min_new_tokens:
            if self.eos.device != scores.device:
                self.eos = self.eos.to(scores.device)
            scores = scores.index_fill(1, self.eos, float("-inf"))
        if self.forced_bos is not None and n_new == 0:
            scores = _only(scores, [self.forced_bos])
        if self.forced_eos is not None and n_new == self.last:
            scores = _only(scores, self.forced_eos)
        if self.temperature is not None:
            scores = scores / self.temperature
        if self.top_k is not None:
            k = min(max(self.top_k, self.min_keep), scores.shape[-1])
            kth = torch.topk(scores, k, dim=-1).values[:, -1:]  # (N, 1) the k-th largest score
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None:
            # drop the least likely tokens whose total probability is at most 1 - top_p (Holtzman et al. 2020)
            ascending, order = torch.sort(scores, dim=-1)
            cum = ascending.softmax(-1).cumsum(-1)
            drop = cum <= 1 - self.top_p
            drop[:, -self.min_keep:] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        return scores


def _only(scores: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Scores (N, vocab) that allow only ``tokens``: 0 for them, -inf for every other token."""
    out = torch.full_like(scores, float("-inf"))
    out[:, tokens] = 0.0
    return out


class StopStrings:
    """Whether the text of a row's new tokens contains a stop string. Only the last few tokens are
    decoded: a string of L characters ends within the last 4 * L tokens (a character is at most 4
    bytes, a byte-level token at least one), and the check runs after every token."""

    def __init__(self, stops: Sequence[str], tokenizer, start: int):
        self.stops = list(stops)
        self.decode = tokenizer.decode
        self.start = start  # first column of the new tokens
        self.window = 4 * max(len(s) for s in self.stops) + 2

    def __call__(self, row: torch.Tensor | list[int], end: int) -> bool:
        """row: token ids of one sequence; end: its length so far."""
        ids = row[max(self.start, end - self.window): end]
        text = self.decode(ids.tolist() if isinstance(ids, torch.Tensor) else list(ids))
        return any(s in text for s in self.stops)


# ---------------------------------------------------------------------------------------------
# greedy and sampling
# ---------------------------------------------------------------------------------------------
def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` (B, V) drawn with its probability: the first token whose cumulative
    probability passes a uniform draw scaled to the row's total (inverse-CDF sampling). ``torch.multinomial`` draws
    one exponential variate per vocabulary entry for this (its without-replacement path): measured on 2 cores of an
    AMD EPYC, 24 ms for 32 rows of SmolLM2's 49152 tokens against 2.5 ms for the cumulative sum and search, one
    uniform per row. A token of probability 0 (cut by top-k / top-p, or a forbidden EOS) is never drawn: the search
    takes the first cumulative sum strictly above the draw, and the draw stays strictly below the row's total."""
    cdf = probs.float().cumsum(-1)  # (B, V), non-decreasing (in fp32 at least)
    total = cdf[:, -1:]
    draw = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype) * total
    draw = torch.minimum(draw, torch.nextafter(total, torch.zeros_like(total)))  # u * total may round up to total
    return torch.searchsorted(cdf, draw, right=True)[:, 0]


def _sample(runner: Runner, logits: torch.Tensor, scorer: Scorer, *, max_new_tokens: int, do_sample: bool,
            eos: list[int], pad: int, stop: StopStrings | None, streamer, generator) -> torch.Tensor:
    B = runner.ids.shape[0]
    finished = torch.zeros(B, dtype=torch.bool, device=runner.ids.device)
    eos_t = torch.tensor(eos, device=runner.ids.device) if len(eos) > 1 else None
    track = bool(eos) or stop is not None
    for step in range(max_new_tokens):
        scores = scorer(logits, step)
        if do_sample:
            nxt = _draw(scores.softmax(-1), generator)
        else:
            nxt = scores.argmax(-1)
        if track:
            nxt = nxt.masked_fill(finished, pad)  # a finished row gets padding
        runner.append(nxt)
        if streamer is not None:
            streamer(nxt.tolist())
        if track:
            if eos_t is not None:
                finished |= torch.isin(nxt, eos_t)
            elif eos:
                finished |= nxt == eos[0]
            if stop is not None:
                for i in (~finished).nonzero()[:, 0].tolist():
                    if stop(runner.ids[i], runner.length):
                        finished[i] = True
            if bool(finished.all()):
                break
        if step + 1 < max_new_tokens:
            logits = runner.logits()
    return runner.output()


# ---------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------
def _token_ids(value, name: str) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    ids = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise GenerationError(f"{name}={value!r}: expected a token id (int >= 0) or a list of them")
    return ids


def _tokenizer_id(tokenizer, role: str) -> int | None:
    """``tokenizer.<role>_id`` (pretune's Tokenizer) or ``.<role>_token_id`` (transformers')."""
    if tokenizer is None:
        return None
    found = getattr(tokenizer, f"{role}_id", None)
    return found if found is not None else getattr(tokenizer, f"{role}_token_id", None)


def _check(model, input_ids, attention_mask, *, layout, max_new_tokens, min_new_tokens, do_sample, temperature,
           top_k, top_p, num_beams, num_return_sequences, early_stopping, stop, tokenizer, streamer):
    cfg = model.config
    if not layout.writes_text or cfg.head != "lm":
        raise GenerationError(f"generation needs a decoder or encoder-decoder with an LM head, got arch={cfg.arch!r}, "
                              f"head={cfg.head!r}")
    for name, value, low in (("max_new_tokens", max_new_tokens, 0), ("min_new_tokens", min_new_tokens, 0),
                             ("num_beams", num_beams, 1), ("num_return_sequences", num_return_sequences, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise GenerationError(f"{name}={value!r}: expected an int >= {low}")
    if num_beams > 1 and num_return_sequences > num_beams:
        raise GenerationError(f"num_return_sequences={num_return_sequences} must be <= num_beams={num_beams} "
                              "(beam search returns its best finished beams)")
    if num_beams == 1 and not do_sample and num_return_sequences > 1:
        raise GenerationError(f"num_return_sequences={num_return_sequences} needs do_sample=True or num_beams >= "
                              f"{num_return_sequences} (greedy decoding has one answer per prompt)")
    if do_sample and not (isinstance(temperature, (int, float)) and temperature > 0):
        raise GenerationError(f"temperature={temperature!r}: expected a number > 0")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise GenerationError(f"top_k={top_k!r}: expected an int >= 1 (0 or None: off)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise GenerationError(f"top_p={top_p!r}: expected a number in (0, 1] (1 or None: off)")
    if early_stopping not in (True, False, "never"):
        raise GenerationError(f"early_stopping={early_stopping!r}: expected True, False or 'never'")
    if stop and tokenizer is None:
        raise GenerationError("stop strings need tokenizer= (the check is on the decoded text)")
    if stop and not all(isinstance(s, str) and s for s in stop):
        raise GenerationError(f"stop={stop!r}: expected non-empty strings")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise GenerationError("input_ids must be a LongTensor (B, T) (or (T,) for one prompt), got "
                              f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} of shape "
                              f"{tuple(getattr(input_ids, 'shape', ()))}")
    B, T = input_ids.shape
    in_decoder = not layout.encoder_decoder  # the prompt goes through the decoder (and its positions)
    if T == 0 and in_decoder:
        raise GenerationError("input_ids is empty: a decoder-only model needs at least one prompt token")
    if streamer is not None and (B != 1 or num_beams != 1 or num_return_sequences != 1):
        raise GenerationError(f"streamer needs one sequence (batch 1, num_beams 1, num_return_sequences 1), got "
                              f"batch {B}, num_beams {num_beams}, num_return_sequences {num_return_sequences}")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise GenerationError(f"attention_mask {tuple(attention_mask.shape)} must have the shape of input_ids "
                                  f"{tuple(input_ids.shape)}")
        if in_decoder and not bool(attention_mask[:, -1].all()):
            raise GenerationError("a decoder-only batch must be left-padded (attention_mask ends in 1 on every row); "
                                  "pad on the left so that each row's next token goes in the same column")
    if cfg.position == "learned":  # a fixed table of positions: the prompt and new tokens must fit in it
        rows = cfg.max_seq_len - cfg.position_offset
        prompt = int(attention_mask.sum(-1).max()) if attention_mask is not None else T
        need = (prompt + max_new_tokens - 1) if in_decoder else max_new_tokens
        if prompt > rows or need > rows:
            where = "prompt" if in_decoder else "decoder"
            raise GenerationError(
                f"the {where} needs {max(prompt, need)} positions (prompt {prompt} tokens, max_new_tokens "
                f"{max_new_tokens}) but the model's learned position table has {rows} (max_seq_len="
                f"{cfg.max_seq_len}); shorten the prompt or lower max_new_tokens")


def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stop: Sequence[str] | str | None = None,
    tokenizer=None,
    seed: int | None = None,
    use_cache: bool = True,
    streamer: Callable[[list[int]], None] | None = None,
    decoder_start_token_id: int | None = None,
    forced_bos_token_id: int | None = None,
    forced_eos_token_id: int | Sequence[int] | None = None,
    min_new_tokens: int = 0,
    static_cache: bool = False,
    compile: bool = False,
    layout: str | None = None,
) -> torch.Tensor:
    """Generate continuations of ``input_ids`` with a decoder-only or encoder-decoder ``TransformerLM``.

    Args:
        model: a TransformerLM with ``head="lm"`` (arch decoder or encoder-decoder). It runs in eval mode
            (dropout off) under ``torch.inference_mode``; its mode is restored afterwards.
        input_ids: (B, T) prompt token ids (encoder input for encoder-decoders), or (T,) for one prompt.
            Decoder-only batches are LEFT-padded.
        attention_mask: (B, T) 1 for real tokens, 0 for padding (None: no padding).
        max_new_tokens: tokens to generate at most (0 returns the prompt).
        min_new_tokens: EOS is forbidden until this many tokens exist.
        do_sample: sample from the distribution instead of taking the most likely token.
        temperature, top_k, top_p: sampling only: divide logits by ``temperature``; keep the ``top_k`` most
            likely tokens (None/0: all); keep the smallest set of tokens whose probability reaches ``top_p``
            (None/1.0: all). Applied in that order. (transformers' default top_k=50 is not applied here.)
        num_beams: > 1 for beam search (with ``do_sample``: beam sampling), as transformers' beam search.
        length_penalty: beam search: a finished beam scores sum(log p) / new_tokens ** length_penalty
            (> 0 favours longer sequences, < 0 shorter ones).
        early_stopping: beam search: True stops a prompt once num_beams beams have finished; False (default)
            stops when no running beam can still beat the worst finished one (judged at its current length);
            "never" judges at the longest possible length when length_penalty > 0.
        num_return_sequences: sequences per prompt: the best beams (<= num_beams), or independent samples.
        eos_token_id: token(s) that end a sequence (default: ``model.config.eos_token_id``, else the tokenizer's
            EOS; None anywhere: only max_new_tokens and stop strings end it).
        pad_token_id: what fills a row after it ends (default: the tokenizer's pad, else
            ``model.config.pad_token_id``). Beam search, like transformers', fills with the EOS id when
            pad_token_id is 0.
        stop: stop strings (needs ``tokenizer``): a row ends once its new text contains one; it stays in the output.
        tokenizer: pretune or transformers tokenizer: decodes for ``stop``; default EOS/pad ids.
        seed: seeds a private ``torch.Generator`` for sampling (reproducible; the global RNG is untouched).
            None: sampling uses the global RNG.
        use_cache: reuse keys/values of past tokens (False: rerun the whole sequence every step; same tokens).
        streamer: called after every step with the new token ids (a list of one id) of a single sequence.
        decoder_start_token_id: encoder-decoders: the first decoder token (default: the model config's).
        forced_bos_token_id: the first new token, when the sequence so far is one token (an encoder-decoder's
            start; bart-large, mBART) (default: the model config's; None there: not forced).
        forced_eos_token_id: token(s) the last possible new token (the one that reaches ``max_new_tokens``) must be
            (default: the model config's, BART: </s>; None there: not forced).
        static_cache: keep keys/values in a cache of fixed shape (``StaticKVCache``: capacity prompt +
            max_new_tokens rounded up to a power of two >= 64; every step attends over all of it with a mask)
            instead of the growing one: the same tokens up to floating-point rounding. What ``compile`` decodes
            with; on its own, for checking it.
        compile: decode with the fixed-shape cache and every step after the prompt through ``torch.compile``
            (inductor; on the CPU through its C++ wrapper, so a C++ compiler must be installed). The first call per
            (model, batch size, capacity) compiles for about a minute on a 135M model (seconds once inductor's
            on-disk cache has the kernels); later steps cost little beyond reading the weights. Worth it for long
            generations and repeated calls with the same shapes; the tokens are those of the eager path up to
            floating-point rounding.
        layout: decoder-only models: how the prompt is read, "causal" or "prefix_lm" (bidirectional over the
            prompt); default: as the model was pretrained (``config.decoder_layout``, see model/layout.py).

    Returns:
        LongTensor: decoder-only (B * num_return_sequences, T + n) = prompt + new tokens; encoder-decoder
        (B * num_return_sequences, 1 + n) = decoder start + new tokens; n <= max_new_tokens is the longest
        row's new-token count. Rows of one prompt are adjacent.
    """
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
        input_ids = input_ids[None]
        attention_mask = attention_mask[None] if attention_mask is not None else None
    if isinstance(stop, str):
        stop = [stop]
    stop = list(stop or [])
    text_layout = layout_of(model.config, layout)
    _check(model, input_ids, attention_mask, layout=text_layout, max_new_tokens=max_new_tokens,
           min_new_tokens=min_new_tokens,
           do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, num_beams=num_beams,
           num_return_sequences=num_return_sequences, early_stopping=early_stopping, stop=stop,
           tokenizer=tokenizer, streamer=streamer)
    for name, on in (("compile", compile), ("static_cache", static_cache)):
        if on and not use_cache:
            raise GenerationError(f"{name}=True needs use_cache=True (it decodes with a fixed-size key/value cache)")
        if on and model.transformer.decoder.extra_inputs is not None:
            raise GenerationError(f"{name}=True does not support prompt tuning (the soft prompt changes the "
                                  "decoder's length); generate without it")
    cfg = model.config
    if eos_token_id is None:
        eos_token_id = getattr(cfg, "eos_token_id", None)
    if eos_token_id is None:
        eos_token_id = _tokenizer_id(tokenizer, "eos")
    eos = _token_ids(eos_token_id, "eos_token_id") if eos_token_id is not None else []
    if pad_token_id is None:
        pad_token_id = _tokenizer_id(tokenizer, "pad")
    pad = pad_token_id if pad_token_id is not None else cfg.pad_token_id
    _token_ids(pad, "pad_token_id")
    start = decoder_start_token_id if decoder_start_token_id is not None else cfg.decoder_start_token_id
    if forced_bos_token_id is None:
        forced_bos_token_id = cfg.forced_bos_token_id
    forced_bos = _token_ids(forced_bos_token_id, "forced_bos_token_id") if forced_bos_token_id is not None else []
    if len(forced_bos) > 1:
        raise GenerationError(f"forced_bos_token_id={forced_bos_token_id!r}: expected one token id")
    if forced_eos_token_id is None:
        forced_eos_token_id = cfg.forced_eos_token_id
    forced_eos = _token_ids(forced_eos_token_id, "forced_eos_token_id") if forced_eos_token_id is not None else []
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    attention_mask = attention_mask.to(device) if attention_mask is not None else None
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            runner = Runner(model, input_ids, attention_mask, max_new_tokens=max_new_tokens, use_cache=use_cache,
                            decoder_start=start, static_cache=static_cache, compile=compile, layout=text_layout)
            stops = StopStrings(stop, tokenizer, runner.prompt_len) if stop else None
            if max_new_tokens == 0:
                return runner.output().clone()
            scorer = Scorer(eos=eos, min_new_tokens=min_new_tokens, do_sample=do_sample, temperature=temperature,
                            top_k=top_k, top_p=top_p, min_keep=len(eos) + 1 if num_beams > 1 else 1,
                            forced_bos=forced_bos[0] if forced_bos else None, forced_eos=forced_eos,
                            prompt_len=runner.prompt_len, max_new_tokens=max_new_tokens)
            logits = runner.logits()  # the prompt, run once per prompt
            copies = num_beams if num_beams > 1 else num_return_sequences
            if copies > 1:  # beams / samples of one prompt: adjacent copies of its row (and of its cache)
                rows = torch.arange(input_ids.shape[0], device=device).repeat_interleave(copies)
                runner.reorder(rows, same_source=False)
                logits = logits.index_select(0, rows)
            if num_beams > 1:
                return beam_search(runner, logits, scorer, num_beams=num_beams, max_new_tokens=max_new_tokens,
                                   eos=eos, pad=pad, length_penalty=length_penalty, early_stopping=early_stopping,
                                   num_return_sequences=num_return_sequences, do_sample=do_sample,
                                   generator=generator, stop=stops)
            return _sample(runner, logits, scorer, max_new_tokens=max_new_tokens, do_sample=do_sample, eos=eos,
                           pad=pad, stop=stops, streamer=streamer, generator=generator).clone()
    finally:
        model.train(was_training)
