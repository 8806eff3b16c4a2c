"""Continuous batching: one decoding loop serves many requests, each joining and leaving at any step.

``Engine(model, tokenizer)`` runs a thread that owns the model. ``engine.submit(seq)`` queues a :class:`Sequence`
(a prompt, its sampling settings, a callback); at its next step the loop prefills the prompt (the model's forward
on that prompt alone, into a key/value cache of its own) and from then on the sequence is one row of every
decoding step until it ends (EOS, a stop string, its token limit, or ``seq.cancel()``), when its row and cache go.

Batch invariance: a sequence's tokens are what it gets alone, whatever else shares the batch. It is designed in,
not hoped for:

* the prompt is prefilled alone (batch 1), into the sequence's own cache;
* a decoding step runs the projections and the LM head over all rows at once (the weights are read once per step:
  that is the batching's gain), but attention row by row, each row's query over its own cache (no padding, no
  mask over other rows' lengths), and the rotary tables, norms, sampling and stop checks are per row too;
* the matrix products are where batch size could change a row's rounding. CPU GEMMs pick kernels by shape: at one
  row MKL and oneDNN take a matrix-vector path that sums in another order than their matrix-matrix path, and MKL's
  matrix-matrix path also changes blocking between 3 and 4 rows. For a fixed shape a row's output depends only on
  that row (measured: any other rows, any position). So the step runs every product at ``rows`` =
  max(2, live rows) when every product goes through oneDNN (fp32 CPU, plain projections: oneDNN's result for a
  row is the same for every M >= 2, checked by ``tests/generation/test_batching.py``), and at a fixed
  ``max_batch`` rows otherwise (LoRA or other wrapped projections through ``F.linear``, bf16, GPUs): padding rows
  repeat row 0 and are dropped;
* sampling draws from a ``torch.Generator`` per sequence (``seed``; without one, a seed drawn at random), so no
  row's draw consumes another's random numbers.

What does not hold: the tokens equal ``pretune generate``'s for the same prompt only up to floating-point
rounding (``generate`` decodes one row through the matrix-vector path); greedy text is equal in the tests, but a
near-tie between two tokens could break the other way.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..model.attention import build_mask, cast_mask
from ..model.fast.decode_step import FlatDecoder, onednn_linear
from ..model.layout import layout_of
from .decode import GenerationError, Scorer, _draw

__all__ = ["Engine", "Sequence", "Token", "QueueFull", "RaggedStep"]


class QueueFull(GenerationError):
    """The engine's waiting queue is full: try again later."""


@dataclass
class Token:
    """One generated token as a sequence's callback sees it."""

    id: int
    logprob: float  # log-probability under the model (before temperature / top-p)
    top: list[tuple[int, float]]  # the ``top_logprobs`` most likely (id, log-prob), most likely first


@dataclass(eq=False)
class Sequence:
    """One row of the batch: a prompt and how to continue it.

    ``on_token(seq, token)`` is called from the engine's thread after each new token, ``on_end(seq, reason)``
    once at the end with ``"stop"`` (EOS or a stop string), ``"length"`` (``max_new_tokens``), ``"cancelled"`` or
    ``"error"`` (``seq.error`` says what). Neither may block.
    """

    prompt: list[int]
    max_new_tokens: int
    on_token: Callable[["Sequence", Token], None]
    on_end: Callable[["Sequence", str], None]
    temperature: float = 0.0  # 0: greedy (argmax); > 0: sample from softmax(logits / temperature)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # the sampling generator's seed (None: a random one)
    stop_ids: Seq[int] = ()  # token ids that end the sequence (EOS), kept out of the text
    stop: Callable[[list[int]], bool] | None = None  # called with the new ids after each token: True ends it
    logprobs: int = 0  # top log-probs to report per token (0: only the chosen token's)
    adapter: str | None = None  # the adapter routed to this row (None: the base model)
    # filled by the engine
    new: list[int] = field(default_factory=list)
    error: str | None = None
    cancelled: bool = False
    t_submit: float = 0.0
    t_first: float | None = None  # when the first token came (time to first token = t_first - t_submit)
    t_end: float | None = None
    _cache: object = None
    _scorer: Scorer | None = None
    _generator: torch.Generator | None = None
    _next: int | None = None  # the token chosen last, not yet fed to the model

    def cancel(self) -> None:
        """Ask the engine to drop this sequence at its next step (its row and cache are freed)."""
        self.cancelled = True


class RaggedStep:
    """One decoding step for rows of different lengths, each with its own ``KVCache`` (batch 1): the flat step of
    ``model.fast.decode_step`` with the products over all rows and attention per row (see the module docstring).
    ``RaggedStep.of(model)`` is None when ``FlatDecoder.of(model)`` is (the engine then runs each row through the
    model's forward)."""

    def __init__(self, flat: FlatDecoder, max_batch: int):
        self.flat = flat
        layers = flat.layers
        wrapped = any(layer.project is not None or layer.o is not None or layer.ffn is not None for layer in layers)
        # oneDNN's product gives a row the same value for every M >= 2 (see the module docstring); anything else:
        # one fixed M
        self.min_rows = 2 if flat.onednn and not wrapped and flat.head_wb is not None else max_batch

    @staticmethod
    def of(model, max_batch: int) -> RaggedStep | None:
        flat = FlatDecoder.of(model)
        if flat is None:
            return None
        for layer in flat.layers:  # a projection the flat step runs by a kernel of its own (not a weight matrix
            # or the module's forward) is one this step does not know: each row then runs the model's forward
            if (layer.project is None and getattr(layer, "qkv_w", None) is None) or (
                    layer.ffn is None and getattr(layer, "up_w", None) is None):
                return None
        weights, _ = flat._plain_weights(None)
        if any(len(w) != 6 for w in weights):  # the per-layer (o, up, down) weights and biases this step unpacks
            return None
        return RaggedStep(flat, max_batch)

    def __call__(self, tokens: list[int], caches: list, route=None) -> torch.Tensor:
        """tokens: each row's newest token; caches: each row's KVCache (the tokens before it); route: a context
        manager factory routing adapters per row (given the padded row count). Returns (len(tokens), vocab) fp32."""
        flat = self.flat
        stack = flat.stack
        R = len(tokens)
        M = max(R, self.min_rows)
        dev = flat.head_wb[0].device if flat.head_wb is not None else next(flat.model.parameters()).device
        ids = torch.tensor(tokens + [tokens[0]] * (M - R), device=dev).view(M, 1)
        lengths = [c.length for c in caches]
        pos = torch.tensor(lengths + [lengths[0]] * (M - R), device=dev).view(M, 1)  # (M, 1) each row's position
        with route(M) if route is not None else nullcontext():
            x = flat.embed(ids)  # (M, 1, dim)
            if stack.embed_scale is not None:
                x = x * torch.tensor(stack.embed_scale, dtype=x.dtype)
            x = stack.position.add(x, pos)
            rotations = (None, None)
            if stack.position.has_rotation:
                rotate = stack.position.rotation(pos)
                rotations = (rotate, rotate if stack.local_position is None else stack.local_position.rotation(pos))
            masks = [dict(q_len=1, k_len=n + 1, q_offset=n, causal=True, device=dev) for n in lengths]
            full = [build_mask(**m)[0] for m in masks]
            local = ([build_mask(**m, window=stack.window)[0] for m in masks]
                     if any(layer.local for layer in flat.layers) else full)
            gemv = flat.onednn and x.is_cpu and x.dtype == torch.float32 and not torch.is_grad_enabled()
            linear = onednn_linear if gemv else F.linear
            weights, head_wb = flat._plain_weights(None)
            for li, (layer, (o_w, o_b, up_w, up_b, down_w, down_b)) in enumerate(zip(flat.layers, weights)):
                rotate = rotations[layer.local]
                H, Hkv, dh = layer.heads, layer.kv_heads, layer.dh
                h = layer.norm1(x)
                if layer.project is None:  # fused q/k/v, head-major (M, H + 2 Hkv, 1, Dh)
                    y = linear(h, layer.qkv_w, layer.qkv_b)
                    y = y.view(M, -1, 1, dh) if rotate is None else rotate.step(y, H + Hkv, dh)
                    q, kv = y.narrow(1, 0, H), y.narrow(1, H, 2 * Hkv)
                    k = v = None
                else:  # the attention's own projection (LoRA, q/k norms): (M, H|Hkv, 1, Dh)
                    q, k, v = layer.project(h)
                    if rotate is not None:
                        q, k = rotate(q, k, pos)
                outs = []
                for i in range(R):  # attention row by row, over the row's own cache
                    lc = caches[i].layer(li)
                    if k is None:
                        if hasattr(lc, "write_heads"):  # FastKVCache: one copy into its token-major buffer
                            ki, vi = lc.write_heads(kv[i: i + 1])
                        else:
                            ki, vi = lc.append(kv[i: i + 1, :Hkv], kv[i: i + 1, Hkv:])
                    else:
                        ki, vi = lc.append(k[i: i + 1], v[i: i + 1])
                    mask = (local if layer.local else full)[i]
                    if mask is not None and mask.dtype != q.dtype:
                        mask = cast_mask(mask, q.dtype)
                    outs.append(layer.attend(q[i: i + 1], ki, vi, mask, False))  # (1, H, 1, Dh)
                outs += [outs[0]] * (M - R)
                a = torch.cat(outs).reshape(M, 1, H * dh)
                a = linear(a, o_w, o_b) if layer.o is None else layer.o(a)
                if layer.post1 is not None:
                    a = layer.post1(a)
                a = a if layer.drop1 is None else layer.drop1(a)
                x = x + a
                h = layer.norm2(x)
                if layer.ffn is not None:
                    h = layer.ffn(h)
                else:
                    h = linear(h, up_w, up_b)
                    if layer.gated:
                        gate, up = h.chunk(2, dim=-1)
                        h = layer.act(gate) * up
                    else:
                        h = layer.act(h)
                    h = linear(h, down_w, down_b)
                if layer.post2 is not None:
                    h = layer.post2(h)
                h = h if layer.drop2 is None else layer.drop2(h)
                x = x + h
            if flat.norm is not None:
                x = flat.norm(x)
            logits = linear(x, *head_wb) if head_wb is not None and gemv else flat.head(x)
        return logits[:R, -1].float()


class Engine:
    """The decoding loop (a daemon thread) that every request shares.

    Args:
        model: a decoder-only TransformerLM with an LM head, in eval mode, frozen.
        max_batch: rows decoded together at most; more sequences wait in the queue.
        max_queue: sequences waiting at most; ``submit`` raises :class:`QueueFull` beyond.
        max_tokens: server-wide budget: the sum over running rows of prompt + ``max_new_tokens`` (the cache room
            they may take); a sequence waits until its own fits. A sequence needing more than all of it is refused.
        route: ``route(names)`` -> a context manager that routes adapter ``names[i]`` to row i (``peft.route``);
            needed when sequences name adapters.
    """

    def __init__(self, model, *, max_batch: int = 16, max_queue: int = 64, max_tokens: int = 65536,
                 route: Callable | None = None):
        layout = layout_of(model.config)
        if layout.name != "causal" or model.config.head != "lm":
            raise GenerationError(f"continuous batching serves decoder-only models with an LM head (causal layout); "
                                  f"got layout {layout.name!r}, head {model.config.head!r}")
        if max_batch < 1 or max_queue < 0 or max_tokens < 1:
            raise GenerationError(f"max_batch ({max_batch}) and max_tokens ({max_tokens}) must be >= 1, max_queue "
                                  f"({max_queue}) >= 0")
        self.model, self.max_batch, self.max_queue, self.max_tokens = model, max_batch, max_queue, max_tokens
        self.route = route
        self.step_fn = RaggedStep.of(model, max_batch)
        self.device = next(model.parameters()).device
        self._waiting: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue[tuple[Callable, Future]] = queue.SimpleQueue()
        self._n_waiting = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.running: list[Sequence] = []
        self.peak = 0  # the most rows one step has decoded (tests and /health)
        self._thread = threading.Thread(target=self._loop, name="pretune-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the requests' side
    def submit(self, seq: Sequence) -> None:
        """Queue ``seq``; raises QueueFull when ``max_queue`` sequences wait, GenerationError when it can never
        fit the token budget."""
        need = len(seq.prompt) + seq.max_new_tokens
        if need > self.max_tokens:
            raise GenerationError(f"the request needs {need} tokens of cache (prompt {len(seq.prompt)} + max tokens "
                                  f"{seq.max_new_tokens}) but the server's budget is {self.max_tokens}")
        if not seq.prompt:
            raise GenerationError("the prompt is empty: a decoder-only model needs at least one token")
        with self._lock:
            if self._n_waiting >= self.max_queue:
                raise QueueFull(f"{self._n_waiting} requests are waiting (--max-queue {self.max_queue})")
            self._n_waiting += 1
        seq.t_submit = time.perf_counter()
        self._waiting.put(seq)
        self._wake.set()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` on the engine's thread between two steps (the model is the loop's: scoring a prompt or
        embedding text goes through here); the returned Future holds its result or exception."""
        done: Future = Future()
        self._jobs.put((fn, done))
        self._wake.set()
        return done

    @property
    def load(self) -> dict:
        return {"running": len(self.running), "waiting": self._n_waiting, "peak_batch": self.peak}

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        pending: list[Sequence] = []
        while not self._stop:
            while True:
                try:
                    pending.append(self._waiting.get_nowait())
                except queue.Empty:
                    break
            while True:
                try:
                    fn, done = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if done.set_running_or_notify_cancel():
                    try:
                        with torch.inference_mode():
                            done.set_result(fn())
                    except Exception as e:
                        done.set_exception(e)
            pending = self._admit(pending)
            self.running = [s for s in self.running if not self._dropped(s)]
            if not self.running:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self._step()
            except Exception as e:  # never a dead loop: fail the running rows, keep serving
                for s in self.running:
                    self._end(s, "error", f"{type(e).__name__}: {e}")
                self.running = []

    def _dropped(self, s: Sequence) -> bool:
        if s.cancelled and s.t_end is None:
            self._end(s, "cancelled")
        return s.t_end is not None

    def _admit(self, pending: list[Sequence]) -> list[Sequence]:
        """Prefill waiting sequences (in order) while rows and the token budget allow; return those still waiting."""
        used = sum(len(s.prompt) + s.max_new_tokens for s in self.running)
        left = []
        for s in pending:
            if s.cancelled:
                with self._lock:
                    self._n_waiting -= 1
                self._end(s, "cancelled")
                continue
            need = len(s.prompt) + s.max_new_tokens
            if left or len(self.running) >= self.max_batch or used + need > self.max_tokens:
                left.append(s)  # first come, first served: nobody overtakes a waiting sequence
                continue
            with self._lock:
                self._n_waiting -= 1
            try:
                self._prefill(s)
            except Exception as e:
                self._end(s, "error", f"{type(e).__name__}: {e}")
                continue
            used += need
            if s.t_end is None:
                self.running.append(s)
        return left

    def _routing(self, names: list[str | None]):
        if all(n is None for n in names) or self.route is None:
            return nullcontext()
        return self.route(names)

    @torch.inference_mode()
    def _prefill(self, s: Sequence) -> None:
        s._scorer = Scorer(eos=list(s.stop_ids), min_new_tokens=0, do_sample=s.temperature > 0,
                           temperature=s.temperature or 1.0, top_k=s.top_k, top_p=s.top_p)
        if s.temperature > 0:
            seed = s.seed if s.seed is not None else random.SystemRandom().randrange(2 ** 63)
            s._generator = torch.Generator(self.device).manual_seed(seed)
        s._cache = self.model.new_cache(len(s.prompt) + s.max_new_tokens)
        ids = torch.tensor([s.prompt], device=self.device)
        with self._routing([s.adapter]):
            logits = self.model(ids, None, past_key_values=s._cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        self._choose(s, logits.float())

    @torch.inference_mode()
    def _step(self) -> None:
        rows = self.running
        self.peak = max(self.peak, len(rows))
        names = [s.adapter for s in rows]
        if self.step_fn is not None:
            route = None
            if any(n is not None for n in names):
                def route(m):
                    return self._routing(names + [None] * (m - len(names)))
            logits = self.step_fn([s._next for s in rows], [s._cache for s in rows], route)
        else:  # a model the flat step does not know: each row through the model's forward, alone
            out = []
            for s in rows:
                with self._routing([s.adapter]):
                    ids = torch.tensor([[s._next]], device=self.device)
                    out.append(self.model(ids, None, past_key_values=s._cache, use_cache=True,
                                          logits_to_keep=1).logits[:, -1])
            logits = torch.cat(out).float()
        for i, s in enumerate(rows):
            if not s.cancelled:
                self._choose(s, logits[i: i + 1])

    def _choose(self, s: Sequence, logits: torch.Tensor) -> None:
        """Pick ``s``'s next token from its logits (1, vocab), report it, and end ``s`` if it is done."""
        scores = s._scorer(logits, len(s.new))
        if s.temperature > 0:
            token = int(_draw(scores.softmax(-1), s._generator)[0])
        else:
            token = int(scores.argmax(-1)[0])
        logp = logits.log_softmax(-1)[0]
        top = []
        if s.logprobs:
            values, idx = logp.topk(min(s.logprobs, logp.shape[0]))
            top = list(zip(idx.tolist(), values.tolist()))
        if s.t_first is None:
            s.t_first = time.perf_counter()
        s._next = token
        s.new.append(token)
        eos = token in s.stop_ids
        try:
            s.on_token(s, Token(token, float(logp[token]), top))
        except Exception as e:  # a callback must not take the loop down
            self._end(s, "error", f"{type(e).__name__}: {e}")
            return
        if eos or (s.stop is not None and s.stop(s.new)):
            self._end(s, "stop")
        elif len(s.new) >= s.max_new_tokens:
            self._end(s, "length")

    def _end(self, s: Sequence, reason: str, error: str | None = None) -> None:
        if s.t_end is not None:
            return
        s.t_end = time.perf_counter()
        s.error = error
        s._cache = None  # the rows' memory goes with it
        try:
            s.on_end(s, reason)
        except Exception:  # the callback's own failure must not stop the loop
            pass
