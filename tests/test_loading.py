"""The one loader: every kind of folder (pretune, transformers, adapter) -> model + tokenizer + task, and an
adapter folder works wherever a model folder does (generate, prompt, evaluate, convert, ...)."""

from __future__ import annotations

import json

import pytest
import torch

import pretune
from pretune import peft
from pretune.cli import main
from pretune.generation import generate
from pretune.io.checkpoint import CheckpointError
from pretune.io.tokenization import Tokenizer
from pretune.loading import folder_kind, load_pretrained

METHODS = ["lora", "ia3", "adapter", "prefix", "prompt"]


@pytest.fixture(scope="module")
def tok(tokenizers_by_kind):
    return Tokenizer.load(tokenizers_by_kind["bpe"])


@pytest.fixture(scope="module")
def base_dir(tok, tmp_path_factory):
    """A tiny Llama-shaped decoder (untied head: its logits are not dominated by each token's own embedding, so
    an adapter visibly changes what it writes) saved with its tokenizer."""
    torch.manual_seed(0)
    model = pretune.build_model("tiny-llama", vocab_size=tok.vocab_size, dropout=0.0, attn_dropout=0.0,
                                tie_embeddings=False)
    path = tmp_path_factory.mktemp("base") / "base"
    pretune.save(model, path, tokenizer=tok.tk)
    return path


def _adapter(base_dir, method: str, out, *, seed: int = 0):
    """An adapter whose weights moved away from their initialisation (as training moves them), saved as
    ``finetune --peft`` saves one: with the base path it belongs to."""
    model = pretune.load(base_dir)
    peft.inject(model, peft.PeftConfig(method=method, n_virtual=4, targets=["q_proj", "v_proj", "o_proj"]),
                seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.adapter_parameters(model, "default").items():
            if ".ia3." in name:
                p.copy_(torch.rand(p.shape, generator=g) * 3)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 2)
    peft.save_adapter(model, out, base=str(base_dir))
    return out


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {m: _adapter(base_dir, m, d / m) for m in METHODS}


PROMPTS = ["It is a truth universally", "She was"]


def _ids(tok, texts):
    rows = [tok.encode(t) for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


# ------------------------------------------------------------------------------------------------- kinds
def test_folder_kinds(base_dir, adapters, tmp_path):
    assert folder_kind(base_dir) == "pretune"
    assert folder_kind(adapters["lora"]) == "adapter" and folder_kind(adapters["prefix"]) == "adapter"
    hf = pretune.to_hf(pretune.load(base_dir), tmp_path / "hf")
    assert folder_kind(hf) == "transformers"
    with pytest.raises(CheckpointError, match="does not exist"):
        folder_kind(tmp_path / "nowhere")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(CheckpointError, match="a file"):
        folder_kind(tmp_path / "file.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="missing config.json"):
        folder_kind(tmp_path / "empty")


def test_every_kind_loads_with_its_tokenizer(base_dir, adapters, tok, tmp_path):
    hf = pretune.to_hf(pretune.load(base_dir), tmp_path / "hf", tokenizer_dir=base_dir)
    for path, kind in ((base_dir, "pretune"), (hf, "transformers"), (adapters["lora"], "adapter")):
        got = load_pretrained(path)
        assert got.kind == kind and got.tokenizer.vocab_size == tok.vocab_size and not got.model.training
    loaded = load_pretrained(adapters["prompt"])
    assert loaded.base == base_dir and peft.adapter_names(loaded.model) == ["default"]
    assert loaded.folders == (adapters["prompt"], base_dir)  # its tokenizer side files come from the base


def test_adapter_base_can_be_given_or_is_named_when_missing(base_dir, adapters, tmp_path):
    meta = json.loads((adapters["ia3"] / "pretune_adapter.json").read_text())
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in adapters["ia3"].iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    meta["base"]["model"] = str(tmp_path / "gone")
    (moved / "pretune_adapter.json").write_text(json.dumps(meta))
    with pytest.raises(peft.PeftError, match="gone does not exist; pass base=PATH"):
        load_pretrained(moved)
    assert load_pretrained(moved, base=base_dir).kind == "adapter"


# --------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("method", METHODS)
def test_generate_with_an_adapter_folder(method, base_dir, adapters, tok):
    """The adapter changes the tokens, and the cached decoding equals an uncached forward of the adapted model."""
    model = load_pretrained(adapters[method]).model
    base = pretune.load(base_dir)
    ids, mask = _ids(tok, PROMPTS)
    got = generate(model, ids, mask, max_new_tokens=6, eos_token_id=[])
    uncached = generate(model, ids, mask, max_new_tokens=6, eos_token_id=[], use_cache=False)
    plain = generate(base, ids, mask, max_new_tokens=6, eos_token_id=[])
    assert torch.equal(got, uncached)
    assert not torch.equal(got, plain)


@pytest.mark.parametrize("method", METHODS)
def test_cli_generate_and_prompt_take_an_adapter_folder(method, base_dir, adapters, tok, tmp_path, capsys):
    out = tmp_path / "gen.jsonl"
    assert main(["generate", str(adapters[method]), *PROMPTS, "--max-new-tokens", "5", "--out", str(out)]) == 0
    texts = [r["generated"][0] for r in map(json.loads, out.read_text().splitlines())]
    model = load_pretrained(adapters[method]).model
    from pretune.generation.scoring import lead_ids

    for prompt, text in zip(PROMPTS, texts):
        ids = torch.tensor([lead_ids(tok) + tok.encode(prompt)])
        new = generate(model, ids, max_new_tokens=5, use_cache=False, eos_token_id=tok.eos_id)[0, ids.shape[1]:]
        want = tok.decode([i for i in new.tolist() if i != tok.eos_id], skip_special_tokens=True)
        assert text == want
    assert main(["generate", str(base_dir), *PROMPTS, "--max-new-tokens", "5", "--out", str(tmp_path / "b.jsonl")]) == 0
    assert [r["generated"][0] for r in map(json.loads, (tmp_path / "b.jsonl").read_text().splitlines())] != texts

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": lb}) + "\n"
                            for t, lb in (("a fine day", "pos"), ("a dull day", "neg"), ("she smiled", "pos"))))
    scores = {}
    for name, folder in (("adapter", adapters[method]), ("base", base_dir)):
        res = tmp_path / f"{name}.jsonl"
        assert main(["prompt", str(folder), "--data", str(data), "--template", "Text: {text}\nMood:",
                     "--labels", "pos=good,neg=bad", "--out", str(res), "--quiet"]) == 0
        scores[name] = [r["scores"] for r in map(json.loads, res.read_text().splitlines())]
    capsys.readouterr()
    assert scores["adapter"] != scores["base"]


def test_lora_generation_equals_the_merged_model_and_peft(base_dir, adapters, tok, tmp_path):
    """LoRA: the adapter folder generates what the merged model generates, and what peft.PeftModel generates on
    the exported transformers model."""
    transformers = pytest.importorskip("transformers")
    peft_lib = pytest.importorskip("peft")
    loaded = load_pretrained(adapters["lora"])
    merged = load_pretrained(adapters["lora"], merge=True).model
    assert peft.adapter_names(merged) == []
    ids, mask = _ids(tok, PROMPTS)
    got = generate(loaded.model, ids, mask, max_new_tokens=6, eos_token_id=[])
    assert torch.equal(got, generate(merged, ids, mask, max_new_tokens=6, eos_token_id=[]))
    hf_dir = pretune.to_hf(pretune.load(base_dir), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf = peft_lib.PeftModel.from_pretrained(hf, adapters["lora"]).eval()
    want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=1,
                       pad_token_id=0, eos_token_id=None, min_new_tokens=6)
    assert torch.equal(got, want)


def test_training_jobs_start_from_an_adapter_folded_in(base_dir, adapters):
    """``model.init=ADAPTER`` (pretrain, finetune) and ``convert --to-hf ADAPTER`` get the base with the adapter
    folded in; adapters that add computation (prefix) cannot be folded and say so."""
    merged = pretune.load(adapters["lora"], merge=True)
    active = pretune.load(adapters["lora"])
    ids = torch.randint(3, 100, (2, 7))
    torch.testing.assert_close(merged(ids).logits, active(ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(peft.PeftError, match="only LoRA and \\(IA\\)3 merge"):
        pretune.load(adapters["prefix"], merge=True)


def test_an_adapter_trained_from_an_adapter_folder_loads_on_it_folded_in(adapters, tmp_path):
    """SFT then GRPO from the SFT model (``finetune --model SFT_ADAPTER --peft lora``): the run starts from the first
    adapter folded into its base and records the first adapter's folder as its base; loading the second adapter
    folds the first in the same way, so it gives the model the run trained (it used to fail: "already has an
    adapter named 'default'")."""
    start = pretune.load(adapters["lora"], merge=True)  # what build_run_model gives the second run
    peft.inject(start, peft.PeftConfig(method="lora", targets=["q_proj", "v_proj"]), seed=1)
    with torch.no_grad():
        for p in peft.adapter_parameters(start, "default").values():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    second = tmp_path / "second"
    peft.save_adapter(start, second, base=str(adapters["lora"]))
    loaded = load_pretrained(second)
    assert loaded.base == adapters["lora"] and peft.adapter_names(loaded.model) == ["default"]
    ids = torch.randint(3, 100, (2, 7))
    first_only = pretune.load(adapters["lora"])
    torch.testing.assert_close(loaded.model(ids).logits, start.eval()(ids).logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(loaded.model(ids).logits, first_only(ids).logits, atol=1e-3)
