"""peft.base_dtype=nf4 | int8 (QLoRA, issue 36 part 2): the frozen linear weights of a PEFT run stored quantised
(torchao's NF4, or int8 per output channel), the adapters fp32 and trained through the dequantised weights, adapters
saved in peft's layout that load on the unquantised base — in pretune and with peft on a transformers model.

Tolerances: a quantised base's logits against the fp32 base's, relative error (Frobenius) below 0.35 for nf4 and 0.04
for int8 (random tiny weights: measured ~0.2 and ~0.015); peft against pretune on the same unquantised base, 1e-4 (as
tests/peft/test_peft_parity.py)."""

from __future__ import annotations

import pytest
import torch
from test_base_dtype import _overrides, setup  # noqa: F401  (the tiny SFT run's fixture)

import pretune
from pretune import peft
from pretune.config import ConfigError
from pretune.model import QuantizedLinear

pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")
hf_peft = pytest.importorskip("peft")

TOL = {"nf4": 0.35, "int8": 0.04}
STORED = {"nf4": 0.2, "int8": 0.3}  # issue 36: resident frozen weights against fp32


def _hf_base(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _ids():
    return torch.randint(1, 96, (2, 10), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(("fmt", "dora"), [("nf4", False), ("int8", True)])
def test_qlora_trains_the_adapter_on_a_quantised_base_and_saves_it_for_the_fp32_base(fmt, dora, tmp_path):
    base = _hf_base(tmp_path)
    ours = pretune.from_hf(base)
    ref = pretune.from_hf(base)
    lin_bytes = sum(m.weight.numel() * 4 for m in ours.modules() if type(m) is torch.nn.Linear)
    cfg = dict(method="lora", r=4, alpha=8, targets=["all-linear"], dora=dora)
    summary = peft.inject(ours, peft.PeftConfig(**cfg, base_dtype=fmt), seed=0)
    peft.inject(ref, peft.PeftConfig(**cfg), seed=0)
    wrapped = [m for m in ours.modules() if isinstance(m, peft.layers.PeftLinear)]
    assert len(wrapped) == 14 and all(isinstance(m.base_layer, QuantizedLinear) for m in wrapped)
    stored = ours.quantization["bytes"]
    assert stored <= STORED[fmt] * lin_bytes and summary["base_bytes_saved"] == lin_bytes - stored
    assert all(p.dtype == torch.float32 for p in ours.parameters() if p.requires_grad)
    x = _ids()
    with torch.no_grad():  # B = 0: the adapted model is its base (DoRA's magnitudes set from the quantised rows)
        peft.set_active(ours, None)
        bare = ours(x).logits
        peft.set_active(ours, "default")
        start = ours(x).logits
        assert _rel(start, bare) < 1e-5 and _rel(start, ref(x).logits) < TOL[fmt]

    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2)
    codes = [b.clone() for m in wrapped for b in m.base_layer.buffers()]
    losses = []
    for _ in range(8):
        loss = ours(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.05
    assert all(torch.equal(a, b) for a, b in zip(codes, [b for m in wrapped for b in m.base_layer.buffers()]))

    ours.eval()
    with torch.no_grad():
        trained = ours(x).logits
    peft.save_adapter(ours, tmp_path / "adapter")
    plain = pretune.from_hf(base)  # the unquantised base with the adapter, in pretune ...
    peft.load_adapter(plain, tmp_path / "adapter")
    pm = hf_peft.PeftModel.from_pretrained(  # ... and with peft on the transformers model
        transformers.LlamaForCausalLM.from_pretrained(base).eval(), tmp_path / "adapter").eval()
    with torch.no_grad():
        got, want = plain.eval()(x).logits, pm(input_ids=x).logits
    assert (got - want).abs().max().item() < 1e-4
    assert _rel(got, trained) < TOL[fmt]  # the adapter trained on the quantised base fits the fp32 one
    merged = peft.merged_model(ours)  # dequantised, then merged in fp32
    with torch.no_grad():  # (int8 outside autograd runs its kernel, with bf16 activations: 8 bits of mantissa)
        assert _rel(merged(x).logits, trained) < (1e-4 if fmt == "nf4" else 1e-2)
    with pytest.raises(peft.PeftError, match="cannot merge into a quantised base layer"):
        peft.merge(ours)


def test_bad_base_dtypes_are_named():
    with pytest.raises(ConfigError, match=r"peft.base_dtype='nf2': expected one of fp32, bf16, auto, nf4, int8"):
        peft.PeftConfig(method="lora", base_dtype="nf2").validated()
    with pytest.raises(ConfigError, match=r"peft.base_dtype=nf4 stores the frozen base of a PEFT run quantised"):
        peft.config.base_dtype_for(peft.PeftConfig(base_dtype="nf4"), "fp32")


def test_nf4_dequantises_to_torchaos_values():
    """NF4Linear's faster dequantisation (a code-byte table) gives torchao's get_original_weight bitwise; a weight that
    is not a whole number of 64-weight blocks (a tiny model's 32 x 37) is padded with zeros, which change nothing."""
    from pretune.model.fast.quantized import NF4Linear

    layer = NF4Linear(torch.randn(96, 128, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(layer.dequantized(torch.bfloat16), layer.nf4.get_original_weight())
    w = torch.randn(32, 37, generator=torch.Generator().manual_seed(1))
    odd = NF4Linear(w)
    flat = odd.nf4.get_original_weight()  # 1216 = 19 blocks: the 1184 weights, then zeros
    assert flat.shape == (1216,) and not flat[1184:].any()
    assert torch.equal(odd.dequantized(torch.bfloat16), flat[:1184].view(32, 37))
    whole = NF4Linear(torch.cat([w.flatten(), torch.zeros(32)]).view(32, 38))  # the same blocks, zeros in the weight
    assert torch.equal(odd.dequantized().flatten(), whole.dequantized().flatten()[:1184])
    assert _rel(odd.dequantized(), w) < 0.15


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_qlora_base_computes_the_same_with_and_without_gradients(fmt, precision, tmp_path):
    """A pass without gradients (a DPO reference pass with the adapters off, dev scoring) runs the quantised base as
    the training pass does — through the dequantised weight, not int8's kernel with its bf16 activations (which gave
    logits 6e-4 (fp32) / 4e-3 (bf16) away here) — so at B = 0 the policy equals its reference."""
    base = _hf_base(tmp_path)
    model = pretune.from_hf(base)
    peft.inject(model, peft.PeftConfig(method="lora", r=4, alpha=8, targets=["all-linear"], base_dtype=fmt), seed=0)
    x = _ids()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    bases = [m.base_layer for m in model.modules() if isinstance(m, peft.layers.PeftLinear)]
    with ctx:
        model.train()
        policy = model(x).logits.float().detach()  # the adapters' outputs need gradients: the autograd path
        with torch.no_grad():
            peft.set_active(model, None)
            model.eval()
            reference = model(x).logits.float()
            q = next(b for b in bases if b.joint is None)
            xq = torch.randn(3, q.in_features, generator=torch.Generator().manual_seed(0))
            alone = q(xq)
        peft.set_active(model, "default")
        assert torch.equal(alone, q(xq.requires_grad_()).detach())
    assert (policy - reference).abs().max().item() < 1e-6


@pytest.mark.slow
def test_sft_finetune_on_an_nf4_base(setup, tmp_path):  # noqa: F811
    """pretune finetune --task sft with peft.base_dtype=nf4 (slow: a whole run): it trains, says what it stored, and
    the adapter it saves loads on the unquantised base it recorded."""
    import json

    from pretune.jobs.finetune import finetune, load_finetune_config

    lines = []
    cfg = load_finetune_config(None, _overrides(setup, tmp_path / "run", "peft.base_dtype=nf4"))
    run = finetune(cfg, show_progress=False, log=lines.append)
    assert any(x.startswith("frozen base: nf4 (") and "MB saved" in x for x in lines)
    res = json.loads((run.run_dir / "results.json").read_text())
    assert res["peft"]["base_dtype"] == "nf4"
    from pretune.io.checkpoint import read_weights

    trained = read_weights(run.model_dir / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and float(v.abs().max()) > 0 for k, v in trained.items())
    plain = pretune.load(run.model_dir)  # the adapter on the fp32 base it recorded
    assert not any(isinstance(m, QuantizedLinear) for m in plain.modules())
