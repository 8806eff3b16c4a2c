"""peft.base_dtype=bf16: a PEFT run's frozen linear weights stored in bf16 (issue 17: "a frozen base kept in bf16").

Under bf16 autocast a linear layer rounds an fp32 weight to bf16 before its matmul, so storing the frozen weight in
bf16 changes nothing the model computes: the tests assert *bitwise* equality with the fp32 base under the same
autocast (loss, gradients, AdamW steps, a whole finetuning run with its dev and test scores), except DoRA, whose row
norms read the stored weight itself (fp32 norms of the bf16-rounded rows: within bf16 rounding)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pretune
from conftest import corpus_paragraphs
from pretune import peft
from pretune.config import ConfigError
from pretune.io.checkpoint import read_weights
from pretune.io.tokenization import Tokenizer
from pretune.jobs.finetune import evaluate, finetune, load_finetune_config, prepare
from pretune.runconfig import check_resume

HERE = Path(__file__).resolve().parents[1]
KILL = HERE / "helpers" / "kill_run.py"


def _model(preset="tiny-llama", **kw):
    torch.manual_seed(0)
    return pretune.build_model(preset, vocab_size=97, **kw)


def _pair(cfg: peft.PeftConfig, preset="tiny-llama", **kw):
    """The same model with the same adapter twice: base fp32 and base bf16; trainable weights randomised (B != 0)."""
    m32, m16 = _model(preset, **kw), _model(preset, **kw)
    peft.inject(m32, cfg, seed=0)
    peft.inject(m16, peft.PeftConfig(**{**cfg.to_dict(), "base_dtype": "bf16"}), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for a, b in zip(m32.parameters(), m16.parameters()):
            if a.requires_grad:
                a.add_(torch.randn(a.shape, generator=gen) * 0.05)
                b.copy_(a)
    return m32, m16


def _batch():
    ids = torch.randint(3, 97, (3, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding
    return ids, mask, ids.masked_fill(mask == 0, -100)


def test_frozen_linear_weights_are_bf16_everything_else_keeps_its_dtype_and_ties():
    m = _model()  # SmolLM2-like: the LM head is the token embedding
    s = peft.inject(m, peft.PeftConfig(method="lora", r=2, targets=["all-linear"], base_dtype="bf16"))
    linears = {n: p for n, p in m.named_parameters() if n.endswith("base_layer.weight")}
    assert linears and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in linears.values())
    for n, p in m.named_parameters():
        if n not in linears:  # adapters, norms, the embedding table: fp32
            assert p.dtype == torch.float32, n
    assert m.head.weight is m.transformer.embed.weight  # still tied
    assert s["base_cast"] == sum(p.numel() for p in linears.values()) and s["base_bytes_saved"] == 2 * s["base_cast"]

    untied = _model(tie_embeddings=False)  # an output layer of its own is a matmul weight: bf16 too
    peft.inject(untied, peft.PeftConfig(method="lora", r=2, base_dtype="bf16"))
    assert untied.head.weight.dtype == torch.bfloat16 and untied.transformer.embed.weight.dtype == torch.float32

    bert = _model("tiny-bert-base", head="classification", num_labels=3)  # bias=all: trained biases stay fp32
    peft.inject(bert, peft.PeftConfig(method="lora", r=2, bias="all", base_dtype="bf16"))
    for n, p in bert.named_parameters():
        table = any(t in n for t in ("embed", "position", "token_type"))  # lookup tables stay fp32
        frozen_matrix = not p.requires_grad and p.dim() == 2 and not table
        assert p.dtype == (torch.bfloat16 if frozen_matrix else torch.float32), n
        if n.endswith(".bias") or n.startswith("head."):
            assert p.requires_grad, n
    shared = _model(share_layers=True)  # one block applied n times: still one set of weights
    peft.inject(shared, peft.PeftConfig(method="lora", r=2, base_dtype="bf16"))
    layers = shared.transformer.decoder.layers
    assert len(layers) == 1 and layers[0].attn.q_proj.weight.dtype == torch.bfloat16


def test_a_lora_step_equals_the_fp32_base_under_bf16_autocast_bit_for_bit():
    """Autocast rounds an fp32 weight to bf16 for the matmul, the value the bf16 base stores: losses, gradients and
    the updated adapters are equal (tolerance 0), over three AdamW steps and an evaluation forward (fused q/k/v and
    gate/up weights cached without gradients)."""
    m32, m16 = _pair(peft.PeftConfig(method="lora", r=4, targets=["all-linear"]))
    ids, mask, labels = _batch()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (m32, m16)]
    for _ in range(3):
        losses = []
        for m in (m32, m16):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses)
        for (n, a), b in zip(m32.named_parameters(), m16.parameters()):
            if a.requires_grad:
                assert torch.equal(a.grad, b.grad), n
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for m in (m32, m16):
        m.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(m32(ids, attention_mask=mask).logits, m16(ids, attention_mask=mask).logits)
    for state in (m32.state_dict(), m16.state_dict()):  # trainable state (adapters, AdamW) stays fp32
        assert all(v.dtype == torch.float32 for k, v in state.items() if "lora_" in k)
    assert all(v["exp_avg"].dtype == torch.float32 for v in opts[1].state.values())


def test_dora_on_a_bf16_base_trains_and_merges_in_fp32():
    m32, m16 = _pair(peft.PeftConfig(method="lora", r=4, targets=["q_proj", "v_proj", "down_proj"], dora=True))
    ids, mask, labels = _batch()
    layer = m16.get_submodule("transformer.decoder.layers.0.attn.q_proj")
    assert layer.weight.dtype == torch.bfloat16 and layer.lora_magnitude["default"].dtype == torch.float32
    assert layer.dora_norm("default").dtype == torch.float32  # ||W0 + s B A|| of the rounded rows, in fp32
    out = []
    for m in (m32, m16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        out.append(loss.item())
    # the only difference: the norms of bf16-rounded rows (relative ~1e-4), far below bf16 compute's rounding
    assert out[1] == pytest.approx(out[0], rel=2e-3)
    g32 = m32.get_submodule("transformer.decoder.layers.0.attn.q_proj").lora_magnitude["default"].grad
    torch.testing.assert_close(layer.lora_magnitude["default"].grad, g32, rtol=0.05, atol=1e-3)
    # merged_model widens the base first: W = (m / ||W0 + sBA||) (W0 + sBA) in fp32, from the bf16 W0
    m16.eval()
    plain = peft.merged_model(m16)
    w = plain.get_submodule("transformer.decoder.layers.0.attn.q_proj").weight
    w0, delta = layer.weight.float(), layer.delta_weight("default")
    want = (w0 + delta) * (layer.lora_magnitude["default"] / torch.linalg.norm(w0 + delta, dim=1))[:, None]
    assert w.dtype == torch.float32 and torch.allclose(w, want, rtol=1e-6, atol=1e-7)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = m16(ids, attention_mask=mask).logits.float()
        b = plain(ids, attention_mask=mask).logits.float()
    assert (a - b).abs().max().item() < 0.05  # the merged weight rounded to bf16 by autocast: bf16-level change
    peft.merge(m16)  # in place on the bf16 base: rounded once to bf16
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight, want.to(torch.bfloat16))


def test_cast_base_back_to_fp32_runs_without_autocast():
    m32, m16 = _pair(peft.PeftConfig(method="lora", r=2))
    back = peft.cast_base(m16, torch.float32)
    assert back["bytes_saved"] < 0 and all(p.dtype == torch.float32 for p in m16.parameters())
    ids, mask, _ = _batch()
    m16.eval()
    with torch.no_grad():
        m16(ids, attention_mask=mask)  # fp32 again: no autocast needed
    with pytest.raises(peft.PeftError, match="auto"):
        peft.inject(_model(), peft.PeftConfig(method="lora", base_dtype="auto"))


# ---------------------------------------------------------------------------------------------------- finetune
@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizers_by_kind):
    """A tiny tied-embedding decoder (SmolLM2's shape, random weights) and SFT records: prompt -> next word."""
    d = tmp_path_factory.mktemp("bf16base")
    words = " ".join(corpus_paragraphs("austen.txt.gz", 120)).split()
    rows = [{"prompt": " ".join(words[i:i + 6]), "completion": " " + words[i + 6]} for i in range(0, 7 * 96, 7)]
    files = {}
    for name, part in (("train", rows[:64]), ("dev", rows[64:80]), ("test", rows[80:96])):
        files[name] = d / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in part))
    tok = Tokenizer.load(tokenizers_by_kind["bpe"])
    torch.manual_seed(0)
    model = pretune.build_model("tiny-llama", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id or 0, dropout=0.1)
    pretune.save(model, d / "base", tokenizer=tok.tk)
    return {"dir": d, "base": d / "base", **files}


def _overrides(setup, out, *extra):
    return [f"model.init={setup['base']}", "task.name=sft", f"data.train={setup['train']}",
            f"data.dev={setup['dev']}", f"data.test={setup['test']}", f"train.out={out}", "train.batch_size=8",
            "train.lr=5e-3", "tune.epochs=1", "tune.evals_per_epoch=2", "train.plot=false", "train.keep_last=1",
            "task.max_len=32", "task.max_target_len=3", "peft.method=lora", "peft.targets=[all-linear]",
            "train.precision=bf16", "train.threads=1", *extra]


def _curve(run: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["split"], r.get("loss")) for r in rows]


def test_finetuning_on_a_bf16_base_is_the_fp32_base_run_bit_for_bit(setup, tmp_path):
    lines = []
    runs = {}
    for dtype in ("fp32", "bf16"):
        cfg = load_finetune_config(None, _overrides(setup, tmp_path / dtype, f"peft.base_dtype={dtype}"))
        runs[dtype] = finetune(cfg, show_progress=False, log=lines.append if dtype == "bf16" else lambda *a: None)
    a, b = runs["fp32"], runs["bf16"]
    assert _curve(a.run_dir) == _curve(b.run_dir) and a.dev == b.dev and a.best_step == b.best_step
    wa, wb = (read_weights(r.model_dir / "adapter_model.safetensors") for r in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # the same adapter
    start = next(x for x in lines if x.startswith("frozen base: bf16"))
    precision = next(i for i, x in enumerate(lines) if x.startswith("precision:"))
    assert "MB saved" in start and lines.index(start) == precision + 1  # the line after the precision
    res = json.loads((b.run_dir / "results.json").read_text())
    assert res["peft"]["base_dtype"] == "bf16"
    assert res["peft"]["full_model_bytes"] == json.loads((a.run_dir / "results.json").read_text())[
        "peft"]["full_model_bytes"]  # the full model as saved (fp32), not as the run held it
    # the test set is scored under bf16 autocast (a bf16 base needs it): evaluate --precision bf16 gives the same
    assert any("--precision bf16" in x for x in lines)
    again = evaluate(b.model_dir, setup["test"], precision="bf16", show_progress=False)
    assert again == pytest.approx(b.test, abs=1e-6)
    # the adapter loads on the fp32 base like the fp32-base run's (they are equal): same fp32 scores
    assert evaluate(b.model_dir, setup["test"], show_progress=False) == evaluate(a.model_dir, setup["test"],
                                                                                  show_progress=False)


def _launch(setup, out, mode="none", at=0, procs=1, *extra):
    """``pretune finetune`` (a bf16 base unless ``extra`` says otherwise) in ``procs`` processes through
    tests/helpers/kill_run.py (MODE at step AT)."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(HERE)}
    cmd = [str(KILL), mode, str(at), "finetune", "--quiet", *[o for o in extra if o.startswith("--")],
           *_overrides(setup, out, "peft.base_dtype=bf16", "train.save_every=2", *[o for o in extra if "=" in o])]
    if procs > 1:
        port = 20000 + (os.getpid() * 7 + random.randrange(1000)) % 20000
        cmd = ["-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", str(port), *cmd]
    return subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=600, env=env)


def _same_adapter(a: Path, b: Path) -> None:
    wa, wb = (read_weights(r / "model" / "adapter_model.safetensors") for r in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_killed_bf16_base_run_resumes_bit_for_bit(setup, tmp_path):
    """The checkpoints hold the trainable tensors only: a resume rebuilds the base and casts it again."""
    ref = _launch(setup, tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    p = _launch(setup, tmp_path / "killed", "step", 5)
    assert p.returncode == -9, p.stderr[-3000:]
    p = _launch(setup, tmp_path / "killed", "none", 0, 1, "--resume")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from step 4" in p.stdout and "frozen base: bf16" in p.stdout
    assert _curve(tmp_path / "killed") == _curve(tmp_path / "ref")
    _same_adapter(tmp_path / "killed", tmp_path / "ref")


# FSDP (28 s) runs under make test-slow: the default suite keeps DDP here and FSDP + LoRA in train/test_parallel.py
@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_processes_with_a_bf16_base_equal_the_fp32_base_run(setup, tmp_path, parallel):
    """DDP (its start broadcasts the bf16 weights with the rest) and FSDP2 (bf16 shards of the frozen weights next to
    fp32 ones of the adapters; gathered in bf16 for compute as fp32 ones are): the run equals the fp32-base run bit
    for bit, and an FSDP run killed and resumed from its sharded checkpoint continues it."""
    runs = {dt: tmp_path / dt for dt in ("fp32", "bf16")}
    for dt, out in runs.items():
        p = _launch(setup, out, "none", 0, 2, f"train.parallel={parallel}", f"peft.base_dtype={dt}")
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert _curve(runs["bf16"]) == _curve(runs["fp32"])
    _same_adapter(runs["bf16"], runs["fp32"])
    if parallel == "fsdp":
        killed = tmp_path / "killed"
        p = _launch(setup, killed, "step", 3, 2, "train.parallel=fsdp")
        assert p.returncode != 0
        p = _launch(setup, killed, "none", 0, 2, "train.parallel=fsdp", "--resume")
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        assert "resumed from step 2" in p.stdout
        assert _curve(killed) == _curve(runs["bf16"])
        _same_adapter(killed, runs["bf16"])


def test_base_dtype_settings_are_checked_and_auto_follows_the_precision(setup, tmp_path, monkeypatch):
    def cfg(*extra):
        return load_finetune_config(None, _overrides(setup, tmp_path / "run", *extra))

    for precision in ("fp32", "fp16"):
        with pytest.raises(ConfigError, match=f"peft.base_dtype=bf16 needs train.precision=bf16.*{precision}"):
            cfg("peft.base_dtype=bf16", f"train.precision={precision}")
    with pytest.raises(ConfigError, match="needs peft.method|set peft.method"):
        load_finetune_config(None, [o for o in _overrides(setup, tmp_path / "run", "peft.base_dtype=bf16")
                                    if not o.startswith("peft.targets")] + ["peft.method="])
    with pytest.raises(ConfigError, match="peft.base_dtype"):
        cfg("peft.base_dtype=fp16")
    assert prepare(cfg("peft.base_dtype=auto"), show_progress=False, log=lambda *a: None).cfg.peft.base_dtype == "bf16"
    assert prepare(cfg("peft.base_dtype=auto", "train.precision=fp32"), show_progress=False,
                   log=lambda *a: None).cfg.peft.base_dtype == "fp32"
    # a CPU without native bf16: train.precision=auto resolves to fp32, so auto keeps the base fp32 (bf16 matmuls
    # would run ~100x slower there) and an explicit bf16 base is refused, naming both keys
    monkeypatch.setattr("pretune.train.precision.native_bf16", lambda device="cpu": False)
    job = prepare(cfg("peft.base_dtype=auto", "train.precision=auto"), show_progress=False, log=lambda *a: None)
    assert (job.cfg.train.precision, job.cfg.peft.base_dtype) == ("fp32", "fp32")
    assert "peft.base_dtype" in job.derived
    with pytest.raises(ConfigError, match=r"train.precision=auto \(resolved to fp32"):
        prepare(cfg("peft.base_dtype=bf16", "train.precision=auto"), show_progress=False, log=lambda *a: None)
    # like the precision it follows, it may differ when a run is resumed (on another machine, auto may resolve apart)
    assert check_resume({"peft": {"base_dtype": "bf16"}}, {"peft": {"base_dtype": "fp32"}}, source="run") == [
        "peft.base_dtype: 'bf16' -> 'fp32'"]
