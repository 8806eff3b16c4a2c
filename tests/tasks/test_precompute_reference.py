"""task.precompute_reference=true (dpo, kto): the reference log-probabilities computed once before training, kept in
the run folder (reference_logps.safetensors, a run entry: --overwrite removes it, --resume reads it), give the same
training losses as the reference pass at every step."""

from __future__ import annotations

import json

import pytest
import test_dpo
import torch
from safetensors.torch import load_file
from test_dpo import _frozen, _load, _write_pairs
from test_kto import STRING_RECORDS, _kto

from pretune.tasks.base import Record

tiny = test_dpo.tiny  # the shared fixture: the tiny Llama folders and transformers models, built once per module


def _run(tiny, tmp_path, out, *extra, log=None):
    from pretune.cli import main

    train = _write_pairs(tmp_path / "train.jsonl", 12)
    argv = ["finetune", "--model", str(tiny["ref"]), "--task", "dpo", "--train", str(train), "--dev",
            str(_write_pairs(tmp_path / "dev.jsonl", 4)), "--out", str(out), "--batch-size", "4", "--quiet",
            "--lr", "1e-3", "train.plot=false", "train.tensorboard=false", "train.log_every=1", "tune.epochs=0",
            "train.steps=3", "task.max_len=48", "train.precision=fp32", "train.save_every=1", *extra]
    assert main(argv) == 0
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "train"]


def test_dpo_trains_alike_with_the_reference_precomputed(tiny, tmp_path):
    """Full finetuning (the frozen copy as the reference): the three steps' losses with the reference precomputed
    equal those with the reference pass; the file is the run's (its marker lists it; --overwrite writes it anew)."""
    want = _run(tiny, tmp_path, tmp_path / "plain")
    out = tmp_path / "pre"
    got = _run(tiny, tmp_path, out, "task.precompute_reference=true")
    assert got == pytest.approx(want, abs=1e-6)
    assert got[0] == pytest.approx(0.6931471805599453, abs=1e-6)  # ln 2: policy = reference at the first step
    refs = load_file(out / "reference_logps.safetensors")["ref_logps"]
    assert refs.shape == (12, 2) and bool((refs < 0).all())
    assert "reference_logps.safetensors" in json.loads((out / ".pretune.json").read_text())["entries"]
    again = _run(tiny, tmp_path, out, "task.precompute_reference=true", "--overwrite")
    assert again == pytest.approx(want, abs=1e-6)


def test_kto_precomputed_reference_equals_the_reference_pass(tiny):
    """kto with fixed mismatched rows: the loss and gradients with the batch's precomputed reference equal those of
    the reference pass on the same batch."""
    from pretune.jobs.finetune.reference import _compute

    policy, tok = _load(tiny["policy"])
    ref, _ = _load(tiny["ref"])
    task = _kto(policy, tok, precompute_reference=True)
    task.reference_model = _frozen(ref)
    feats = [task.encode(Record(f"f:{i + 1}", r))[0] for i, r in enumerate(STRING_RECORDS)]
    task.fix_mismatched(feats)
    refs = _compute(task, policy, feats, batch_size=3, show_progress=False)  # batches unlike the training batch
    results = []
    for with_refs in (False, True):
        batch = task.collate([dict(f, ref_logps=r.numpy()) if with_refs else f for f, r in zip(feats, refs)])
        assert ("ref_logps" in batch) == with_refs
        policy.zero_grad()
        counts = task.counts(batch)
        loss, stats = task.loss(policy.train(), batch, {k: max(float(v), 1.0) for k, v in counts.items()})
        loss.backward()
        results.append((float(loss.detach()), stats, {n: p.grad.clone() for n, p in policy.named_parameters()}))
    (l0, s0, g0), (l1, s1, g1) = results
    assert l1 == pytest.approx(l0, abs=1e-6) and s1["kto:kl"] == pytest.approx(s0["kto:kl"], abs=1e-5)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6)
