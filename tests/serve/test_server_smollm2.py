"""pretune serve on the real SmolLM2-135M-Instruct (slow): greedy chat equals pretune generate --chat and
transformers' generate with the same template, echo log-probs equal transformers' within 1e-4, concurrent
requests each equal themselves alone, and the CLI binds loopback by default."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from helpers.serving import Running

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smol_served():
    from pretune.realmodels import smollm2_dir
    from pretune.serve import Limits, load_server

    running = Running(load_server(str(smollm2_dir()), name="smol", limits=Limits(max_batch=16)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def hf():
    from pretune.realmodels import smollm2_dir

    folder = smollm2_dir()
    return (transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval(),
            transformers.AutoTokenizer.from_pretrained(folder))


def test_greedy_chat_equals_generate_and_transformers(smol_served, hf, capsys):
    from pretune.cli import main
    from pretune.realmodels import smollm2_dir

    c = openai.OpenAI(base_url=smol_served.url + "/v1", api_key="none", max_retries=0, timeout=300)
    question = "What is the capital of France?"
    out = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": question}], temperature=0,
                                    max_tokens=24)
    text = out.choices[0].message.content
    main(["generate", str(smollm2_dir()), question, "--chat", "--max-new-tokens", "24"])
    assert capsys.readouterr().out == text + "\n"
    model, tok = hf
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    want = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    assert tok.decode(want, skip_special_tokens=True) == text
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24, stream=True))
    assert streamed == text


def test_echo_logprobs_equal_transformers(smol_served, hf):
    model, tok = hf
    prompt = "The capital of France is Paris, and the capital of Spain is Madrid."
    r = httpx.post(smol_served.url + "/v1/completions", timeout=300,
                   json={"model": "smol", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    lp = r["choices"][0]["logprobs"]
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    want = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == ids.shape[1]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-4, rtol=0)


def test_sixteen_concurrent_requests_each_equal_alone(smol_served):
    def ask(i):
        msg = {"role": "user", "content": f"Write {i + 2} words about the number {i}."}
        body = {"model": "smol", "messages": [msg],
                "max_tokens": 8 + 2 * i, "stream": True,
                **({"temperature": 0} if i % 2 else {"temperature": 0.7, "seed": 100 + i})}
        text = []
        with httpx.stream("POST", smol_served.url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
        return "".join(text)

    alone = [ask(i) for i in range(16)]
    together = [None] * 16

    def go(i):
        together[i] = ask(i)

    smol_served.server.engine.peak = 0
    threads = [threading.Thread(target=go, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert together == alone and smol_served.server.engine.peak >= 8
