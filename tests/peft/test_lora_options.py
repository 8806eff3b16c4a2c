"""LoRA options users of LLMs expect, with peft parity: rsLoRA scaling and target_modules="all-linear"."""

import json

import pytest
import torch

import pretune
from pretune import peft as ppeft

transformers = pytest.importorskip("transformers")
hf_peft = pytest.importorskip("peft")

CFG = dict(vocab_size=97, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, pad_token_id=0)


@pytest.fixture()
def base(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def _inputs():
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def _randomize(params: dict) -> None:
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in params.values():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


def test_rslora_scales_by_alpha_over_sqrt_r_and_moves_both_ways(base, tmp_path):
    ours = pretune.from_hf(base)
    ppeft.inject(ours, ppeft.PeftConfig(method="lora", r=4, alpha=8, rslora=True), "a")
    layer = ours.get_submodule("transformer.decoder.layers.0.attn.q_proj")
    assert layer.lora_scaling["a"] == pytest.approx(8 / 2)  # alpha / sqrt(4), not alpha / 4
    _randomize(ppeft.adapter_parameters(ours, "a"))
    ours.eval()
    ids, mask = _inputs()
    with torch.no_grad():
        want = ours(ids, attention_mask=mask).logits
    ppeft.save_adapter(ours, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["use_rslora"] is True and cfg["lora_alpha"] == 8 and cfg["r"] == 4
    hf = transformers.LlamaForCausalLM.from_pretrained(base)
    pm = hf_peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = pm(input_ids=ids, attention_mask=mask).logits
    assert (got - want).abs().max().item() < 1e-4
    again = pretune.from_hf(base)  # and peft's folder back into pretune, rsLoRA kept
    ppeft.load_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        assert (again(ids, attention_mask=mask).logits - want).abs().max().item() < 1e-5


def test_all_linear_targets_every_body_linear_like_peft(base, tmp_path):
    ours = pretune.from_hf(base)
    ppeft.inject(ours, ppeft.PeftConfig(method="lora", r=2, alpha=4, targets=["all-linear"]), "a")
    wrapped = {n.rsplit(".", 1)[-1] for n, m in ours.named_modules() if hasattr(m, "lora_A") and "a" in m.lora_A}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("lora" in n for n, _ in ours.head.named_parameters())  # the output layer is not a target
    hf = hf_peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(base),
                                hf_peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    hf_trainable = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    assert sum(p.numel() for p in ppeft.adapter_parameters(ours, "a").values()) == hf_trainable
    with pytest.raises(ppeft.PeftError, match="give it alone"):
        ppeft.inject(pretune.from_hf(base), ppeft.PeftConfig(method="lora", targets=["all-linear", "q_proj"]), "b")


def _gpt2(path):
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4)
                                 ).save_pretrained(path)
    return transformers.GPT2LMHeadModel, ["q_proj", "k_proj", "v_proj", "o_proj"], ["c_attn", "c_proj"]


def _llama(path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).save_pretrained(path)
    return transformers.LlamaForCausalLM, ["q_proj", "v_proj", "down_proj"], ["q_proj", "v_proj", "down_proj"]


@pytest.mark.parametrize("family", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_dora_starts_at_the_base_and_moves_both_ways_with_peft(family, tmp_path):
    cls, ours_targets, hf_targets = family(tmp_path / "base")
    ids, mask = _inputs()
    ours = pretune.from_hf(tmp_path / "base").eval()
    with torch.no_grad():
        base = ours(ids, attention_mask=mask).logits
    ppeft.inject(ours, ppeft.PeftConfig(method="lora", r=2, alpha=4, targets=ours_targets, dora=True), "a")
    with torch.no_grad():  # B = 0 and m = ||W0||: the identity
        assert (ours(ids, attention_mask=mask).logits - base).abs().max().item() < 1e-5
    _randomize(ppeft.adapter_parameters(ours, "a"))  # magnitudes too: m is no longer the row norm
    with torch.no_grad():
        for n, p in ppeft.adapter_parameters(ours, "a").items():
            if "lora_magnitude" in n:
                p.abs_().add_(0.5)
        want = ours(ids, attention_mask=mask).logits
    ppeft.save_adapter(ours, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["use_dora"] is True
    pm = hf_peft.PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    with torch.no_grad():
        got = pm(input_ids=ids, attention_mask=mask).logits
    assert (got - want).abs().max().item() < 1e-4
    # peft's own DoRA adapter (random A, B, magnitude) loads into pretune with equal logits
    hf = hf_peft.get_peft_model(cls.from_pretrained(tmp_path / "base"), hf_peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=hf_targets, use_dora=True, init_lora_weights=False,
        fan_in_fan_out=family is _gpt2))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "lora_magnitude" in n:
                p.mul_(1.3)
    hf.save_pretrained(tmp_path / "theirs")
    hf.eval()
    mine = pretune.from_hf(tmp_path / "base").eval()
    ppeft.load_adapter(mine, tmp_path / "theirs")
    with torch.no_grad():
        diff = mine(ids, attention_mask=mask).logits - hf(input_ids=ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max().item() < 1e-4


def test_dora_gradients_match_peft_and_merging_is_exact(tmp_path):
    cls, targets, _ = _llama(tmp_path / "base")
    ids, mask = _inputs()
    ours = pretune.from_hf(tmp_path / "base")
    ppeft.inject(ours, ppeft.PeftConfig(method="lora", r=2, alpha=4, targets=targets, dora=True), "a")
    _randomize(ppeft.adapter_parameters(ours, "a"))
    ppeft.save_adapter(ours, tmp_path / "adapter")
    pm = hf_peft.PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "base"), tmp_path / "adapter",
                                           is_trainable=True)
    labels = ids.masked_fill(mask == 0, -100)
    ours(ids, attention_mask=mask, labels=labels).loss.backward()
    pm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    layer = ours.get_submodule("transformer.decoder.layers.0.attn.q_proj")
    theirs = pm.base_model.model.model.layers[0].self_attn.q_proj
    torch.testing.assert_close(layer.lora_magnitude["a"].grad, theirs.lora_magnitude_vector["default"].weight.grad,
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(layer.lora_B["a"].weight.grad, theirs.lora_B["default"].weight.grad,
                               atol=1e-5, rtol=1e-4)
    ours.eval()
    with torch.no_grad():
        want = ours(ids, attention_mask=mask).logits
        w0 = layer.base_layer.weight.clone()
        layer.merge("a")
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, want, atol=1e-5, rtol=1e-5)
        layer.unmerge("a")
        torch.testing.assert_close(layer.base_layer.weight, w0, atol=1e-6, rtol=1e-5)
