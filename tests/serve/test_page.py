"""The chat page at / : one static file with nothing from elsewhere, and the API calls it makes, over real HTTP
(the page's own requests: the models and card, a streamed chat, the adapter switch, the stop button's abort)."""

from __future__ import annotations

import json
import re
import time

import httpx


def test_the_page_is_one_self_contained_file(served):
    r = httpx.get(served.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<script src" not in page and "<link" not in page and not re.search(r"https?://", page)  # no CDN
    assert 'fetch("/v1/models"' in page and 'fetch("/v1/chat/completions"' in page and "AbortController" in page


def _page_stream(served, body, stop_after=None) -> tuple[str, int]:
    """What the page's send() does: POST the body, read the server-sent events, join the deltas (and, like the
    stop button, abort after ``stop_after`` events)."""
    text, n = [], 0
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            n += 1
            for c in json.loads(line[6:])["choices"]:
                text.append(c["delta"].get("content") or "")
            if stop_after is not None and n >= stop_after:
                break
    return "".join(text), n


def test_the_page_api_calls(served, caplog):
    models = httpx.get(served.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "lora"] and models[1]["parent"] == "tiny"
    card = models[0]["card"]
    assert card["family"] == "pretune" and card["dtype"] == "float32" and card["parameters"] > 0
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    body = {"model": "tiny", "messages": messages, "stream": True, "temperature": 0.0, "top_p": 1.0,
            "max_tokens": 12}
    base, _ = _page_stream(served, body)
    assert base == httpx.post(served.url + "/v1/chat/completions", json={**body, "stream": False}).json()[
        "choices"][0]["message"]["content"]
    assert _page_stream(served, {**body, "model": "lora"})[0] != base  # switching adapter changes the answer
    seeded = {**body, "temperature": 0.9, "seed": 3}
    assert _page_stream(served, seeded) == _page_stream(served, seeded)
    # the stop button: the page aborts the request; the server cancels it and frees its row
    long = {k: v for k, v in body.items() if k != "max_tokens"}  # max tokens left empty: what the context leaves
    with caplog.at_level("INFO", logger="pretune.serve"):
        _, events = _page_stream(served, long, stop_after=2)
        assert events == 2
        for _ in range(100):
            if any("client went away: cancelled" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.05)
    assert any(" 499 " in r.getMessage() and "cancelled" in r.getMessage() for r in caplog.records)
    for _ in range(100):
        if served.server.engine.load["running"] == 0:
            break
        time.sleep(0.05)
    assert served.server.engine.load["running"] == 0
