"""pretune serve --quantize: the weights quantised once the adapters are on, greedy text equal to pretune generate
--quantize, the base and an adapter both answered, the model card saying so; refusals named."""

from __future__ import annotations

import httpx
import pytest

from helpers.serving import Running

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served_int8(tiny_folders):
    from pretune.serve import Limits, load_server

    base, lora = tiny_folders
    server = load_server(str(base), adapters={"lora": str(lora)}, limits=Limits(max_batch=4), quantize="int8")
    running = Running(server)
    yield running
    running.stop()


def _chat(served, model):
    r = httpx.post(served.url + "/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": CHAT, "temperature": 0, "max_tokens": 10})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_quantised_server_answers_as_generate_quantize_does(served_int8, tiny_folders, capsys):
    from pretune.cli import main

    card = httpx.get(served_int8.url + "/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and "int8" in str(card)
    text = _chat(served_int8, "tiny")
    main(["generate", str(tiny_folders[0]), CHAT[0]["content"], "--chat", "--max-new-tokens", "10",
          "--quantize", "int8"])
    assert capsys.readouterr().out == text + "\n"
    assert _chat(served_int8, "lora") != text  # the adapter, unmerged over the quantised base, still counts
    down = served_int8.server.model.transformer.decoder.layers[0].ffn.down_proj  # (the adapter's LoRA wrapper)
    from pretune.model.fast.quantized import QuantizedLinear

    assert isinstance(down.base_layer, QuantizedLinear)


def test_serve_refuses_quantize_with_a_bf16_dtype_by_name(tiny_folders, capsys):
    from pretune.cli import main

    assert main(["serve", str(tiny_folders[0]), "--quantize", "int8", "--dtype", "bf16", "--port", "1"]) == 2
    assert "drop --dtype bf16" in capsys.readouterr().err
