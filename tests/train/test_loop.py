"""The training loop: accumulation equals the big batch, exact resume, NaN stop, DDP equals one process."""

import json
import os
import subprocess
import sys

import pytest
import torch

from pretune.io.checkpoint import read_weights
from pretune.jobs.pretrain import load_run_config, prepare, pretrain
from pretune.train.loop import Trainer, TrainingDiverged
from pretune.train.state import list_checkpoints


def _cfg(tmp_path, tok, corpus, name="run", *extra):
    return load_run_config(overrides=[
        "model.preset=tiny-bert-base", "objective.name=mlm", f"tokenizer={tok}", f"data.train=[{corpus}]",
        f"train.out={tmp_path / name}", f"data.store={tmp_path / 'store'}", "data.block_size=40",
        "model.max_seq_len=64", "train.steps=6", "train.batch_size=8", "train.lr=3e-3", "train.warmup_steps=2",
        "train.log_every=1", "train.eval_every=0", "train.save_every=0", "train.tensorboard=false",
        "train.plot=false", *extra])


def _quiet(cfg, **kw):
    return pretrain(cfg, show_progress=False, log=lambda *_: None, **kw)


def _trainer(cfg):
    tok, model, objective, data, _ = prepare(cfg, show_progress=False)
    return Trainer(model=model, objective=objective, data=data, cfg=cfg.train, run_dir=cfg.train.out,
                   tokenizer=tok, show_progress=False), model


def test_gradient_accumulation_equals_the_big_batch(tmp_path, small_corpus, tokenizers_by_kind):
    # doc packing -> padded batches and a different number of masked tokens per micro-batch:
    # only normalising by the step's total target count makes 4 x (batch 2) equal batch 8
    extra = ("model.dropout=0.0", "model.attn_dropout=0.0", "data.packing=doc", "train.steps=2",
             "train.precision=fp32")  # an identity of fp32 maths (auto may pick bf16 on this CPU)
    big, m_big = _trainer(_cfg(tmp_path, tokenizers_by_kind["wordpiece"], small_corpus, "big", *extra))
    acc, m_acc = _trainer(_cfg(tmp_path, tokenizers_by_kind["wordpiece"], small_corpus, "acc", *extra,
                               "train.grad_accum=4"))
    m_acc.load_state_dict(m_big.state_dict())
    for _ in range(2):
        a, b = big.train_step(), acc.train_step()
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    for (name, p), q in zip(m_big.named_parameters(), m_acc.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)


def test_a_step_bumps_the_versions_of_the_weights_it_writes(tmp_path, small_corpus, tokenizers_by_kind):
    """On a CPU the Trainer's AdamW is the fused kernel, which writes the parameters without bumping their version
    counters; caches keyed on them (the fast wing's LM head cast to bf16 once, stacked weights for sampling) would
    keep the weights of before the step (a GRPO run resumed from a checkpoint then sampled other completions than the
    unbroken run), so the step bumps them itself."""
    trainer, model = _trainer(_cfg(tmp_path, tokenizers_by_kind["wordpiece"], small_corpus, "run",
                                   "train.precision=fp32", "train.warmup_steps=0"))
    assert trainer.optimizer.defaults["fused"]
    trained = [p for p in model.parameters() if p.requires_grad]
    before = [p._version for p in trained]
    trainer.train_step()
    assert all(p._version > v for p, v in zip(trained, before))


def test_resume_is_bitwise_identical(tmp_path, small_corpus, tokenizers_by_kind, monkeypatch):
    tok = tokenizers_by_kind["wordpiece"]
    # dropout on: the restored RNG state matters too
    extra = ("model.dropout=0.1", "train.save_every=3", "train.keep_last=1")
    _quiet(_cfg(tmp_path, tok, small_corpus, "full", *extra))

    real_step = Trainer.train_step

    def crash_after_3(self):
        if self.step == 3:
            raise KeyboardInterrupt("killed")
        return real_step(self)

    cfg = _cfg(tmp_path, tok, small_corpus, "cut", *extra)
    monkeypatch.setattr(Trainer, "train_step", crash_after_3)
    with pytest.raises(KeyboardInterrupt):
        _quiet(cfg)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step-00000003"]
    _quiet(cfg, resume=True)

    a = read_weights(tmp_path / "full" / "model" / "model.safetensors")
    b = read_weights(tmp_path / "cut" / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    losses = [[json.loads(x)["loss"] for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()
               if json.loads(x)["split"] == "train"] for r in ("full", "cut")]
    assert losses[0] == losses[1]  # same data order, corruption and dropout: same curve, no duplicated steps
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step-00000006"]  # keep_last=1


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, small_corpus, tokenizers_by_kind,
                                                                   monkeypatch):
    from pretune.objectives.encoder import MaskedLM

    real_loss = MaskedLM.loss
    calls = {"n": 0}

    def poisoned(self, model, batch, totals):
        calls["n"] += 1
        loss, stats = real_loss(self, model, batch, totals)
        return (loss * float("nan"), stats) if calls["n"] == 5 else (loss, stats)

    monkeypatch.setattr(MaskedLM, "loss", poisoned)
    cfg = _cfg(tmp_path, tokenizers_by_kind["wordpiece"], small_corpus, "nan", "train.save_every=2")
    with pytest.raises(TrainingDiverged, match=r"non-finite loss .* at step 5.*step-00000004"):
        _quiet(cfg)
    kept = list_checkpoints(tmp_path / "nan")
    assert kept[-1].name == "step-00000004"
    w = read_weights(kept[-1] / "model" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in w.values())


def test_checkpoint_is_complete_and_atomic(tmp_path, small_corpus, tokenizers_by_kind):
    cfg = _cfg(tmp_path, tokenizers_by_kind["wordpiece"], small_corpus, "ck", "train.save_every=2",
               "train.keep_last=2")
    _quiet(cfg)
    names = [p.name for p in list_checkpoints(tmp_path / "ck")]
    assert names == ["step-00000004", "step-00000006"]
    last = tmp_path / "ck" / "checkpoints" / names[-1]
    assert {p.name for p in last.iterdir()} >= {"model", "trainer.pt", "run.yaml"}
    state = torch.load(last / "trainer.pt", weights_only=True)
    assert state["step"] == 6 and set(state["position"]) == {"epoch", "batch"}
    assert not any(p.name.startswith(".") for p in (tmp_path / "ck" / "checkpoints").iterdir())  # no temp folders


def _torchrun_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def test_ddp_two_processes_match_one(tmp_path, small_corpus, tokenizers_by_kind):
    tok = tokenizers_by_kind["bpe"]
    common = ["--preset", "tiny-gpt2", "--objective", "clm", "--tokenizer", str(tok), "--data", str(small_corpus),
              "--steps", "4", "--quiet", "train.batch_size=8", "train.grad_accum=2", "data.block_size=48",
              "model.dropout=0.0", "model.attn_dropout=0.0", "train.log_every=1", "train.eval_every=0",
              "train.save_every=2", "train.tensorboard=false", "train.plot=false", "train.threads=1",
              "train.precision=fp32"]  # 1e-5 agreement is an fp32 property
    one = subprocess.run([sys.executable, "-m", "pretune", "pretrain", *common, "--out", str(tmp_path / "one")],
                         env=_torchrun_env(), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(29500 + os.getpid() % 1000), "-m", "pretune", "pretrain", *common,
                          "--out", str(tmp_path / "two")],
                         env=_torchrun_env(), capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]

    def curve(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r["split"] == "train"]

    a, b = curve("one"), curve("two")
    assert len(a) == len(b) == 4
    assert a == pytest.approx(b, abs=1e-5)
    wa = read_weights(tmp_path / "one" / "model" / "model.safetensors")
    wb = read_weights(tmp_path / "two" / "model" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=0, msg=k)
    state = torch.load(tmp_path / "two" / "checkpoints" / "step-00000004" / "trainer.pt", weights_only=True)
    assert len(state["rng"]) == 2  # one RNG state per rank, for an exact resume with the same world size


def test_a_newer_checkpoint_left_by_a_fallback_never_costs_the_one_just_written(tmp_path, small_corpus,
                                                                                 tokenizers_by_kind):
    """Resumed from step 2 because step 4 did not load: the next checkpoint (step 3) stays, whatever keep_last,
    and the abandoned step 4 goes."""
    cfg = _cfg(tmp_path, tokenizers_by_kind["wordpiece"], small_corpus, "run", "train.save_every=2",
               "train.keep_last=2", "train.steps=4")
    _quiet(cfg)
    run = tmp_path / "run"
    assert [p.name for p in list_checkpoints(run)] == ["step-00000002", "step-00000004"]
    (run / "checkpoints" / "step-00000004" / "trainer.pt").write_bytes(b"torn")
    trainer, _ = _trainer(_cfg(tmp_path, tokenizers_by_kind["wordpiece"], small_corpus, "run", "train.save_every=2",
                               "train.keep_last=1", "train.steps=4"))
    said = []
    assert trainer.resume(log=said.append) == 2
    assert any("skipped checkpoint step-00000004" in s for s in said)
    trainer.train_step()
    written = trainer.save_checkpoint()
    assert [p.name for p in list_checkpoints(run)] == [written.name] == ["step-00000003"]


def test_a_run_that_stopped_early_is_finished_when_resumed(tmp_path, small_corpus, tokenizers_by_kind):
    cfg = _cfg(tmp_path, tokenizers_by_kind["wordpiece"], small_corpus, "run", "train.save_every=2",
               "train.keep_last=1")
    trainer, _ = _trainer(cfg)
    trainer.train_step()
    trainer.train_step()
    trainer.stopped_early = True  # as EarlyStopping sets it
    trainer.save_checkpoint()
    again, _ = _trainer(cfg)
    result = again.fit(resume=True, log=lambda *a: None)
    assert result.step == 2 and again.stopped_early  # no step beyond the early stop
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000002"]


def test_signals_ignored_by_the_parent_stay_ignored():
    import signal

    from pretune.train.loop import _SignalFlag

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        flag = _SignalFlag()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # `pretune ... &` in a script keeps ignoring it
        assert signal.getsignal(signal.SIGTERM) == flag._handle
        flag.restore()
        assert signal.getsignal(signal.SIGTERM) is not flag._handle
    finally:
        signal.signal(signal.SIGINT, old)


def test_resume_accepts_another_precision_and_refuses_a_changed_lr():
    from pretune.config import ConfigError
    from pretune.runconfig import check_resume

    old = {"train": {"precision": "bf16", "lr": 1e-3, "steps": 10}}
    assert check_resume(old, {"train": {"precision": "fp32", "lr": 1e-3, "steps": 10}}, source="r") == [
        "train.precision: 'bf16' -> 'fp32'"]  # auto resolved on another machine
    with pytest.raises(ConfigError, match=r"train.lr: 0.001 -> 0.002"):
        check_resume(old, {"train": {"precision": "bf16", "lr": 2e-3, "steps": 10}}, source="r")
