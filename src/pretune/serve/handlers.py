"""The app of ``pretune serve`` (``build_app``) and its endpoints: models, health, chat completions, completions,
embeddings. The server's state and a request's run are in app.py."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from importlib import resources

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException

from ..generation.prompt import apply_chat_template
from . import protocol as P
from .app import Run, Server, log, log_line, read_json, score_prompt, sse, streaming
from .protocol import ApiError


def build_app(server: Server) -> FastAPI:
    """The FastAPI app serving ``server``."""
    app = FastAPI(title="pretune", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        log_line(getattr(request.state, "rid", "-"), request.url.path, e.status, "-", note=f"error: {e.message}")
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        err = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code)
        return await _api_error(request, err)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        err = ApiError(500, f"internal server error ({type(e).__name__}); the server logged it", type="server_error",
                       code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    app.add_middleware(Guard, server=server, refuse=_api_error)
    add_routes(app, server)
    return app


class Guard:
    """Before any route: a request id, the body size limit (by Content-Length; chunked bodies are counted as they are
    read) and the API key. A plain ASGI middleware, so that the routes see the client's own ``receive`` (how a
    non-streamed request notices its client has gone)."""

    def __init__(self, app, *, server: Server, refuse):
        self.app, self.server, self.refuse = app, server, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["rid"] = P.new_id("req")
        request = Request(scope)
        limit = self.server.limits.max_body_bytes
        length = request.headers.get("content-length")
        error = None
        if length is not None and length.isdigit() and int(length) > limit:
            error = ApiError(413, f"the request body has {length} bytes; this server takes at most {limit}",
                             code="request_too_large")
        elif self.server.api_key is not None and scope["path"].startswith("/v1") and \
                request.headers.get("authorization", "") != f"Bearer {self.server.api_key}":
            error = ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
        if error is not None:
            response = await self.refuse(request, error)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def add_routes(app: FastAPI, server: Server) -> None:
    embed_lock = threading.Lock()

    @app.get("/", include_in_schema=False)
    async def page():
        """The chat page (static/chat.html): one file, no CDN."""
        return HTMLResponse(resources.files("pretune.serve").joinpath("static/chat.html").read_text("utf-8"))

    @app.get("/health")
    async def health():
        load = server.engine.load if server.engine is not None else {"running": 0, "waiting": 0}
        return {"status": "ok", "model": server.name, **load}

    def model_entry(name: str, adapter: bool) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "pretune",
                **({"parent": server.name} if adapter else {"card": server.card()})}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_entry(server.name, False)] + [model_entry(a, True)
                                                                             for a in server.adapters]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != server.name and name not in server.adapters:
            raise ApiError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return model_entry(name, name != server.name)

    def need_generation(what: str) -> None:
        if server.engine is None:
            raise P.bad(f"{server.name} is an {server.layout.name} model: it writes no text ({what}); "
                        "it serves /v1/embeddings", "model", "model_not_supported")

    # ------------------------------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_json(request, server.limits.max_body_bytes)
        adapter = server.adapter_of(body)
        need_generation("chat completions")
        msgs = P.messages(body)
        s = P.sampling(body, chat=True)
        if server.chat_source is None:
            raise P.bad(f"{server.name} has no chat template (chat_template.jinja or tokenizer_config.json); "
                        "use /v1/completions", "messages", "no_chat_template")
        try:
            text = apply_chat_template(server.chat_source, msgs)
        except Exception as e:  # a template that raises on these messages (e.g. roles it refuses)
            raise P.bad(f"the chat template cannot render these messages: {e}", "messages", "invalid_value") from None
        ids = server.tok.encode(text)
        budget = server.budget(len(ids), s.max_tokens)
        run = Run(server, [ids], s, adapter, [budget])
        run.submit()
        rid, name = P.new_id("chatcmpl"), body["model"]
        created = P.now()

        def chunk(i: int, delta: dict, finish=None, tokens=()) -> dict:
            lp = {"content": [_chat_logprob(server, t) for t in tokens]} if s.logprobs is not None and tokens else None
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                    "system_fingerprint": None,
                    "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

        if s.stream:
            async def events():
                for i in range(len(run.choices)):
                    yield sse(chunk(i, {"role": "assistant", "content": ""}))
                async for i, c, new, ended in _choice_events(run):
                    if ended:
                        if c.error:
                            yield _failed(c)
                        rest = c.last_delta()
                        if rest:
                            yield sse(chunk(i, {"content": rest}))
                        yield sse(chunk(i, {}, c.finish))
                        continue
                    text = c.delta()
                    if text or (s.logprobs is not None and _visible(server, new)):
                        yield sse(chunk(i, {"content": text}, tokens=_visible(server, new)))
            fields = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}
            return streaming(_streamed(run, events(), path="/v1/chat/completions", head=fields,
                                       include_usage=s.include_usage))

        await _wait(run, request, rid, "/v1/chat/completions", name)
        choices = []
        for i, c in enumerate(run.choices):
            lp = {"content": [_chat_logprob(server, t) for t in _visible(server, c.tokens)]} \
                if s.logprobs is not None else None
            choices.append({"index": i, "message": {"role": "assistant", "content": c.final_text(), "refusal": None},
                            "logprobs": lp, "finish_reason": c.finish})
        stats = run.stats()
        log_line(rid, "/v1/chat/completions", 200, name, stats)
        return {"id": rid, "object": "chat.completion", "created": created, "model": name,
                "system_fingerprint": None, "choices": choices,
                "usage": P.usage(stats["prompt_tokens"], stats["completion_tokens"])}

    # ------------------------------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request, server.limits.max_body_bytes)
        adapter = server.adapter_of(body)
        need_generation("completions")
        prompts = P.prompts(body)
        s = P.sampling(body, chat=False)
        vocab = server.model.config.vocab_size
        rows, texts = [], []
        for p in prompts:
            if isinstance(p, str):
                ids = server.tok.encode(p)
                texts.append(p)
            else:
                bad = [t for t in p if not 0 <= t < vocab]
                if bad:
                    raise P.bad(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt",
                                "invalid_value")
                ids = p
                texts.append(server.tok.decode(p))
            if not ids:
                raise P.bad("a prompt has no tokens; a decoder-only model needs at least one", "prompt",
                            "invalid_value")
            rows.append(ids)
        budgets = [server.budget(len(ids), s.max_tokens) for ids in rows]
        rid, name, created = P.new_id("cmpl"), body["model"], P.now()
        k = s.logprobs or 0
        scored = None
        if s.echo and s.logprobs is not None:  # the prompt's own log-probs, from one forward per prompt
            scored = [await asyncio.wrap_future(score_prompt(server, ids, adapter, k)) for ids in rows]
        run = None
        if s.max_tokens != 0:
            run = Run(server, rows, s, adapter, budgets)
            run.submit()

        def prompt_of(index: int) -> int:
            return index // s.n

        def legacy(index: int, tokens, start: int, with_prompt: bool) -> dict:
            """OpenAI's legacy logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
            p = prompt_of(index)
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if with_prompt:
                ids = rows[p]
                chosen, top = scored[p]
                out["tokens"] += [server.token_text(t) for t in ids]
                out["token_logprobs"] += chosen
                out["top_logprobs"] += [None if t is None else _top_dict(server, t) for t in top]
                out["text_offset"] += [len(server.tok.decode(ids[:j])) for j in range(len(ids))]
            new_ids = [t.id for t in tokens]
            out["tokens"] += [server.token_text(t) for t in new_ids]
            out["token_logprobs"] += [t.logprob for t in tokens]
            out["top_logprobs"] += [_top_dict(server, t.top) for t in tokens]
            out["text_offset"] += [start + len(server.tok.decode(new_ids[:j])) for j in range(len(new_ids))]
            return out

        n_choices = len(rows) * s.n
        if s.stream:
            async def events():
                def chunk(i, text, finish=None, lp=None):
                    return {"id": rid, "object": "text_completion", "created": created, "model": name,
                            "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}
                if s.echo:
                    for i in range(n_choices):
                        lp = legacy(i, [], 0, True) if scored is not None else None
                        yield sse(chunk(i, texts[prompt_of(i)], lp=lp))
                offsets = [len(texts[prompt_of(i)]) if s.echo else 0 for i in range(n_choices)]
                async for i, c, new, ended in _choice_events(run):
                    if ended:
                        if c.error:
                            yield _failed(c)
                        yield sse(chunk(i, c.last_delta(), c.finish))
                        continue
                    text = c.delta()
                    visible = _visible(server, new)
                    if text or (s.logprobs is not None and visible):
                        lp = None
                        if s.logprobs is not None:
                            lp = legacy(i, visible, offsets[i], False)
                        offsets[i] += len(text)
                        yield sse(chunk(i, text, lp=lp))
            fields = {"id": rid, "object": "text_completion", "created": created, "model": name}
            return streaming(_streamed(run, events(), path="/v1/completions", head=fields,
                                       include_usage=s.include_usage))

        if run is not None:
            await _wait(run, request, rid, "/v1/completions", name)
        choices = []
        for i in range(n_choices):
            p = prompt_of(i)
            head = texts[p] if s.echo else ""
            if run is None:
                text, finish, tokens = "", "length", []
            else:
                c = run.choices[i]
                text, finish, tokens = c.final_text(), c.finish, _visible(server, c.tokens)
            lp = legacy(i, tokens, len(head), s.echo and scored is not None) if s.logprobs is not None else None
            choices.append({"index": i, "text": head + text, "logprobs": lp, "finish_reason": finish})
        n_prompt = sum(len(r) for r in rows)
        n_new = run.stats()["completion_tokens"] if run is not None else 0
        stats = run.stats() if run is not None else {"prompt_tokens": n_prompt, "completion_tokens": 0, "ttft": None,
                                                     "tps": 0.0}
        log_line(rid, "/v1/completions", 200, name, stats)
        return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices,
                "usage": P.usage(n_prompt, n_new)}

    # ------------------------------------------------------------------------------------------ embeddings
    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await read_json(request, server.limits.max_body_bytes)
        server.adapter_of(body)
        if server.engine is not None or server.layout.name != "encoder":
            raise P.bad(f"{server.name} is a {server.layout.name} model; /v1/embeddings serves encoder models "
                        "(the mean pooling of pretune embed)", "model", "model_not_supported")
        value = body.get("input")
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
            raise P.bad("'input' must be a non-empty string or an array of non-empty strings", "input",
                        "invalid_type" if not isinstance(value, list) else "invalid_value")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise P.bad(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", "encoding_format",
                        "invalid_value")
        from ..jobs.embed import embed_texts

        def run():
            with embed_lock:
                return embed_texts(server.model, server.tok, value, pooling="mean")
        vectors = await asyncio.to_thread(run)
        n_tokens = sum(len(server.tok.encode(t)) for t in value)
        data = []
        for i, v in enumerate(vectors):
            v = np.asarray(v, dtype="<f4")
            emb = base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        log_line(request.state.rid, "/v1/embeddings", 200, body["model"], note=f"in={n_tokens}")
        return JSONResponse({"object": "list", "data": data, "model": body["model"],
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


async def _streamed(run: Run, events, *, path: str, head: dict, include_usage: bool):
    """A streamed response: ``events`` (its SSE chunks), then the usage chunk (when asked; ``head``: the chunks' id,
    object, created and model), ``[DONE]`` and the log line. If it stops before every choice of ``run`` has ended
    (the client went away), the run is cancelled and logged as 499."""
    rid, name = head["id"], head["model"]
    try:
        async for event in events:
            yield event
        stats = run.stats()
        if include_usage:
            yield sse({**head, "choices": [], "usage": P.usage(stats["prompt_tokens"], stats["completion_tokens"])})
        yield b"data: [DONE]\n\n"
        log_line(rid, path, 200, name, stats, "stream")
    finally:
        if any(c.finish is None for c in run.choices):
            run.cancel()
            log_line(rid, path, 499, name, run.stats(), "client went away: cancelled")


async def _choice_events(run: Run):
    """``run``'s events as (choice index, choice, its new tokens, whether it ended) until every choice has ended."""
    open_ = len(run.choices)
    while open_:
        event = await run.next()
        if event is None:
            continue
        i, new, ended = run.handle(event)
        open_ -= ended
        yield i, run.choices[i], new, ended


def _failed(choice) -> bytes:
    """The error event a stream sends before the last chunk of a choice whose generation failed."""
    return sse(ApiError(500, f"generation failed: {choice.error}", type="server_error").body())


async def _wait(run: Run, request: Request, rid: str, path: str, name: str) -> None:
    """Wait until every choice of ``run`` has ended; cancel it if the client goes away meanwhile."""
    open_ = len(run.choices)
    checked = time.monotonic()
    try:
        while open_:
            event = await run.next()
            if time.monotonic() - checked >= 0.25:  # every 0.25 s, busy or not (asking resumes reading the socket)
                checked = time.monotonic()
                if await request.is_disconnected():
                    run.cancel()
                    log_line(rid, path, 499, name, run.stats(), "client went away: cancelled")
                    raise ApiError(499, "the client closed the request", code="client_closed_request")
            if event is None:
                continue
            _, _, ended = run.handle(event)
            open_ -= ended
    except asyncio.CancelledError:
        run.cancel()
        raise
    errors = [c.error for c in run.choices if c.error]
    if errors:
        raise ApiError(500, f"generation failed: {errors[0]}", type="server_error", code="generation_failed")


def _visible(server: Server, tokens) -> list:
    """Tokens that are text (an ending EOS is not)."""
    return [t for t in tokens if t.id not in server.eos]


def _chat_logprob(server: Server, t) -> dict:
    def entry(i, lp):
        s = server.token_text(i)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}


def _top_dict(server: Server, top) -> dict:
    out = {}
    for i, lp in top:
        out.setdefault(server.token_text(i), lp)
    return out
