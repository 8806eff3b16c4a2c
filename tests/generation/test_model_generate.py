"""``model.generate(ids, max_new_tokens=...)`` (issue 32): a transformers user's call on a pretune model gives
``pretune.generate(model, ids, ...)``'s output, however the model was imported, while the model package imports
nothing of generation (tests/test_architecture.py); without the hook the error names ``pretune.generate``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import pretune
from pretune.hooks import HOOKS


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return pretune.build_model("tiny-gpt2", dropout=0.0).eval()


def test_the_method_equals_the_function(model):
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    assert torch.equal(model.generate(ids, max_new_tokens=5), pretune.generate(model, ids, max_new_tokens=5))
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2),
                       pretune.generate(model, ids, mask, max_new_tokens=4, num_beams=2))
    sampled = model.generate(ids, do_sample=True, top_k=5, seed=3, max_new_tokens=4)
    assert torch.equal(sampled, pretune.generate(model, ids, do_sample=True, top_k=5, seed=3, max_new_tokens=4))


def test_without_the_hook_the_error_names_pretune_generate(model, monkeypatch):
    monkeypatch.delitem(HOOKS, "generate")
    with pytest.raises(RuntimeError, match=r"pretune\.generate\(model, input_ids"):
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=2)


FROM_MODEL_ONLY = """
import sys, torch
from pretune.model import build_model
assert "pretune.generation.decode" not in sys.modules  # the model did not import generation
torch.manual_seed(0)
m = build_model("tiny-gpt2", dropout=0.0).eval()
ids = torch.tensor([[5, 6, 7]])
out = m.generate(ids, max_new_tokens=3)
from pretune.generation import generate
assert torch.equal(out, generate(m, ids, max_new_tokens=3))
print(out.shape[1])
"""


def test_works_when_only_the_model_package_is_imported():
    out = subprocess.run([sys.executable, "-c", FROM_MODEL_ONLY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "6"
