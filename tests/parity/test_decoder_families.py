"""Parity with transformers for the decoder families that are Llama plus model-core options: Llama 3.x RoPE
scaling (``rope_scaling="llama3"``), Qwen2 / Qwen2.5 (``qkv_bias``: biases on q/k/v only; a sliding window on the
layers past ``max_window_layers``), Qwen3 (``qk_norm``: RMSNorm on each head's q and k; ``head_dim`` independent of
dim / heads), Mistral (``sliding_window`` on every layer), Gemma (``norm="rmsnorm_plus_one"``, ``scale_embeddings``,
``ffn="geglu_tanh"``) and Gemma 2 (+ ``norm_placement="sandwich"``, ``attn_softcap``, ``logit_softcap``,
``attn_scale`` from query_pre_attn_scalar, ``sliding_layers``).

Random-weight transformers models from unusual tiny configs (GQA, head_dim != dim / n_heads, tied and untied heads,
windows of 3-5 keys on sequences of 7-100 tokens, soft caps small enough to bend the scores), every parameter
perturbed (the q/k/v biases and norm weights too): imported logits within 1e-4 (fp32), greedy and beam-search tokens
identical with pretune's ``generate`` on a left-padded batch, exports that transformers' Auto classes load with the
same logits, identical round trips, and LoRA on the imported model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import pretune
from pretune import peft as ppeft
from pretune.generation import generate

T = pytest.importorskip("transformers")

V = 99
NEW = 8
# wavelengths 2 pi / theta_j of head_dim 16, base 500: 6.3, 13.6, 29.7, 64.5, 140, ... With an original context of 64,
# low_freq_factor 1 and high_freq_factor 8, the first is kept, the next two are blended and the rest divided by 4
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=8.0,
                   original_max_position_embeddings=64)


def _models():
    return {
        "llama3-rope": lambda: T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rope_parameters=dict(LLAMA3_ROPE),
            pad_token_id=0)),
        "qwen2-gqa": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(
            vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rope_parameters=dict(rope_type="default",
                                                                                    rope_theta=300.0),
            rms_norm_eps=1e-5, pad_token_id=0)),
        "qwen2-tied-mqa": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(
            vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=24, max_position_embeddings=128, tie_word_embeddings=True,
            pad_token_id=0)),
        "qwen3-gqa": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(
            vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0)),
        "qwen3-tied-llama3-rope": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(
            vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
            rope_parameters=dict(LLAMA3_ROPE), pad_token_id=0)),
        "qwen2-window": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(  # layers 1 and 2 local
            vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, use_sliding_window=True, sliding_window=4,
            max_window_layers=1, pad_token_id=0)),
        "mistral-window": lambda: T.MistralForCausalLM(T.MistralConfig(
            vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, max_position_embeddings=128, sliding_window=4, rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=300.0), pad_token_id=0)),
        "mistral-tied-mqa-llama3-rope": lambda: T.MistralForCausalLM(T.MistralConfig(
            vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=128, sliding_window=3,
            tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE), pad_token_id=0)),
        "gemma-gqa": lambda: T.GemmaForCausalLM(T.GemmaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0)),
        "gemma-untied-legacy-gelu": lambda: T.GemmaForCausalLM(T.GemmaConfig(  # "gelu" means tanh in Gemma
            vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, hidden_act="gelu",
            tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=300.0), pad_token_id=0)),
        "gemma2-alternating": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(  # layers 0 and 2 local
            vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, max_position_embeddings=128, sliding_window=4,
            query_pre_attn_scalar=20, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rms_norm_eps=1e-5,
            pad_token_id=0)),
        "gemma2-layer-types-untied": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
            vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=128, sliding_window=5,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"], query_pre_attn_scalar=16,
            attn_logit_softcapping=None, final_logit_softcapping=2.5, tie_word_embeddings=False,
            rope_parameters=dict(LLAMA3_ROPE), pad_token_id=0)),
    }


FAMILIES = list(_models())


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model with every parameter perturbed, its folder, the same weights imported by pretune)."""
    torch.manual_seed(0)
    hf = _models()[request.param]()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb every tensor so each one is tested
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.eval().save_pretrained(path)
    return hf, path, pretune.from_hf(path)


def _padded(T_: int = 11):
    """Three rows: the first full, the others right-padded (for logits)."""
    ids = torch.randint(3, V, (3, T_), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, T_ - 4:] = 0
    mask[2, 4:] = 0
    return ids, mask


def _assert_same_logits(hf, ours, ids, mask):
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert got.shape == want.shape
    torch.testing.assert_close(got[keep], want[keep], atol=1e-4, rtol=1e-4)


def _window(hc) -> tuple[int | None, list[int]]:
    """transformers' window and the layers that use it (Mistral: all, whatever layer_types says)."""
    if getattr(hc, "sliding_window", None) is None:
        return None, []
    if hc.model_type == "mistral":
        return hc.sliding_window, list(range(hc.num_hidden_layers))
    return hc.sliding_window, [i for i, t in enumerate(hc.layer_types) if t == "sliding_attention"]


def test_the_import_uses_the_family_option(pair):
    hf, _, ours = pair
    cfg, hc = ours.config, hf.config
    gemma = hc.model_type.startswith("gemma")
    assert cfg.qkv_bias == (hc.model_type == "qwen2")
    assert cfg.qk_norm == (hc.model_type == "qwen3")
    assert (cfg.norm, cfg.scale_embeddings, cfg.ffn) == (("rmsnorm_plus_one", True, "geglu_tanh") if gemma else
                                                         ("rmsnorm", False, "swiglu"))
    assert cfg.norm_placement == ("sandwich" if hc.model_type == "gemma2" else "pre")
    window, layers = _window(hc)
    assert cfg.sliding_window == window
    assert (cfg.sliding_layers or list(range(cfg.n_layers)) if window else []) == layers
    if hc.model_type == "gemma2":
        assert (cfg.attn_softcap, cfg.logit_softcap) == (hc.attn_logit_softcapping, hc.final_logit_softcapping)
        assert (cfg.attn_scale or cfg.dh ** -0.5) == pytest.approx(hc.query_pre_attn_scalar ** -0.5)
        assert ours.transformer.decoder.layers[0].ffn_post_norm is not None
    assert cfg.dh == getattr(hc, "head_dim", hc.hidden_size // hc.num_attention_heads)
    assert cfg.kv_heads == hc.num_key_value_heads
    assert cfg.rope_scaling == hc.rope_parameters["rope_type"].replace("default", "none")
    attn = ours.transformer.decoder.layers[0].attn
    assert (attn.q_proj.bias is not None, attn.o_proj.bias is not None) == (cfg.qkv_bias, False)
    if cfg.rope_scaling == "llama3":  # the config reaches the three regimes of the scaling
        plain = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.dh, 2).float() / cfg.dh))
        ratio = plain / ours.transformer.decoder.position.inv_freq
        assert ratio[0] == 1 and ratio[-1] == pytest.approx(cfg.rope_factor)
        assert ((ratio > 1.001) & (ratio < cfg.rope_factor - 0.001)).sum() >= 2


def test_from_hf_logits_match(pair):
    hf, _, ours = pair
    _assert_same_logits(hf, ours, *_padded())
    _assert_same_logits(hf, ours, *_padded(100))  # positions beyond llama3's original context of 64


def _rebuilt(ours, **changes):
    """The imported weights in a model whose config differs by ``changes``."""
    other = pretune.build_model(ours.config.replace(**changes)).eval()
    other.load_state_dict(ours.state_dict())
    return other


def _options_of(cfg) -> dict[str, dict]:
    """Each option of the config this family has, changed (a window one key wider or narrower, a cap off)."""
    out = {}
    if cfg.sliding_window is not None:
        out |= {"no window": dict(sliding_window=None, sliding_layers=None),
                "window + 1": dict(sliding_window=cfg.sliding_window + 1),
                "window - 1": dict(sliding_window=cfg.sliding_window - 1)}
    for name in ("attn_softcap", "logit_softcap"):
        if getattr(cfg, name) is not None:
            out[name] = {name: None}
    if cfg.scale_embeddings:
        out["scale_embeddings"] = dict(scale_embeddings=False)
    return out


def test_each_option_changes_the_logits_so_parity_pins_it(pair):
    """The window's off-by-one included: w - 1 and w + 1 keys give other logits on these 11-token rows, so the
    parity above holds only for transformers' convention (position t sees keys t - w + 1 .. t)."""
    _, _, ours = pair
    ids, mask = _padded()
    with torch.no_grad():
        ref = ours(ids, attention_mask=mask).logits
        for name, changes in _options_of(ours.config).items():
            out = _rebuilt(ours, **changes)(ids, attention_mask=mask).logits
            assert (out - ref)[mask.bool()].abs().max() > 1e-4, name


def _left_padded():
    ids = torch.randint(3, V, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("options", [{}, dict(num_beams=3), dict(num_beams=4, num_return_sequences=2,
                                                                 length_penalty=0.6)],
                         ids=["greedy", "beam3", "beam4-two"])
def test_generate_gives_the_tokens_of_transformers(pair, options):
    """Left-padded batch; EOS is the token greedy decoding of row 0 makes third, so that rows end early."""
    hf, _, ours = pair
    ids, mask = _left_padded()
    with torch.no_grad():
        probe = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, min_new_tokens=4,
                            eos_token_id=None, pad_token_id=2)
        eos = int(probe[0, ids.shape[1] + 2])
        kw = dict(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=2, **options)
        want = hf.generate(ids, attention_mask=mask, do_sample=False, **kw)
    got = generate(ours, ids, mask, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if not options:
        assert (got[:, ids.shape[1]:-1] == eos).any()


def test_to_hf_loads_in_transformers_with_same_logits(pair, tmp_path):
    hf, path, _ = pair
    ours = pretune.from_hf(path)
    with torch.no_grad():  # weights that differ from the source, so the export is really tested
        for p in ours.parameters():
            p.add_(0.01)
    pretune.to_hf(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is type(hf)
    assert reloaded.config.rope_parameters["rope_type"] == hf.config.rope_parameters["rope_type"]
    _assert_same_logits(reloaded, ours, *_padded(100))


def test_round_trip_is_identical(pair, tmp_path):
    _, _, ours = pair
    pretune.to_hf(ours, tmp_path / "rt")
    again = pretune.from_hf(tmp_path / "rt")
    assert again.config == ours.config
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_lora_on_the_imported_model_trains(pair):
    """LoRA on every linear of the block (the biased q/k/v of Qwen2 too): a no-op at init, then a forward and
    backward reach the adapters only."""
    _, path, plain = pair
    ours = pretune.from_hf(path)
    ppeft.inject(ours, ppeft.PeftConfig(method="lora", r=4, alpha=8, targets=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]), "mine")
    ids, mask = _padded()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)
    ours.train()
    logits = ours(ids, attention_mask=mask).logits
    loss = F.cross_entropy(logits[:, :-1][mask[:, 1:].bool()], ids[:, 1:][mask[:, 1:].bool()])
    loss.backward()
    adapters = ppeft.adapter_parameters(ours, "mine")
    assert adapters and all(p.grad is not None and torch.isfinite(p.grad).all() for p in adapters.values())
    assert any(p.grad.abs().sum() > 0 for p in adapters.values())
    assert all(p.grad is None for n, p in ours.named_parameters() if n not in adapters)


@pytest.mark.parametrize("method", ["ia3", "prefix", "prompt"])
def test_the_other_peft_methods_train_and_decode_with_a_cache(pair, method):
    """(IA)3, prefix and prompt tuning on each family: gradients reach the adapter only, and incremental decoding
    (the window, the soft caps and the virtual tokens included) equals a full forward pass."""
    _, path, _ = pair
    ours = pretune.from_hf(path)
    ppeft.inject(ours, ppeft.PeftConfig(method=method, n_virtual=3), "mine")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # move the adapter off its identity start
        for p in ppeft.adapter_parameters(ours, "mine").values():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    ids, _ = _padded()
    ours.train()
    F.cross_entropy(ours(ids).logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
    adapters = ppeft.adapter_parameters(ours, "mine")
    assert adapters and all(p.grad is not None and torch.isfinite(p.grad).all() for p in adapters.values())
    assert all(p.grad is None for n, p in ours.named_parameters() if n not in adapters)
    ours.eval()
    with torch.no_grad():
        full = ours(ids).logits
        first = ours(ids[:, :5], use_cache=True)
        steps = [first.logits]
        cache = first.past_key_values
        for t in range(5, ids.shape[1]):
            out = ours(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


def test_labels_loss_equals_transformers(pair):
    """``model(ids, labels=...).loss`` as transformers computes it (Gemma 2: on the soft-capped logits, which no
    fused head may skip)."""
    hf, _, ours = pair
    ids, mask = _padded()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        got = ours(ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sft_loss_on_completion_only_labels_equals_transformers(pair, tokenizers_by_kind):
    """The SFT task's loss (LM head on the labelled rows only) on prompt/completion-style labels (-100 on each row's
    prompt and padding) equals transformers' loss on the same ids and labels."""
    from pretune.io.tokenization import Tokenizer
    from pretune.tasks import TaskConfig, build_task

    hf, _, ours = pair
    task = build_task(TaskConfig(name="sft"), ours.config, Tokenizer.load(tokenizers_by_kind["bpe"]))
    ids, mask = _padded()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100  # the prompts
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        got, _ = task.loss(ours, batch, {k: float(v) for k, v in task.counts(batch).items()})
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
