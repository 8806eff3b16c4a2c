"""LoRA adapters move between pretune and the ``peft`` library with the same outputs, both ways.

Random-weight Hugging Face models from tiny configs (never downloads); LoRA B is random (non-zero),
so the adapters really change the outputs."""

from __future__ import annotations

import pytest
import torch

import pretune
from pretune import peft as ppeft

transformers = pytest.importorskip("transformers")
hf_peft = pytest.importorskip("peft")


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _bert():
    cfg = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3,
                                  id2label={0: "neg", 1: "neu", 2: "pos"}, label2id={"neg": 0, "neu": 1, "pos": 2})
    return transformers.BertForSequenceClassification(cfg)


# (HF model builder, peft target modules, peft extras, pretune target patterns for the reverse direction)
CASES = {
    "gpt2": (_gpt2, ["c_attn", "c_proj"], {"fan_in_fan_out": True}, ["q_proj", "v_proj", "down_proj"]),
    "llama": (_llama, ["q_proj", "k_proj", "v_proj", "down_proj"], {}, ["q_proj", "v_proj", "gate_proj"]),
    "bert": (_bert, ["query", "value", "output.dense"], {"task_type": "SEQ_CLS"}, ["q_proj", "k_proj", "o_proj"]),
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 96, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[2, 8:] = 0
    return ids, mask


def _base(family, tmp_path):
    torch.manual_seed(0)
    hf = CASES[family][0]().eval()
    hf.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def _hf_model(family, base):
    cls = type(CASES[family][0]())
    with torch.device("cpu"):
        return cls.from_pretrained(base).eval()


@pytest.mark.parametrize("family", list(CASES))
def test_peft_adapter_loads_into_pretune_with_equal_logits(family, tmp_path):
    base = _base(family, tmp_path)
    _, targets, extra, _ = CASES[family]
    torch.manual_seed(1)
    ranks = {k: 2 for k in ("c_proj", "down_proj") if k in targets}  # per-module ranks and alphas too
    alphas = {k: 5.0 for k in ("value",) if k in targets}
    lcfg = hf_peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets, init_lora_weights=False,
                              rank_pattern=ranks, alpha_pattern=alphas, **extra)
    pm = hf_peft.get_peft_model(_hf_model(family, base), lcfg).eval()
    if family == "bert":  # the trained classifier copy differs from the base's classifier
        with torch.no_grad():
            for p in pm.base_model.model.classifier.modules_to_save["default"].parameters():
                p.normal_(0, 0.5)
    pm.save_pretrained(tmp_path / "adapter")
    ids, mask = _inputs()
    with torch.no_grad():
        want = pm(input_ids=ids, attention_mask=mask).logits

    ours = pretune.from_hf(base)
    ppeft.load_adapter(ours, tmp_path / "adapter", name="hf")
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
    if family != "bert":  # LM logits: compare the real (unpadded) positions
        want, got = want[mask.bool()], got[mask.bool()]
    assert (got - want).abs().max().item() < 1e-4
    plain = pretune.from_hf(base)
    with torch.no_grad():  # the adapter did change the model
        before = plain(ids, attention_mask=mask).logits
    assert (ours(ids, attention_mask=mask).logits - before).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", list(CASES))
def test_pretune_adapter_loads_in_peft_with_equal_logits(family, tmp_path):
    base = _base(family, tmp_path)
    ours = pretune.from_hf(base)
    targets = CASES[family][3]
    ppeft.inject(ours, ppeft.PeftConfig(method="lora", r=3, alpha=7, targets=targets), "mine")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in ppeft.adapter_parameters(ours, "mine").values():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        if family == "bert":
            for p in ours.head.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    ours.eval()
    ids, mask = _inputs()
    with torch.no_grad():
        want = ours(ids, attention_mask=mask).logits
    ppeft.save_adapter(ours, tmp_path / "adapter")
    pm = hf_peft.PeftModel.from_pretrained(_hf_model(family, base), tmp_path / "adapter").eval()
    with torch.no_grad():
        got = pm(input_ids=ids, attention_mask=mask).logits
    if family != "bert":
        want, got = want[mask.bool()], got[mask.bool()]
    assert (got - want).abs().max().item() < 1e-4

    # and back again: the peft-layout folder loads into pretune unchanged
    again = pretune.from_hf(base)
    ppeft.load_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        back = again(ids, attention_mask=mask).logits
    if family != "bert":
        back = back[mask.bool()]
    assert (back - want).abs().max().item() < 1e-5


def test_gpt2_fused_qkv_with_one_shared_a_stays_rank_r(tmp_path):
    """A peft c_attn LoRA (one A for q, k and v) imported and exported again keeps rank r."""
    base = _base("gpt2", tmp_path)
    pm = hf_peft.get_peft_model(_hf_model("gpt2", base), hf_peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True))
    pm.save_pretrained(tmp_path / "a1")
    ours = pretune.from_hf(base)
    ppeft.load_adapter(ours, tmp_path / "a1")
    ppeft.save_adapter(ours, tmp_path / "a2")
    import json

    cfg = json.loads((tmp_path / "a2" / "adapter_config.json").read_text())
    assert cfg["fan_in_fan_out"] is True and cfg["target_modules"] == ["transformer.h.0.attn.c_attn",
                                                                       "transformer.h.1.attn.c_attn"]
