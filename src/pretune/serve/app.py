"""``pretune serve``: a model behind the OpenAI HTTP API (FastAPI + uvicorn), decoding through one shared
continuous-batching loop (``pretune.generation.batching.Engine``).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/embeddings`` (encoder models). Every error is OpenAI's ``{"error": {...}}`` with its status; a request
the server cannot serve never takes it down. One log line per request (logger ``pretune.serve``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import Request
from fastapi.responses import StreamingResponse

from ..config import ConfigError
from ..generation.batching import Engine, QueueFull, Sequence, Token
from ..generation.decode import GenerationError
from ..generation.prompt import PromptError, load_chat_template
from ..model.layout import layout_of
from . import protocol as P
from .protocol import ApiError

log = logging.getLogger("pretune.serve")


@dataclass
class Limits:
    """What one request and the whole server may take."""

    max_batch: int = 16  # rows decoded together (--max-batch)
    max_queue: int = 64  # requests waiting for a row at most; more get 429 (--max-queue)
    max_request_tokens: int = 2048  # new tokens one choice may ask for (--max-tokens-per-request)
    max_total_tokens: int = 65536  # prompt + new tokens of all running rows (--max-total-tokens)
    max_body_bytes: int = 1 << 20  # request body size (--max-body-bytes); larger: 413


class Server:
    """The loaded model, its tokenizer and chat template, the adapters by name, the engine."""

    def __init__(self, loaded, *, name: str | None = None, adapters: dict[str, str] | None = None,
                 limits: Limits | None = None, api_key: str | None = None, quantize: str | None = None):
        self.limits = limits or Limits()
        self.api_key = api_key
        self.model = loaded.model.eval().requires_grad_(False)
        self.tok = loaded.tokenizer
        self.name = name or Path(loaded.path).name
        self.family = _family(loaded)
        self.adapters = {}  # request name -> adapter name in the model
        if adapters:
            from ..peft import load_adapter

            for alias, folder in adapters.items():
                if alias == self.name:
                    raise ConfigError(f"--adapter {alias}={folder}: the name is the base model's; pick another")
                self.adapters[alias] = load_adapter(self.model, folder, name=alias, activate=False)
        self.quantized = quantize
        if quantize is not None:  # after the adapters: their wrappers keep fp32 LoRA weights over quantised bases
            from ..model import quantize as quantize_model

            if not self.generates_text(loaded):
                raise ConfigError(f"--quantize {quantize} is for decoding; {loaded.path} does not generate text")
            quantize_model(self.model, quantize)
        cfg = self.model.config
        self.layout = layout_of(cfg)
        self.generates = self.generates_text(loaded)
        if not self.generates and self.layout.writes_text:
            raise ConfigError(f"pretune serve decodes decoder-only models; {loaded.path} is {self.layout.name} "
                              f"(arch {cfg.arch}): use pretune generate for it")
        try:
            self.chat_source = load_chat_template(loaded.folders) if self.generates else None
        except PromptError:
            self.chat_source = None
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else self.tok.eos_id
        self.eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.context = int(cfg.max_seq_len)
        self.engine = None
        if self.generates:
            route = None
            if self.adapters:
                from ..peft import route as peft_route

                def route(names):
                    return peft_route(self.model, names)
            self.engine = Engine(self.model, max_batch=self.limits.max_batch, max_queue=self.limits.max_queue,
                                 max_tokens=self.limits.max_total_tokens, route=route)

    # ---------------------------------------------------------------------------------------- helpers
    @staticmethod
    def generates_text(loaded) -> bool:
        return layout_of(loaded.model.config).name == "causal" and loaded.model.config.head == "lm"

    def card(self) -> dict:
        """What the model is: family, parameters, precision (GET /v1/models' entries carry it)."""
        cfg = self.model.config
        p = next(self.model.parameters())
        return {"family": self.family, "arch": cfg.arch, "layers": cfg.n_layers, "dim": cfg.dim,
                "vocab_size": cfg.vocab_size,
                "context": self.context, "parameters": sum(t.numel() for t in self.model.parameters()),
                "dtype": str(p.dtype).replace("torch.", ""), "quantized": self.quantized,
                "chat_template": self.chat_source is not None}

    def adapter_of(self, body: dict) -> str | None:
        model = body.get("model")
        if model is None:
            raise P.bad("'model' is required", "model", "missing_required_parameter")
        if not isinstance(model, str):
            raise P.bad(f"'model' must be a string, got {P._typename(model)}", "model", "invalid_type")
        if model == self.name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        raise ApiError(404, f"the model {model!r} does not exist; this server has {[self.name, *self.adapters]}",
                       param="model", code="model_not_found")

    def budget(self, n_prompt: int, max_tokens: int | None) -> int:
        """The new tokens a choice may take: max_tokens checked against the context and the per-request limit."""
        room = self.context - n_prompt
        if room < 1 and max_tokens != 0:
            raise P.bad(f"this model's maximum context length is {self.context} tokens; the prompt has {n_prompt} "
                        "(no room for a new token)", "messages", "context_length_exceeded")
        if max_tokens is None:
            return min(room, self.limits.max_request_tokens)
        if max_tokens > self.limits.max_request_tokens:
            raise P.bad(f"'max_tokens' {max_tokens} is above this server's limit of {self.limits.max_request_tokens} "
                        "per request (--max-tokens-per-request)", "max_tokens", "invalid_value")
        if n_prompt + max_tokens > self.context:
            raise P.bad(f"this model's maximum context length is {self.context} tokens; the prompt has {n_prompt} "
                        f"and max_tokens asks for {max_tokens} more", "max_tokens", "context_length_exceeded")
        return max_tokens

    def token_text(self, i: int) -> str:
        return self.tok.decode([i])


def _family(loaded) -> str:
    """The model's family for the model card: a Hugging Face folder's model_type (an adapter's base's), else
    "pretune"."""
    for folder in (loaded.path, loaded.base):
        config = Path(folder or "") / "config.json"
        if folder is not None and config.is_file():
            try:
                kind = json.loads(config.read_text(encoding="utf-8")).get("model_type")
            except (OSError, ValueError):
                kind = None
            if isinstance(kind, str):
                return kind
    return "pretune"


# ------------------------------------------------------------------------------------------------ one request's run
@dataclass
class Choice:
    """One sequence's text as it grows: what has been sent, what is held back (a possible start of a stop string,
    an incomplete character), the final text (cut before the stop string, EOS left out)."""

    server: Server
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)
    sent: int = 0  # characters of the text already handed out
    finish: str | None = None
    error: str | None = None

    def full(self) -> str:
        ids = self.ids[:-1] if self.ids and self.ids[-1] in self.server.eos else self.ids
        return self.server.tok.decode(ids, skip_special_tokens=True)

    def final_text(self) -> str:
        text = self.full()
        cuts = [text.find(s) for s in self.stops if s in text]
        return text[: min(cuts)] if cuts else text

    def delta(self) -> str:
        """New text that can be handed out now."""
        text = self.full()
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts:  # a stop string is complete: the text ends before it
            end = min(cuts)
        else:
            end = len(text.rstrip("\ufffd"))  # an incomplete character waits for its next token
            hold = 0
            for s in self.stops:  # the longest tail that may start a stop string waits
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[end - k: end] == s[:k]:
                        hold = max(hold, k)
                        break
            end -= hold
        out = text[self.sent: end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def last_delta(self) -> str:
        text = self.final_text()
        out = text[self.sent:] if len(text) > self.sent else ""
        self.sent = len(text)
        return out


class Run:
    """The sequences of one request (n choices of one or more prompts) and the events they send to its handler."""

    def __init__(self, server: Server, prompts: list[list[int]], s: P.Sampling, adapter: str | None, budget: list[int]):
        self.server, self.sampling = server, s
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.choices: list[Choice] = []
        self.seqs: list[Sequence] = []
        stops = s.stop
        tok = server.tok
        for p, prompt in enumerate(prompts):
            for j in range(s.n):
                index = len(self.choices)
                self.choices.append(Choice(server, stops))
                stop = None
                if stops:
                    def stop(new, stops=stops):
                        text = tok.decode(new, skip_special_tokens=True)
                        return any(x in text for x in stops)
                seed = None if s.seed is None else s.seed + j  # choice j of a seeded request: seed + j
                self.seqs.append(Sequence(
                    prompt=prompt, max_new_tokens=budget[p], temperature=s.temperature, top_p=s.top_p, seed=seed,
                    stop_ids=server.eos, stop=stop, logprobs=s.logprobs or 0, adapter=adapter,
                    on_token=lambda seq, t, i=index: self._post(i, "token", t),
                    on_end=lambda seq, reason, i=index: self._post(i, "end", (reason, seq.error))))
        self.t0 = time.perf_counter()

    def _post(self, i: int, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (i, kind, payload))
        except RuntimeError:  # the event loop is gone (shutting down)
            pass

    def submit(self) -> None:
        engine = self.server.engine
        try:
            for seq in self.seqs:
                engine.submit(seq)
        except QueueFull as e:
            self.cancel()
            raise ApiError(429, f"the server is busy: {e}; retry shortly", type="rate_limit_exceeded",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except GenerationError as e:
            self.cancel()
            raise P.bad(str(e), "max_tokens", "context_length_exceeded") from None

    def cancel(self) -> None:
        for seq in self.seqs:
            seq.cancel()

    async def next(self):
        """(choice index, kind, payload), or None after 0.5 s with nothing new."""
        try:
            return await asyncio.wait_for(self.events.get(), 0.5)
        except asyncio.TimeoutError:
            return None

    def handle(self, event) -> tuple[int, list[Token], bool]:
        """Apply an event; returns (choice, its new tokens, whether it ended)."""
        i, kind, payload = event
        c = self.choices[i]
        if kind == "token":
            c.ids.append(payload.id)
            c.tokens.append(payload)
            return i, [payload], False
        reason, error = payload
        c.finish = {"cancelled": "stop"}.get(reason, reason)
        c.error = error
        return i, [], True

    def stats(self) -> dict:
        firsts = [s.t_first for s in self.seqs if s.t_first is not None]
        n_out = sum(len(s.new) for s in self.seqs)
        ttft = (min(firsts) - self.t0) if firsts else None
        dt = time.perf_counter() - self.t0
        return {"prompt_tokens": sum(len(s.prompt) for s in self.seqs[:: self.sampling.n]), "completion_tokens": n_out,
                "ttft": ttft, "tps": n_out / dt if dt > 0 else 0.0}


def log_line(rid: str, path: str, status: int, model: str, stats: dict | None = None, note: str = "") -> None:
    parts = [rid, path, str(status), f"model={model}"]
    if stats:
        ttft = "-" if stats["ttft"] is None else f"{stats['ttft']:.3f}s"
        parts += [f"in={stats['prompt_tokens']}", f"out={stats['completion_tokens']}", f"ttft={ttft}",
                  f"{stats['tps']:.1f} tok/s"]
    if note:
        parts.append(note)
    log.info(" ".join(parts))


# ------------------------------------------------------------------------------------------------ the app's parts
async def read_json(request: Request, limit: int) -> dict:
    """The request's JSON object body, at most ``limit`` bytes (chunked bodies counted as they come)."""
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over {limit} bytes, this server's limit",
                           code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.bad(f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise P.bad(f"the body must be a JSON object, got {P._typename(body)}", None, "invalid_type")
    return body


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def streaming(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def score_prompt(server: Server, ids: list[int], adapter: str | None, k: int) -> tuple[list, list]:
    """Log-probability of each prompt token given those before it (the first: None) and the k most likely at each
    position, (token_logprobs, top) — computed on the engine's thread."""
    def run():
        model = server.model
        x = torch.tensor([ids], device=next(model.parameters()).device)
        if adapter is not None:
            from ..peft import route

            with route(model, [adapter]):
                logits = model(x).logits[0].float()
        else:
            logits = model(x).logits[0].float()
        logp = logits.log_softmax(-1)  # (T, vocab)
        chosen = logp[:-1].gather(1, x[0, 1:, None])[:, 0].tolist()
        top = [None]
        if k:
            values, idx = logp[:-1].topk(k, dim=-1)
            top += [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]
        return [None] + chosen, top
    return server.engine.call(run)
