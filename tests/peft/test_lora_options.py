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
