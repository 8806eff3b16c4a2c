"""The OpenAI HTTP API's request checks and response shapes (no web framework here: plain dicts in, plain dicts out).

Every bad request becomes an :class:`ApiError`, which the app answers as OpenAI does:
``{"error": {"message", "type", "param", "code"}}`` with the status it names. Unknown request fields are ignored,
as OpenAI's API ignores them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer name for system
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit); completions' logprobs up to 5 in OpenAI, 20 here


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _typename(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def get_int(body: dict, name: str, default, *, low: int | None = None, high: int | None = None,
            alias: str | None = None):
    value = body.get(name, body.get(alias, default) if alias else default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {_typename(value)} {value!r}", name, "invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise bad(f"'{name}' must be {bounds}, got {value}", name, "invalid_value")
    return value


def get_float(body: dict, name: str, default: float, *, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number, got {_typename(value)} {value!r}", name, "invalid_type")
    if not low <= value <= high:
        raise bad(f"'{name}' must be between {low} and {high}, got {value}", name, "invalid_value")
    return float(value)


def get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean, got {_typename(value)} {value!r}", name, "invalid_type")
    return value


def get_stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad(f"'stop' must be a string or an array of strings, got {_typename(value)}", "stop", "invalid_type")
    if len(value) > MAX_STOPS:
        raise bad(f"'stop' takes at most {MAX_STOPS} strings, got {len(value)}", "stop", "invalid_value")
    if any(not s for s in value):
        raise bad("'stop' strings must not be empty", "stop", "invalid_value")
    return value


@dataclass
class Sampling:
    """What a completion request asks of the decoding, checked."""

    max_tokens: int | None  # None: up to the context (and the server's per-request limit)
    temperature: float
    top_p: float | None
    stop: list[str]
    seed: int | None
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no log-probs; k >= 0: the chosen token's and the k most likely
    echo: bool = False


def sampling(body: dict, *, chat: bool) -> Sampling:
    """The sampling fields of a chat or completions request, checked (OpenAI's names, ranges and defaults)."""
    if chat:
        max_tokens = get_int(body, "max_completion_tokens", None, low=1, alias="max_tokens")
    else:
        max_tokens = get_int(body, "max_tokens", 16, low=0)
    temperature = get_float(body, "temperature", 1.0, low=0.0, high=2.0)
    top_p = get_float(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise bad("'top_p' must be > 0 (a nucleus needs some probability)", "top_p", "invalid_value")
    n = get_int(body, "n", 1, low=1, high=MAX_N)
    seed = get_int(body, "seed", None)
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
    include_usage = bool(options and get_bool(options, "include_usage", False))
    if chat:
        want = get_bool(body, "logprobs", False)
        top = get_int(body, "top_logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        logprobs = (top or 0) if want else None
        echo = False
    else:
        logprobs = get_int(body, "logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
        echo = get_bool(body, "echo", False)
    if max_tokens == 0 and (stream or n > 1):
        raise bad("'max_tokens': 0 (scoring the prompt) takes neither 'stream' nor 'n' > 1", "max_tokens",
                  "invalid_value")
    if max_tokens == 0 and not echo:
        raise bad("'max_tokens': 0 generates nothing: use it with 'echo': true to score the prompt", "max_tokens",
                  "invalid_value")
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p if top_p < 1.0 else None,
                    stop=get_stop(body), seed=seed, n=n, stream=stream, include_usage=include_usage,
                    logprobs=logprobs, echo=echo)


def messages(body: dict) -> list[dict]:
    """A chat request's messages as ``{"role", "content"}`` with string contents (text parts joined)."""
    value = body.get("messages")
    if value is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty array", "messages", "invalid_value")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object, got {_typename(m)}", where, "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role",
                      "invalid_value")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"'{where}.content[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}} "
                              "(this model reads text only)", f"{where}.content", "invalid_value")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"'{where}.content' must be a string or an array of text parts, got {_typename(content)}",
                      f"{where}.content", "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def prompts(body: dict) -> list[str | list[int]]:
    """A completions request's prompts: a string, an array of strings, an array of token ids, or an array of
    arrays of token ids (what lm-eval's local-completions sends)."""
    value = body.get("prompt")
    if value is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [list(value)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in value):
            return [list(p) for p in value]
    raise bad("'prompt' must be a string, an array of strings, an array of token ids or an array of arrays of "
              f"token ids, got {_typename(value)}", "prompt", "invalid_type")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
