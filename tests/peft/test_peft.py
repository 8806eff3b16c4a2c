"""PEFT: injection, freezing, merge/unmerge, mixed-adapter batches, adapter files, bad input."""

from __future__ import annotations

import pytest
import torch

import pretune
from pretune import peft
from pretune.peft import PeftConfig, PeftError
from pretune.peft.files import base_state
from pretune.peft.inject import is_peft_parameter

FAMILIES = ["tiny-bert-base", "tiny-gpt2", "tiny-llama", "tiny-t5-small"]
METHODS = ["lora", "ia3", "adapter", "prefix", "prompt", "lora+prompt", "embeddings+adapter"]


def _model(preset: str, **kw):
    torch.manual_seed(0)
    return pretune.build_model(preset, dropout=0.0, attn_dropout=0.0, **kw).eval()


def _inputs(model, B: int = 4, T: int = 10):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, model.config.vocab_size, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:] = 0  # right padding on one row
    kw = {"decoder_input_ids": ids[:, :6]} if model.config.arch == "encoder-decoder" else {}
    return ids, mask, kw


def _randomise(model, name: str, seed: int) -> None:
    """Give adapter ``name`` non-trivial weights (LoRA B, adapter up-projections start at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in peft.adapter_parameters(model, name).items():
            if pname.endswith(".ia3." + name) or ".ia3." in pname:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _close(a, b, tol=1e-5):
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < tol, (a - b).abs().max().item()


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("method", ["lora", "ia3", "adapter"])
def test_weight_methods_start_as_the_base_model(preset, method):
    base = _model(preset)
    ids, mask, kw = _inputs(base)
    want = base(ids, attention_mask=mask, **kw).logits
    peft.inject(base, PeftConfig(method=method))
    _close(base(ids, attention_mask=mask, **kw).logits, want, 1e-5)


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_mixed_batch_equals_each_example_alone(preset, method):
    model = _model(preset)
    cfg_a = PeftConfig(method=method, r=4, n_virtual=3)
    cfg_b = PeftConfig(method=method.replace("embeddings+", ""), r=2, n_virtual=5, reduction_factor=8)
    peft.inject(model, cfg_a, "a", train=False)
    peft.inject(model, cfg_b, "b", train=False)
    _randomise(model, "a", 1)
    _randomise(model, "b", 2)
    ids, mask, kw = _inputs(model)
    names = ["a", None, "b", "b"] if "embeddings" not in method else ["b", None, "b", "b"]
    with peft.route(model, names):
        mixed = model(ids, attention_mask=mask, **kw).logits
    for i, n in enumerate(names):
        peft.set_active(model, n)
        one = {k: v[i:i + 1] for k, v in kw.items()}
        alone = model(ids[i:i + 1], attention_mask=mask[i:i + 1], **one).logits
        _close(mixed[i:i + 1], alone, 2e-5)


def test_routing_changes_only_the_routed_rows():
    model = _model("tiny-gpt2")
    peft.inject(model, PeftConfig(method="lora"), "a", train=False)
    _randomise(model, "a", 3)
    ids, mask, _ = _inputs(model)
    peft.set_active(model, None)
    plain = model(ids, attention_mask=mask).logits
    with peft.route(model, [None, "a", None, None]):
        out = model(ids, attention_mask=mask).logits
    _close(out[[0, 2, 3]], plain[[0, 2, 3]], 1e-6)
    assert (out[1] - plain[1]).abs().max() > 1e-3


@pytest.mark.parametrize("preset", FAMILIES)
def test_merge_and_unmerge(preset):
    model = _model(preset)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    peft.inject(model, PeftConfig(method="lora+ia3", r=4, ia3_targets=["k_proj", "down_proj"]), "a", train=False)
    _randomise(model, "a", 4)
    ids, mask, kw = _inputs(model)
    unmerged = model(ids, attention_mask=mask, **kw).logits
    peft.merge(model)
    _close(model(ids, attention_mask=mask, **kw).logits, unmerged, 1e-5)
    plain = peft.merged_model(model, "a")
    _close(plain(ids, attention_mask=mask, **kw).logits, unmerged, 1e-5)
    assert not any(isinstance(m, peft.PeftLinear) for m in plain.modules())
    peft.unmerge(model)
    _close(model(ids, attention_mask=mask, **kw).logits, unmerged, 1e-5)
    peft.strip_peft(model)
    for k, v in model.state_dict().items():
        assert (v - before[k]).abs().max().item() <= 1e-6, k


def test_merging_an_additive_method_is_refused():
    model = _model("tiny-gpt2")
    peft.inject(model, PeftConfig(method="lora+adapter"), "a")
    with pytest.raises(PeftError, match="only LoRA and \\(IA\\)3 merge"):
        peft.merge(model)


@pytest.mark.parametrize("method", ["lora", "ia3", "adapter", "prefix", "prompt", "embeddings", "lora+prompt"])
def test_training_changes_only_adapter_and_head(method):
    model = _model("tiny-bert-base", head="classification", num_labels=3)
    peft.inject(model, PeftConfig(method=method, n_virtual=4))
    base = {k: v.clone() for k, v in base_state(model).items()}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained, "nothing trainable"
    for n in trained:
        assert n.startswith("head.") or is_peft_parameter(n) or (
            "embeddings" in method and n == "transformer.embed.weight"), n
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    ids, mask, _ = _inputs(model)
    labels = torch.tensor([0, 1, 2, 1])
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(ids, attention_mask=mask).logits, labels)
        opt.zero_grad()
        loss.backward()
        for n, p in model.named_parameters():
            assert (p.grad is not None) == (n in trained), n
        opt.step()
    after = base_state(model)
    changed = {k for k in base if not torch.equal(base[k], after[k])}
    allowed = {k for k in base if k.startswith("head.")} | (
        {"transformer.embed.weight"} if "embeddings" in method else set())
    assert changed <= allowed, changed - allowed  # every base weight bitwise unchanged
    assert changed & {k for k in base if k.startswith("head.")}  # the head did train


def test_trainable_fraction_of_lora_is_small():
    model = _model("bert-base", head="classification", num_labels=2)
    s = peft.inject(model, PeftConfig(method="lora", r=8))
    head = sum(p.numel() for p in model.head.parameters())
    assert s["trainable"] == 12 * 2 * (8 * 768 + 768 * 8) + head  # A and B of q and v in 12 layers + head
    assert s["fraction"] < 0.02


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_adapter_folder_round_trip(preset, method, tmp_path):
    head = {"head": "classification", "num_labels": 3, "labels": ["x", "y", "z"]}
    model = _model(preset, **head)
    peft.inject(model, PeftConfig(method=method, r=4, n_virtual=3), "mine")
    _randomise(model, "mine", 5)
    ids, mask, kw = _inputs(model)
    kw = {}
    want = model(ids, attention_mask=mask, **kw).logits
    peft.save_adapter(model, tmp_path / "ad", base="somewhere")
    fresh = _model(preset, **head)
    with torch.no_grad():  # a different head in the base: the adapter's own head must be used
        for p in fresh.head.parameters():
            p.add_(1.0)
    if "embeddings" in method:  # the trained embeddings travel with the adapter
        fresh.transformer.embed.weight.data.copy_(_model(preset).transformer.embed.weight)
    assert peft.load_adapter(fresh, tmp_path / "ad") == "mine"
    _close(fresh(ids, attention_mask=mask, **kw).logits, want, 1e-5)
    meta = peft.read_meta(tmp_path / "ad")
    hf_layout = method == "lora" and peft.hf_places(model, []) is not None  # LoRA of an HF-exportable config
    assert meta["layout"] == ("peft" if hf_layout else "pretune")
    assert (tmp_path / "ad" / "adapter_config.json").is_file() == hf_layout


def test_adapter_file_is_a_small_fraction_of_the_model(tmp_path):
    model = _model("tiny-bert-base", head="classification", num_labels=2)
    peft.inject(model, PeftConfig(method="lora", r=4))
    peft.save_adapter(model, tmp_path / "ad")
    pretune.save(model, tmp_path / "full")
    small = (tmp_path / "ad" / "adapter_model.safetensors").stat().st_size
    full = (tmp_path / "full" / "model.safetensors").stat().st_size
    assert small < 0.15 * full


# ------------------------------------------------------------------------------- bad input
def test_target_matching_nothing_names_the_layers():
    model = _model("tiny-bert-base")
    with pytest.raises(PeftError, match="'query' matches no linear layer.*q_proj"):
        peft.inject(model, PeftConfig(method="lora", targets=["query"]))


@pytest.mark.parametrize("r, match", [(0, "rank must be >= 1"), (-2, "rank must be >= 1"),
                                      (10_000, "larger than layer")])
def test_bad_rank(r, match):
    model = _model("tiny-gpt2")
    with pytest.raises(pretune.ConfigError, match=match):
        peft.inject(model, PeftConfig(method="lora", r=r))


def test_unknown_method_and_duplicate_name():
    model = _model("tiny-gpt2")
    with pytest.raises(pretune.ConfigError, match="unknown method 'lorra'"):
        peft.inject(model, PeftConfig(method="lorra"))
    peft.inject(model, PeftConfig(method="lora"), "a")
    with pytest.raises(PeftError, match="already has an adapter named 'a'"):
        peft.inject(model, PeftConfig(method="ia3"), "a")
    with pytest.raises(PeftError, match="row 1: no adapter named 'zz'"):
        with peft.route(model, ["a", "zz"]):
            pass


@pytest.mark.parametrize("method", ["lora", "adapter"])
def test_adapter_for_a_different_base_is_refused(method, tmp_path):
    model = _model("tiny-bert-base")
    peft.inject(model, PeftConfig(method=method))
    peft.save_adapter(model, tmp_path / "ad")
    other = _model("tiny-bert-base", dim=64, n_heads=4, ffn_dim=128)
    with pytest.raises(PeftError, match="different base model: its dim is"):
        peft.load_adapter(other, tmp_path / "ad")


@pytest.mark.parametrize("change,field", [(dict(sliding_window=4), "sliding_window"),
                                          (dict(norm="rmsnorm_plus_one"), "norm"), (dict(qk_norm=True), "qk_norm")])
def test_adapter_for_a_base_of_the_same_shapes_with_other_options_is_refused(change, field, tmp_path):
    """A Llama adapter is not a Mistral or Gemma adapter, though every tensor fits."""
    model = _model("tiny-llama")
    peft.inject(model, PeftConfig(method="lora"))
    peft.save_adapter(model, tmp_path / "ad")
    with pytest.raises(PeftError, match=f"different base model: its {field} is"):
        peft.load_adapter(_model("tiny-llama", **change), tmp_path / "ad")


def test_adapter_for_a_bart_with_another_decoder_is_refused(tmp_path):
    model = _model("tiny-bart-base")
    peft.inject(model, PeftConfig(method="lora"))
    peft.save_adapter(model, tmp_path / "ad")
    with pytest.raises(PeftError, match="different base model: its decoder_ffn_dim is None, this model's is 96"):
        peft.load_adapter(_model("tiny-bart-base", decoder_ffn_dim=96), tmp_path / "ad")


def test_prefix_tuning_an_encoder_decoder_whose_decoder_has_other_heads():
    """decoder_heads: BART's decoder may have its own head count. Without head_dim every stack's keys/values are
    dim wide and prefixes fit; with head_dim (T5) the widths differ and prefix tuning is refused by name."""
    model = _model("tiny-bart-base", decoder_heads=2)
    peft.inject(model, PeftConfig(method="prefix", n_virtual=3))
    _randomise(model, "default", 6)
    ids, mask, kw = _inputs(model)
    assert model(ids, attention_mask=mask, **kw).logits.isfinite().all()
    with pytest.raises(PeftError, match=r"one key/value width in every self-attention layer, got \[16, 32\]"):
        peft.inject(_model("tiny-t5-small", decoder_heads=2), PeftConfig(method="prefix"))


def test_peft_file_with_wrong_shapes_is_refused(tmp_path):
    model = _model("tiny-gpt2")
    peft.inject(model, PeftConfig(method="lora"))
    peft.save_adapter(model, tmp_path / "ad")
    (tmp_path / "ad" / "pretune_adapter.json").unlink()  # as if written by peft: no base record
    other = _model("tiny-gpt2", dim=64, n_heads=4, ffn_dim=128)
    with pytest.raises(PeftError, match="do not fit"):
        peft.load_adapter(other, tmp_path / "ad")


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
@pytest.mark.parametrize("method", ["prefix", "prompt", "lora+adapter"])
def test_incremental_decoding_with_an_adapter_equals_the_full_forward(preset, method):
    """Generation runs the model step by step with the KV cache: prefixes and soft prompts must stay
    consistent across steps (positions, masks)."""
    model = _model(preset)
    peft.inject(model, PeftConfig(method=method, n_virtual=3))
    _randomise(model, "default", 6)
    ids, _, _ = _inputs(model, B=2, T=8)
    full = model(ids).logits
    out = model(ids[:, :5], use_cache=True)
    steps = [out.logits[:, -1]]
    for t in range(5, 8):
        out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits[:, -1])
    _close(torch.stack(steps, 1), full[:, 4:8], 2e-5)


def test_prefix_reparametrisation_trains_and_slices_per_layer():
    model = _model("tiny-bert-base", head="classification", num_labels=2)
    peft.inject(model, PeftConfig(method="prefix", n_virtual=3, prefix_projection=16))
    enc = model.peft_prefix["default"]
    with torch.no_grad():
        whole = enc.mlp(enc.embedding).view(3, *enc.shape[:2], enc.shape[3]).permute(1, 2, 0, 3)  # (L, 2, P, kv)
    for i in range(enc.shape[0]):
        _close(enc.layer(i), whole[i], 1e-6)
    ids, mask, _ = _inputs(model)
    loss = model(ids, attention_mask=mask).logits.sum()
    loss.backward()
    assert enc.embedding.grad is not None and enc.mlp[0].weight.grad is not None


def test_prompt_tuning_starts_from_embeddings_as_the_stack_sees_them():
    """Gemma scales token embeddings by sqrt(dim) in the stack: vocabulary-initialised virtual tokens start scaled
    the same way, so they look like the tokens they were drawn from."""
    model = _model("tiny-llama", scale_embeddings=True)
    peft.inject(model, PeftConfig(method="prompt", n_virtual=3, prompt_init="vocab"), "p")
    prompt = next(p for n, p in model.named_parameters() if n.endswith("p.embedding"))
    scaled = model.transformer.embed.weight * model.config.dim ** 0.5
    for row in prompt:
        assert torch.isclose(scaled, row).all(-1).any()
