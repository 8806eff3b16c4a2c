"""Quantised linears (model/fast/quantized.py, ``pretune.quantize``): each format multiplies by the weights its codes
stand for, a quantised model's logits stay close to fp32 for every decoder family, the flat decoding step computes
what the quantised forward computes (through the stacked quantised matrices, no fallback), and generation works on it,
LoRA adapters on top included.

Tolerances: a layer against ``F.linear`` with its dequantised weight, 1e-2 of the output's scale (the kernels take
bf16 activations: 8 bits of mantissa); a whole tiny model's logits against fp32, relative error (Frobenius) below 0.04
for int8 and 0.35 for int4 (measured 0.008-0.017 and 0.08-0.24 on these perturbed random models, whose logits carry
little signal); the flat step against the quantised forward, 1e-5 (the same kernels on the same values)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from decoder_fixtures import ids, perturbed
from test_decode_step import FAMILIES, _assert_steps_bitwise, tiny

import pretune
from pretune import peft
from pretune.generation import generate
from pretune.model.fast.decode_step import FlatDecoder, _why_not
from pretune.model.fast.quantized import Int4Linear, Int8Linear, QuantizedLinear, QuantizedLMHead, dequantize

TOL = {"int8": 0.04, "int4": 0.35}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("shape", [(48, 64), (100, 24)])  # (out, in); the second padded for both kernels
@pytest.mark.parametrize("rows", [1, 3, 40])  # one token, a few rows, a prompt's many: the kernels
def test_a_layer_multiplies_by_its_dequantised_weight(fmt, shape, rows):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(*shape, generator=g), torch.randn(shape[0], generator=g)
    layer = fmt(w, b)
    x = torch.randn(2, rows, shape[1], generator=g)
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (2, rows, shape[0]) and y.dtype == torch.float32
    assert _rel(y, F.linear(x, layer.weight, b)) < 1e-2
    err = (layer.weight - w).abs()
    if fmt is Int8Linear:  # rounding to the nearest code: at most half a step of the row's scale
        assert bool((err <= layer.scales[:, None] / 2 * 1.001).all())
    else:
        assert float(err.max()) <= float((w.amax() - w.amin()) / 15 / 2) * 1.05  # half a step of the widest group


def test_a_layer_trains_what_is_above_it_not_its_weight():
    """QLoRA's path: the input's gradient through the dequantised weight; nothing for the frozen codes."""
    w = torch.randn(32, 64)
    layer = Int8Linear(w)
    x = torch.randn(5, 64, requires_grad=True)
    layer(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, layer.weight).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)
    assert not any(p.requires_grad for p in layer.parameters())


def _tiny(family: str):
    return perturbed(tiny(**FAMILIES[family]))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_quantised_is_close_to_fp32_and_decodes_flat(family, mode):
    model = _tiny(family)
    x = ids(2, 9)
    with torch.no_grad():
        want = model(x).logits
        assert pretune.quantize(model, mode) is model
        got = model(x).logits
    assert _rel(got, want) < TOL[mode]
    assert model.quantization["weights"] > 0
    assert _why_not(model) is None
    flat = FlatDecoder.of(model)
    for layer in flat.layers:  # the step multiplies by the stacked quantised matrices itself
        assert layer.project is None or family == "qwen3"  # (per-head q/k norms: the attention's own projection)
        assert layer.ffn is None and layer.up_mm is not None and layer.down_mm is not None
    _assert_steps_bitwise(model, steps=4, batch=3 if mode == "int8" else 1, exact=False, bitwise=False)


def test_the_head_is_int8_by_default_and_fp32_on_request():
    model = _tiny("llama-untied")
    pretune.quantize(model, "int4")
    assert type(model.head) is QuantizedLMHead and isinstance(model.head.head_quantized, Int8Linear)
    assert "head.weight" in model.state_dict() and not any("head_quantized" in k for k in model.state_dict())
    plain = pretune.quantize(_tiny("llama-untied"), "int4", head=None)
    assert type(plain.head) is not QuantizedLMHead
    dequantize(model)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules()) and type(model.head) is not \
        QuantizedLMHead


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_generate_with_lora_on_a_quantised_base(mode):
    """An unmerged LoRA adapter stays fp32 on top of its quantised base layer; greedy generation (with
    min_new_tokens, through the flat step) gives what step-by-step forwards without a cache give."""
    model = _tiny("qwen2")
    peft.inject(model, peft.PeftConfig(method="lora", r=2, targets=["all-linear"]), seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    model.eval()
    x = ids(2, 5)
    with torch.no_grad():
        pretune.quantize(model, mode)
        got = model(x).logits
        same = dequantize(copy.deepcopy(model))(x).logits  # fp32 matmuls by the weights the codes stand for
        peft.set_active(model, None)
        base = model(x).logits
        peft.set_active(model, "default")
    assert _rel(got, same) < 0.02 and _rel(base, same) > 0.1  # the adapter is applied, on the quantised base
    wrappers = [m for m in model.modules() if isinstance(m, peft.layers.PeftLinear)]
    assert wrappers and all(isinstance(m.base_layer, QuantizedLinear) for m in wrappers)
    assert _why_not(model) is None
    out = generate(model, x, max_new_tokens=6, min_new_tokens=6, eos_token_id=3, pad_token_id=0)
    assert out.shape == (2, 11) and not bool((out[:, 5:] == 3).any())
    slow = generate(model, x, max_new_tokens=6, min_new_tokens=6, eos_token_id=3, pad_token_id=0, use_cache=False)
    assert torch.equal(out, slow)


def test_bad_values_are_named():
    model = _tiny("llama")
    with pytest.raises(ValueError, match=r"quantize mode 'int3': expected one of int8, int4, nf4"):
        pretune.quantize(model, "int3")
    with pytest.raises(ValueError, match=r"head='fp8'"):
        pretune.quantize(model, "int8", head="fp8")
    with pytest.raises(ValueError, match=r"int4 group size 48"):
        pretune.quantize(model, "int4", group=48)


def test_cli_quantize_flag(tokenizers_by_kind, tmp_path, capsys):
    """generate --quantize int4 (the model cast to --dtype after quantising) writes what pretune.quantize + generate
    give; prompt takes the flag; bad values and combinations are refused by name."""
    import json

    from pretune.cli import main
    from pretune.cli.generate import _text
    from pretune.generation.scoring import prompt_ids
    from pretune.io.tokenization import Tokenizer

    tok = Tokenizer.load(tokenizers_by_kind["bpe"])
    torch.manual_seed(0)
    model = pretune.build_model("tiny-llama", vocab_size=tok.vocab_size, dropout=0.0, attn_dropout=0.0)
    folder = tmp_path / "m"
    pretune.save(model, folder, tokenizer=tok.tk)
    out = tmp_path / "gen.jsonl"
    assert main(["generate", str(folder), "It is a truth", "--max-new-tokens", "5", "--min-new-tokens", "5",
                 "--quantize", "int4", "--out", str(out), "--no-stream"]) == 0
    got = json.loads(out.read_text())["generated"][0]
    q = pretune.quantize(pretune.load(folder).eval().requires_grad_(False), "int4")
    ids = torch.tensor([prompt_ids("It is a truth", tok, q)])
    eos = q.config.eos_token_id if q.config.eos_token_id is not None else tok.eos_id
    pad = tok.pad_id if tok.pad_id is not None else eos
    new = generate(q, ids, max_new_tokens=5, min_new_tokens=5, eos_token_id=eos, pad_token_id=pad)[0, ids.shape[1]:]
    assert got == _text(new.tolist(), tok, eos, pad)

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": lb}) + "\n" for t, lb in (("a fine day", "pos"),
                                                                                     ("a dull day", "neg"))))
    res = tmp_path / "p.jsonl"
    assert main(["prompt", str(folder), "--data", str(data), "--template", "Text: {text}\nMood:", "--labels",
                 "pos=good,neg=bad", "--out", str(res), "--quiet", "--quantize", "int4"]) == 0
    assert len(res.read_text().splitlines()) == 2

    with pytest.raises(SystemExit):
        main(["generate", str(folder), "x", "--quantize", "int3"])
    assert "invalid choice: 'int3' (choose from int8, int4)" in capsys.readouterr().err.replace("'int8', 'int4'",
                                                                                                  "int8, int4")
    assert main(["generate", str(folder), "x", "--quantize", "int4", "--device", "cuda"]) == 2
    assert "--quantize int4 runs PyTorch's CPU kernels: use --device cpu" in capsys.readouterr().err
    assert main(["generate", str(folder), "x", "--quantize", "int8", "--dtype", "fp16"]) == 2
    assert "--quantize int8 computes in fp32 or bf16, not fp16" in capsys.readouterr().err
