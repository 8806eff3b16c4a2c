"""pretune chat: multi-turn history, /reset, /system, streamed answers equal to the server's chat completions."""

from __future__ import annotations

import io

import httpx

from pretune.serve.chat import Conversation, chat_loop


def _http_answer(served, messages, seed) -> str:
    r = httpx.post(served.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": messages, "temperature": 1.0, "seed": seed, "max_tokens": 10})
    return r.json()["choices"][0]["message"]["content"]


def test_multi_turn_reset_and_system_equal_the_server(served):
    # sampled (a random tiny model's greedy answers are much alike): turn i draws with seed 7 + i
    conv = Conversation(served.server, system="Be brief.", max_tokens=10, temperature=1.0, seed=7)
    lines = iter(["What is the capital of France?", "And of Spain?", "/reset", "And of Spain?", "/system Be nice.",
                  "Hello", "/nonsense", "/exit", "never read"])
    out = io.StringIO()
    chat_loop(conv, read=lambda prompt: next(lines), out=out)
    sys_ = {"role": "system", "content": "Be brief."}
    u1, u2 = ({"role": "user", "content": t} for t in ("What is the capital of France?", "And of Spain?"))
    a1 = _http_answer(served, [sys_, u1], 7)
    a2 = _http_answer(served, [sys_, u1, {"role": "assistant", "content": a1}, u2], 8)  # the history is sent
    a3 = _http_answer(served, [sys_, u2], 9)  # after /reset: no history
    a4 = _http_answer(served, [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hello"}], 10)
    assert a3 != _http_answer(served, [sys_, u1, {"role": "assistant", "content": a1}, u2], 9)  # history matters
    text = out.getvalue()
    assert f"{a1}\n" in text and f"{a2}\n" in text and f"{a3}\n" in text and f"{a4}\n" in text
    assert "(conversation reset)" in text and "unknown command /nonsense" in text
    assert conv.history == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": a4}]
    assert next(lines) == "never read"  # /exit left the loop


def test_the_chat_command(tiny_folders, monkeypatch, capsys):
    from pretune.cli import main

    lines = iter(["Hi there", "/system"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", read)
    assert main(["chat", str(tiny_folders[0]), "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("chatting with tiny") and "(system message removed; conversation reset)" in out


def test_an_adapter_folder_as_the_model(tiny_folders, capsys):
    """MODEL may be an adapter folder (on the base it recorded): greedy answers equal pretune generate --chat's."""
    from pretune.cli import main
    from pretune.serve import load_server

    server = load_server(str(tiny_folders[1]))
    try:
        answer = Conversation(server, max_tokens=8).say("Hello there", lambda text: None)
    finally:
        server.engine.close()
    main(["generate", str(tiny_folders[1]), "Hello there", "--chat", "--max-new-tokens", "8"])
    assert capsys.readouterr().out == answer + "\n"
    main(["generate", str(tiny_folders[0]), "Hello there", "--chat", "--max-new-tokens", "8"])
    assert capsys.readouterr().out != answer + "\n"  # the adapter is on
