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


def _qwen2():  # biases on q/k/v only
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _with_biases(transformers.Qwen2ForCausalLM(cfg))


def _qwen3():  # per-head q/k RMSNorm, head_dim 12 != 32 / 4
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _with_biases(transformers.Qwen3ForCausalLM(cfg))


def _mistral():  # every layer within a window of 4 keys (the inputs are 11 long), head_dim 12 != 32 / 4
    cfg = transformers.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=12, sliding_window=4,
                                     max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.MistralForCausalLM(cfg)


def _gemma():  # (1 + w) norms, scaled embeddings, GeGLU-tanh, tied head
    cfg = transformers.GemmaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=12,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _with_biases(transformers.GemmaForCausalLM(cfg))


def _gemma2():  # + sandwich norms, soft-capped attention and logits, local layers 0 and 2
    cfg = transformers.Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=12, sliding_window=4,
                                    query_pre_attn_scalar=20, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _with_biases(transformers.Gemma2ForCausalLM(cfg))


def _with_biases(model):
    """HF starts biases at 0 and norms at 1: perturb them so the test sees them."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _bert():
    cfg = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3,
                                  id2label={0: "neg", 1: "neu", 2: "pos"}, label2id={"neg": 0, "neu": 1, "pos": 2})
    return transformers.BertForSequenceClassification(cfg)


def _deberta_v2():  # LoRA on query_proj / key_proj changes the relative-position projections too (share_att_key)
    cfg = transformers.DebertaV2Config(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=64, relative_attention=True,
                                       position_buckets=4, max_relative_positions=8, pos_att_type=["p2c", "c2p"],
                                       share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
                                       type_vocab_size=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _with_biases(transformers.DebertaV2ForMaskedLM(cfg))


# (HF model builder, peft target modules, peft extras, pretune target patterns for the reverse direction)
CASES = {
    "gpt2": (_gpt2, ["c_attn", "c_proj"], {"fan_in_fan_out": True}, ["q_proj", "v_proj", "down_proj"]),
    "llama": (_llama, ["q_proj", "k_proj", "v_proj", "down_proj"], {}, ["q_proj", "v_proj", "gate_proj"]),
    "bert": (_bert, ["query", "value", "output.dense"], {"task_type": "SEQ_CLS"}, ["q_proj", "k_proj", "o_proj"]),
    "qwen2": (_qwen2, ["q_proj", "k_proj", "v_proj", "o_proj"], {}, ["q_proj", "k_proj", "up_proj"]),
    "qwen3": (_qwen3, ["q_proj", "v_proj", "gate_proj"], {}, ["k_proj", "v_proj", "o_proj"]),
    "mistral": (_mistral, ["q_proj", "v_proj", "o_proj", "up_proj"], {}, ["q_proj", "k_proj", "down_proj"]),
    "gemma": (_gemma, ["q_proj", "k_proj", "gate_proj", "down_proj"], {}, ["v_proj", "o_proj", "up_proj"]),
    "gemma2": (_gemma2, ["q_proj", "k_proj", "v_proj", "down_proj"], {}, ["q_proj", "o_proj", "gate_proj"]),
    "deberta-v2": (_deberta_v2, ["query_proj", "key_proj", "output.dense"], {}, ["q_proj", "k_proj", "up_proj"]),
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


BIAS_CASES = [(f, b) for f in ("gpt2", "bert", "qwen2") for b in ("all", "lora_only")]  # Llama has no biases


@pytest.mark.parametrize("family,bias", BIAS_CASES)
def test_lora_bias_option_moves_both_ways(family, bias, tmp_path):
    """LoRA's ``bias`` option (peft's): the trained biases are saved with the adapter, ``adapter_config.json``
    records the option, and peft's PeftModel gives equal logits; a peft adapter with trained biases loads into
    pretune with equal logits."""
    base = _base(family, tmp_path)
    targets = CASES[family][3]
    ours = pretune.from_hf(base)
    summary = ppeft.inject(ours, ppeft.PeftConfig(method="lora", r=3, alpha=7, targets=targets, bias=bias), "mine")
    state = ppeft.peft_state(ours)
    owned = state.owned("mine")
    all_biases = [k for k in ppeft.base_state(ours) if k.endswith(".bias") and not k.startswith("head.")]
    if bias == "all":
        assert sorted(owned) == sorted(all_biases)
    else:  # the biases of the adapted layers only
        assert owned and all(any(f".{t}.bias" in k for t in targets) for k in owned)
        assert len(owned) < len(all_biases)
    lora_numel = sum(p.numel() for p in ppeft.adapter_parameters(ours, "mine").values())
    head_numel = sum(p.numel() for p in ours.head.parameters()) if family == "bert" else 0
    owned_numel = sum(ppeft.base_state(ours)[k].numel() for k in owned)
    assert summary["trainable"] == lora_numel + owned_numel + head_numel
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # as training would: the adapter and the owned biases move
        for p in ppeft.adapter_parameters(ours, "mine").values():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        params = dict(ours.named_parameters())
        for k in owned:
            name = next(n for n in params if n.replace(".base_layer.", ".") == k)
            params[name].add_(0.5 * torch.randn(params[name].shape, generator=g))
    ours.eval()
    ids, mask = _inputs()
    with torch.no_grad():
        want = ours(ids, attention_mask=mask).logits
    ppeft.save_adapter(ours, tmp_path / "adapter")
    import json

    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["bias"] == bias
    pm = hf_peft.PeftModel.from_pretrained(_hf_model(family, base), tmp_path / "adapter").eval()
    with torch.no_grad():
        got = pm(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool() if family != "bert" else slice(None)
    assert (got[keep] - want[keep]).abs().max().item() < 1e-4
    again = pretune.from_hf(base)  # and back into pretune
    ppeft.load_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        assert (again(ids, attention_mask=mask).logits[keep] - want[keep]).abs().max().item() < 1e-5
    assert sorted(ppeft.peft_state(again).owned("mine")) == sorted(owned)

    # a peft adapter with trained biases loads into pretune
    torch.manual_seed(4)
    pm2 = hf_peft.get_peft_model(_hf_model(family, base), hf_peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=CASES[family][1], init_lora_weights=False, bias=bias,
        **CASES[family][2])).eval()
    with torch.no_grad():
        for n, p in pm2.named_parameters():
            if p.requires_grad and n.endswith(".bias"):
                p.add_(0.5 * torch.randn_like(p))
        want2 = pm2(input_ids=ids, attention_mask=mask).logits
    pm2.save_pretrained(tmp_path / "hf_adapter")
    ours2 = pretune.from_hf(base)
    ppeft.load_adapter(ours2, tmp_path / "hf_adapter")
    with torch.no_grad():
        got2 = ours2(ids, attention_mask=mask).logits
    assert (got2[keep] - want2[keep]).abs().max().item() < 1e-4
