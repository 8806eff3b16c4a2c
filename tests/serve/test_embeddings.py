"""/v1/embeddings on an encoder: the vectors of pretune embed's mean pooling, float or base64 (the openai
client's default); an encoder refuses completions."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from helpers.serving import Running
from helpers.tiny_chat import tiny_tokenizer

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    import torch

    import pretune
    from pretune.io.checkpoint import save
    from pretune.serve import load_server

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = pretune.build_model(pretune.get_preset("tiny-bert-base", vocab_size=tok.vocab_size,
                                                   pad_token_id=tok.pad_id)).eval()
    folder = tmp_path_factory.mktemp("enc") / "enc"
    save(model, folder, tokenizer=tok)
    running = Running(load_server(str(folder)))
    yield running
    running.stop()


def test_embeddings_equal_pretune_embed(encoder):
    from pretune.jobs.embed import embed_texts

    texts = ["The capital of France is Paris.", "Once upon a time"]
    c = openai.OpenAI(base_url=encoder.url + "/v1", api_key="none", max_retries=0)
    out = c.embeddings.create(model="enc", input=texts)  # base64 on the wire
    got = np.array([d.embedding for d in out.data], dtype=np.float32)
    want = embed_texts(encoder.server.model, encoder.server.tok, texts, pooling="mean")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    floats = httpx.post(encoder.url + "/v1/embeddings", json={"model": "enc", "input": texts[0],
                                                              "encoding_format": "float"}).json()
    np.testing.assert_allclose(floats["data"][0]["embedding"], want[0], rtol=0, atol=1e-6)
    assert floats["usage"]["prompt_tokens"] > 0
    r = httpx.post(encoder.url + "/v1/completions", json={"model": "enc", "prompt": "a"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
    r = httpx.post(encoder.url + "/v1/embeddings", json={"model": "enc", "input": [1, 2]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
