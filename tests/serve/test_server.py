"""pretune serve over real HTTP: the openai client, greedy text equal to pretune generate, streaming, log-probs,
continuous batching (each request equals itself alone), a client killed mid-stream, and bad requests."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


def client(served, key="none"):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0, timeout=60)


def chat(served, messages=CHAT, **kw) -> dict:
    r = httpx.post(served.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages, **kw},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_and_health(served):
    models = client(served).models.list()
    assert [m.id for m in models.data] == ["tiny", "lora"]
    health = httpx.get(served.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny"


def test_chat_greedy_equals_pretune_generate_and_streams_the_same_text(served, tiny_folders, capsys):
    from pretune.cli import main

    c = client(served)
    out = c.chat.completions.create(model="tiny", messages=CHAT[1:], temperature=0, max_tokens=12)
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    main(["generate", str(tiny_folders[0]), CHAT[1]["content"], "--chat", "--max-new-tokens", "12"])
    assert capsys.readouterr().out == text + "\n"  # pretune generate --chat prints the streamed text
    deltas, finish = [], None
    for chunk in c.chat.completions.create(model="tiny", messages=CHAT[1:], temperature=0, max_tokens=12,
                                           stream=True):
        deltas.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(deltas) == text and finish == out.choices[0].finish_reason
    # a stop string: cut before it, the same text streamed or not, finish_reason "stop"
    stop = text[3:5]
    cut = c.chat.completions.create(model="tiny", messages=CHAT[1:], temperature=0, max_tokens=12, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=CHAT[1:], temperature=0, max_tokens=12, stop=[stop], stream=True))
    assert streamed == cut.choices[0].message.content


def test_sampling_n_seed_logprobs_and_usage(served):
    a = chat(served, temperature=0.9, top_p=0.95, seed=5, n=3, max_tokens=8, logprobs=True, top_logprobs=2)
    b = chat(served, temperature=0.9, top_p=0.95, seed=5, n=3, max_tokens=8, logprobs=True, top_logprobs=2)
    texts = [ch["message"]["content"] for ch in a["choices"]]
    assert texts == [ch["message"]["content"] for ch in b["choices"]]  # seeded: reproducible
    assert len(set(texts)) > 1  # choice j is seeded seed + j
    lp = a["choices"][0]["logprobs"]["content"]
    assert lp and all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["logprob"] >= t["logprob"]
                      and t["top_logprobs"][0]["logprob"] >= t["top_logprobs"][1]["logprob"] for t in lp)
    assert "".join(t["token"] for t in lp) == texts[0]
    assert a["usage"]["completion_tokens"] >= sum(len(ch["logprobs"]["content"]) for ch in a["choices"])
    assert a["usage"]["total_tokens"] == a["usage"]["prompt_tokens"] + a["usage"]["completion_tokens"]
    # streamed: the chunks' log-probs are the same tokens; include_usage adds a last chunk with the usage
    chunks = list(client(served).chat.completions.create(
        model="tiny", messages=CHAT, temperature=0.9, top_p=0.95, seed=5, max_tokens=8, logprobs=True,
        top_logprobs=2, stream=True, stream_options={"include_usage": True}))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t["token"], t["logprob"]) for t in lp]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(
        1 for _ in streamed) + (a["choices"][0]["finish_reason"] == "stop")


def test_completions_echo_logprobs_equal_a_forward_pass(served, tiny_folders):
    import pretune

    c = client(served)
    prompt = "Once upon a time there was a little model"
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    lp = out.choices[0].logprobs
    loaded = pretune.load_pretrained(tiny_folders[0])
    ids = loaded.tokenizer.encode(prompt)  # no special tokens added
    with torch.no_grad():
        logp = loaded.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert out.choices[0].text == prompt and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-5, rtol=0)
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    assert all(len(t) <= 3 for t in lp.top_logprobs[1:])
    # generation after an echoed prompt; a list of prompts (strings and token ids), n per prompt
    more = c.completions.create(model="tiny", prompt=[prompt, "The capital"], max_tokens=5, temperature=0, n=2)
    assert [ch.index for ch in more.choices] == [0, 1, 2, 3] and more.choices[0].text == more.choices[1].text
    by_ids = httpx.post(served.url + "/v1/completions", json={"model": "tiny", "prompt": [ids], "max_tokens": 5,
                                                              "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == more.choices[0].text


def _stream_text(url, body) -> str:
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def test_concurrent_requests_each_equal_alone_and_a_killed_client_disturbs_none(served):
    # 32 requests (the number) over 8 rows: different prompts, lengths, seeds, greedy or sampled, base or
    # adapter; those past the rows wait in the queue and join as rows free up
    topics = ["France", "Spain", "a little model", "the sea", "Paris", "a truth", "fortune", "a wife"]
    bodies = [{"model": "lora" if i % 3 == 2 else "tiny",
               "messages": [{"role": "user", "content": f"Tell me about {topics[i % 8]}" + "!" * i}],
               "max_tokens": 6 + 3 * (i % 8), **({"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i})}
              for i in range(32)]
    alone = [_stream_text(served.url, b) for b in bodies]
    assert alone[2] != _stream_text(served.url, {**bodies[2], "model": "tiny"})  # the adapter changes the text
    together = [None] * len(bodies)
    served.server.engine.peak = 0

    def go(i):
        together[i] = _stream_text(served.url, bodies[i])

    def killed():  # a client that reads two chunks of a long stream and goes away
        with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=60,
                          json={**bodies[0], "max_tokens": 60, "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 2:
                    break

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))] + [threading.Thread(target=killed)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert together == alone
    assert served.server.engine.peak >= 4  # they did share decoding steps
    for _ in range(100):  # the killed stream's row is gone
        if served.server.engine.load["running"] == 0:
            break
        threading.Event().wait(0.05)
    assert served.server.engine.load["running"] == 0 and served.server.engine.load["waiting"] == 0


BAD = [  # (what, method, path, body or raw bytes, headers, status, code)
    ("invalid JSON", "POST", "/v1/chat/completions", b"{not json", {}, 400, "invalid_json"),
    ("a JSON array body", "POST", "/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_type"),
    ("missing messages", "POST", "/v1/chat/completions", {"model": "tiny"}, {}, 400, "missing_required_parameter"),
    ("empty messages", "POST", "/v1/chat/completions", {"model": "tiny", "messages": []}, {}, 400, "invalid_value"),
    ("unknown role", "POST", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "invalid_value"),
    ("content not a string", "POST", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, {}, 400, "invalid_type"),
    ("an image part", "POST", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, {},
     400, "invalid_value"),
    ("missing model", "POST", "/v1/chat/completions", {"messages": CHAT}, {}, 400, "missing_required_parameter"),
    ("unknown model", "POST", "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, {}, 404,
     "model_not_found"),
    ("negative max_tokens", "POST", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": -1},
     {}, 400, "invalid_value"),
    ("huge max_tokens", "POST", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 10 ** 9},
     {}, 400, "invalid_value"),
    ("max_tokens past the context", "POST", "/v1/chat/completions",
     {"model": "tiny", "messages": CHAT, "max_tokens": 120}, {}, 400, "context_length_exceeded"),
    ("prompt longer than the context", "POST", "/v1/completions",
     {"model": "tiny", "prompt": "Paris " * 200}, {}, 400, "context_length_exceeded"),
    ("max_tokens a string", "POST", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": "9"},
     {}, 400, "invalid_type"),
    ("temperature out of range", "POST", "/v1/chat/completions",
     {"model": "tiny", "messages": CHAT, "temperature": 3}, {}, 400, "invalid_value"),
    ("top_p a string", "POST", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_p": "high"}, {},
     400, "invalid_type"),
    ("stream not a boolean", "POST", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stream": "yes"},
     {}, 400, "invalid_type"),
    ("malformed stop list", "POST", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stop": ["a", 3]},
     {}, 400, "invalid_type"),
    ("too many stops", "POST", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stop": list("abcde")},
     {}, 400, "invalid_value"),
    ("n = 0", "POST", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "n": 0}, {}, 400, "invalid_value"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions",
     {"model": "tiny", "messages": CHAT, "top_logprobs": 2}, {}, 400, "invalid_value"),
    ("missing prompt", "POST", "/v1/completions", {"model": "tiny"}, {}, 400, "missing_required_parameter"),
    ("prompt of mixed types", "POST", "/v1/completions", {"model": "tiny", "prompt": ["a", 1]}, {}, 400,
     "invalid_type"),
    ("token id outside the vocabulary", "POST", "/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, {},
     400, "invalid_value"),
    ("max_tokens 0 without echo", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, {},
     400, "invalid_value"),
    ("embeddings of a decoder", "POST", "/v1/embeddings", {"model": "tiny", "input": "a"}, {}, 400,
     "model_not_supported"),
    ("unknown path", "GET", "/v1/nothing", None, {}, 404, "not_found"),
    ("wrong method", "GET", "/v1/chat/completions", None, {}, 405, "method_not_allowed"),
]


def test_bad_requests_get_openai_errors_and_the_server_answers_the_next(served):
    assert len(BAD) >= 20
    http = httpx.Client(base_url=served.url, timeout=30)  # one connection for all
    for what, method, path, body, headers, status, code in BAD:
        kw = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
        r = http.request(method, path, headers={"Content-Type": "application/json", **headers}, **kw)
        assert r.status_code == status, (what, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, (what, err)
        assert "Traceback" not in r.text
    assert chat(served, temperature=0, max_tokens=3)["choices"][0]["finish_reason"] in ("stop", "length")


def test_body_limit_api_key_and_a_full_queue(served):
    server = served.server
    old = server.limits.max_body_bytes
    server.limits.max_body_bytes = 100
    try:
        r = httpx.post(served.url + "/v1/chat/completions", json={"model": "tiny", "messages": CHAT * 10})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    finally:
        server.limits.max_body_bytes = old
    server.api_key = "sesame"
    try:
        with pytest.raises(openai.AuthenticationError):
            client(served, "wrong").models.list()
        assert client(served, "sesame").models.list().data[0].id == "tiny"
        assert httpx.get(served.url + "/health").status_code == 200  # no key for the health check
    finally:
        server.api_key = None
    server.engine.max_queue = 0
    try:
        r = httpx.post(served.url + "/v1/chat/completions", json={"model": "tiny", "messages": CHAT})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        server.engine.max_queue = 64
    assert chat(served, temperature=0, max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_a_public_host_needs_an_api_key(capsys):
    from pretune.cli import main

    assert main(["serve", "no/such/model", "--host", "0.0.0.0"]) == 2  # refused before anything loads
    assert "--api-key" in capsys.readouterr().err
    assert main(["serve", "no/such/model", "--max-batch", "0"]) == 2
    assert "--max-batch 0 must be >= 1" in capsys.readouterr().err
    assert main(["serve", "no/such/model", "--port", "0"]) == 2  # one line naming the folder, no traceback
    err = capsys.readouterr().err
    assert "no/such/model" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["serve", "no/such/model", "--adapter", "no-equals-sign"])
    assert "expected NAME=FOLDER" in capsys.readouterr().err


def test_a_busy_port_is_one_line(served, capsys):
    from pretune.cli import main

    assert main(["serve", "no/such/model", "--port", str(served.port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{served.port}" in err and "Traceback" not in err


def test_a_non_streamed_request_whose_client_goes_away_is_cancelled(served, caplog):
    import socket
    import time

    body = {"model": "tiny", "messages": CHAT[1:], "max_tokens": 80, "temperature": 0}
    assert chat(served, **{k: v for k, v in body.items() if k != "model"})["choices"][0]["finish_reason"] == "length"
    engine = served.server.engine
    step = engine.step_fn

    def slow_step(*args, **kwargs):  # 20 ms a step: 80 tokens take 1.6 s, the client leaves after 0.3 s
        time.sleep(0.02)
        return step(*args, **kwargs)

    engine.step_fn = slow_step
    try:
        with caplog.at_level("INFO", logger="pretune.serve"):
            raw = json.dumps(body).encode()
            with socket.create_connection(("127.0.0.1", served.port)) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
                time.sleep(0.3)
            for _ in range(100):
                if any(" 499 " in r.getMessage() for r in caplog.records):
                    break
                time.sleep(0.05)
        assert any(" 499 " in r.getMessage() and "cancelled" in r.getMessage() for r in caplog.records)
        for _ in range(100):  # the engine frees a cancelled row at its next step, after the handler logged the 499
            if engine.load["running"] == 0:
                break
            time.sleep(0.05)
        assert engine.load["running"] == 0
    finally:
        engine.step_fn = step
    assert chat(served, temperature=0, max_tokens=3)["usage"]["completion_tokens"] >= 1
