"""fp16 training: a dynamic loss scale (torch.amp.GradScaler) that skips overflowing steps, halves the scale, logs
it and checkpoints it; the loss curve of a tiny run stays within 2 % of fp32."""

import json

import pytest
import torch

from pretune.jobs.pretrain import load_run_config, prepare, pretrain
from pretune.train.loop import Trainer


def _cfg(tmp_path, tok, corpus, name, *extra):
    return load_run_config(overrides=[
        "model.preset=tiny-gpt2", "objective.name=clm", f"tokenizer={tok}", f"data.train=[{corpus}]",
        f"train.out={tmp_path / name}", f"data.store={tmp_path / 'store'}", "data.block_size=32",
        "train.steps=6", "train.batch_size=8", "train.lr=3e-3", "train.log_every=1", "train.eval_every=0",
        "train.save_every=0", "train.tensorboard=false", "train.plot=false", "model.dropout=0.0",
        "model.attn_dropout=0.0", *extra])


def _trainer(cfg):
    tok, model, objective, data, _ = prepare(cfg, show_progress=False)
    return Trainer(model=model, objective=objective, data=data, cfg=cfg.train, run_dir=cfg.train.out,
                   tokenizer=tok, show_progress=False), model


def test_an_inf_gradient_skips_the_step_and_halves_the_scale(tmp_path, small_corpus, tokenizers_by_kind):
    trainer, model = _trainer(_cfg(tmp_path, tokenizers_by_kind["bpe"], small_corpus, "run", "train.precision=fp16"))
    assert isinstance(trainer.scaler, torch.amp.GradScaler)
    first = trainer.train_step()
    assert first["skipped"] == 0 and first["loss_scale"] == 65536.0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr_before = trainer.optimizer.param_groups[0]["lr"]
    state_before = {k: v["step"].clone() for k, v in trainer.optimizer.state.items()}
    hook = model.transformer.embed.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    out = trainer.train_step()
    hook.remove()
    assert out["skipped"] == 1 and out["loss_scale"] == first["loss_scale"] / 2
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} moved in a skipped step"
    assert trainer.optimizer.param_groups[0]["lr"] == lr_before  # the schedule waits too
    assert all(torch.equal(trainer.optimizer.state[k]["step"], v) for k, v in state_before.items())
    nxt = trainer.train_step()
    assert nxt["skipped"] == 0 and nxt["loss_scale"] == out["loss_scale"]
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_scale_is_logged_checkpointed_and_restored(tmp_path, small_corpus, tokenizers_by_kind):
    tok = tokenizers_by_kind["bpe"]
    cfg = _cfg(tmp_path, tok, small_corpus, "run", "train.precision=fp16", "train.steps=2")
    pretrain(cfg, show_progress=False, log=lambda *_: None)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss_scale"] for r in rows if r["split"] == "train"] == [65536.0, 65536.0]
    # a run whose scale went down (an overflow at step 2) resumes with the lowered scale
    cfg = _cfg(tmp_path, tok, small_corpus, "run2", "train.precision=fp16", "train.steps=6")
    trainer, model = _trainer(cfg)
    trainer.train_step()
    hook = model.transformer.embed.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    trainer.train_step()
    hook.remove()
    trainer.train_step()
    path = trainer.save_checkpoint()
    assert torch.load(path / "trainer.pt", weights_only=True)["scaler"]["scale"] == 32768.0
    again, _ = _trainer(cfg)
    assert again.resume(log=lambda *_: None) == 3
    assert again.scaler.get_scale() == 32768.0
    assert again.train_step()["loss_scale"] == 32768.0


def test_fp16_loss_curve_stays_within_2_percent_of_fp32(tmp_path, small_corpus, tokenizers_by_kind):
    tok = tokenizers_by_kind["bpe"]
    curves = {}
    for precision in ("fp32", "fp16"):
        cfg = _cfg(tmp_path, tok, small_corpus, precision, f"train.precision={precision}", "train.steps=50",
                   "train.lr=3e-3", "train.warmup_steps=5")
        pretrain(cfg, show_progress=False, log=lambda *_: None)
        rows = [json.loads(x) for x in (tmp_path / precision / "metrics.jsonl").read_text().splitlines()]
        curves[precision] = [r["loss"] for r in rows if r["split"] == "train"]
    assert len(curves["fp16"]) == 50
    assert curves["fp32"][-1] < curves["fp32"][0] - 0.3  # it learned something, so the comparison means something
    for a, b in zip(curves["fp32"], curves["fp16"]):
        assert b == pytest.approx(a, rel=0.02)
