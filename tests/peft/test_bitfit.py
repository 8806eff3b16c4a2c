"""BitFit (Ben Zaken et al. 2021): only the bias terms of the body (and the task head) train, the adapter folder
holds them, and it loads, merges and refuses what it cannot do like the other methods."""

from __future__ import annotations

import pytest
import torch

import pretune
from pretune import peft
from pretune.peft import PeftConfig, PeftError

HEAD = {"head": "classification", "num_labels": 3, "labels": ["a", "b", "c"]}


def _model(preset="tiny-bert-base", **kw):
    torch.manual_seed(0)
    return pretune.build_model(preset, dropout=0.0, attn_dropout=0.0, pooler=preset == "tiny-bert-base",
                               **{**HEAD, **kw}).eval()


def _inputs(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, model.config.vocab_size, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


def _biases(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if n.endswith(".bias") and not n.startswith("head.")}


@pytest.mark.parametrize("preset", ["tiny-bert-base", "tiny-gpt2"])
def test_only_the_biases_and_the_head_train(preset):
    model = _model(preset)
    biases = _biases(model)
    head = dict(model.head.named_parameters())
    summary = peft.inject(model, PeftConfig(method="bitfit"))
    n_bias = sum(p.numel() for p in biases.values())
    assert n_bias > 0 and summary["trainable"] == n_bias + sum(p.numel() for p in head.values())
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(biases) | {f"head.{n}" for n in head}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids, mask = _inputs(model)
    model.train()
    loss = torch.nn.functional.cross_entropy(model(ids, attention_mask=mask).logits, torch.tensor([0, 1, 2, 0]))
    loss.backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= set(biases) | {f"head.{n}" for n in head}
    assert any(n.endswith(".bias") and not n.startswith("head.") for n in changed)  # the body's biases moved


def test_the_adapter_folder_holds_the_biases_and_reloads(tmp_path):
    model = _model()
    peft.inject(model, PeftConfig(method="bitfit"), "bf")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in _biases(model).values():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        for p in model.head.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    ids, mask = _inputs(model)
    want = model(ids, attention_mask=mask).logits
    pretune.save(_model(), tmp_path / "base")
    peft.save_adapter(model, tmp_path / "ad", base=str(tmp_path / "base"))
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ad" / "adapter_model.safetensors")
    assert set(saved) == set(_biases(model)) | {f"head.{n}" for n, _ in model.head.named_parameters()}
    again = pretune.load(tmp_path / "ad")  # the base it recorded, with the biases and the head put back
    torch.testing.assert_close(again(ids, attention_mask=mask).logits, want, atol=1e-6, rtol=0)
    merged = pretune.load(tmp_path / "ad", merge=True)  # the trained biases are the model's own
    assert peft.adapter_names(merged) == []
    torch.testing.assert_close(merged(ids, attention_mask=mask).logits, want, atol=1e-6, rtol=0)
    with pytest.raises(PeftError, match="trains base parameters every row shares"):
        with peft.route(again, ["bf", None, "bf", "bf"]):
            pass


def test_a_model_without_biases_is_refused():
    with pytest.raises(PeftError, match="has none"):
        peft.inject(_model("tiny-llama"), PeftConfig(method="bitfit"))
    model = _model()
    peft.inject(model, PeftConfig(method="bitfit"), "one")
    with pytest.raises(PeftError, match="already trains"):  # two adapters cannot both own the biases
        peft.inject(model, PeftConfig(method="bitfit"), "two")


@pytest.mark.slow
def test_bitfit_on_the_real_minilm_reaches_095(tmp_path):
    """The issue's bar: BitFit with its documented default learning rate (1e-3, no --lr) on the real MiniLM and
    the whole sms_spam set reaches >= 0.95 test accuracy (measured: 0.9802 in 3 epochs, 83 s on 2 cores)."""
    from pretune import bundled
    from pretune.jobs.finetune import finetune, load_finetune_config
    from pretune.realmodels import minilm_dir

    try:
        model = minilm_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    spam = bundled.task("sms_spam")
    cfg = load_finetune_config(None, [f"model.init={model}", "task.name=classification", "peft.method=bitfit",
                                      f"data.train={spam['train']}", f"data.dev={spam['dev']}",
                                      f"data.test={spam['test']}", f"train.out={tmp_path / 'run'}",
                                      "train.plot=false"])
    res = finetune(cfg, show_progress=False, log=lambda *a: None)
    import yaml

    assert yaml.safe_load((res.run_dir / "run.yaml").read_text())["train"]["lr"] == 1e-3
    assert res.test["accuracy"] >= 0.95, res.test
