"""Knowledge distillation (objective ``distill``): the KL term against a direct computation and its T² scaling, the
whole loss (KL + hard MLM / CLM + hidden-state cosine) against a computation from the models' own outputs, DistilBERT's
every-other initialisation, the frozen teacher (no gradient, eval mode, not in the checkpointed state), and bad
settings as ConfigErrors naming the key."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pretune import build_model
from pretune.config import ConfigError
from pretune.io.tokenization import Tokenizer
from pretune.objectives import IGNORE, build_objective, objective_settings
from pretune.objectives.distill import distill_kl, init_every_other


def _kl_direct(student, teacher, t):
    """Σ_n Σ_v p_t (log p_t - log p_s) with p = softmax(z / T), written out."""
    p_t = torch.softmax(teacher / t, -1)
    return (p_t * (torch.log(p_t) - torch.log_softmax(student / t, -1))).sum()


@pytest.mark.parametrize("t", [1.0, 2.0, 4.5])
def test_kl_term_equals_a_direct_computation_times_t_squared(t):
    g = torch.Generator().manual_seed(0)
    s, te = torch.randn(7, 30, generator=g) * 3, torch.randn(7, 30, generator=g) * 3
    torch.testing.assert_close(distill_kl(s, te, t), t * t * _kl_direct(s, te, t))
    assert float(distill_kl(te, te, t)) == pytest.approx(0.0, abs=1e-5)  # no divergence from itself


def test_t_squared_keeps_the_gradient_scale():
    """The soft term's gradient is T² · (p_s - p_t) / T = T (p_s - p_t) per logit; for large T that tends to
    (z_s - z_t) / V (zero-mean logits; Hinton et al. 2015 §2.1), so with T² it does not shrink as T grows."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(1, 50, generator=g)
    te = torch.randn(1, 50, generator=g)
    s, te = s - s.mean(), te - te.mean()
    for t in (2.0, 100.0, 400.0):
        x = s.clone().requires_grad_(True)
        distill_kl(x, te, t).backward()
        torch.testing.assert_close(x.grad, t * (torch.softmax(s / t, -1) - torch.softmax(te / t, -1)))
        if t > 10:
            torch.testing.assert_close(x.grad, (s - te) / 50, atol=1e-3, rtol=0.05)


# -- the objective on tiny models -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def wordpiece(tokenizers_by_kind):
    return Tokenizer.load(tokenizers_by_kind["wordpiece"])


@pytest.fixture(scope="module")
def bpe(tokenizers_by_kind):
    return Tokenizer.load(tokenizers_by_kind["bpe"])


def _pair(preset, tok, *, teacher_layers=4, student_layers=2, **kw):
    torch.manual_seed(0)
    teacher = build_model(preset, vocab_size=tok.vocab_size, n_layers=teacher_layers, dropout=0.3,
                          attn_dropout=0.3)
    student = build_model(preset, vocab_size=tok.vocab_size, n_layers=student_layers, dropout=0.0,
                          attn_dropout=0.0, **kw)
    return teacher, student


def _batch(objective, tok, n=3, length=20):
    rng = np.random.default_rng(0)
    examples = []
    for i in range(n):
        tokens = rng.integers(10, tok.vocab_size, length - 3 * i)
        block = types.SimpleNamespace(tokens=tokens, sent_starts=np.array([0]))
        examples.append(objective.example(block, rng, None))
    return objective.collate(examples)  # right-padded: the rows have different lengths


def _settings(**kw):
    return objective_settings({"name": "distill", "teacher": "unused", **kw})


@pytest.mark.parametrize("kind", ["mlm", "clm"])
def test_loss_equals_a_direct_computation(kind, wordpiece, bpe):
    tok, preset = (wordpiece, "tiny-bert-base") if kind == "mlm" else (bpe, "tiny-gpt2")
    teacher, student = _pair(preset, tok)
    cfg = _settings(temperature=3.0, alpha_kl=0.7, alpha_hard=0.2, alpha_cos=0.5)
    objective = build_objective(cfg, student, tok, teacher=teacher)
    objective.train()
    batch = _batch(objective, tok)
    counts = objective.counts(batch)
    term = "mlm" if kind == "mlm" else "lm"
    assert set(counts) == {term, "kd", "cos"} and counts["cos"] == int(batch["attention_mask"].sum())
    loss, stats = objective.loss(student, batch, {k: float(v) for k, v in counts.items()})

    ids, mask = batch["input_ids"], batch["attention_mask"]
    out_s, out_t = student(ids, attention_mask=mask), teacher.eval()(ids, attention_mask=mask)
    if kind == "mlm":
        where, targets = batch["labels"] != IGNORE, batch["labels"]
        z_s, z_t, y = out_s.logits[where], out_t.logits[where], targets[where]
    else:  # position t predicts token t + 1, where that token is real
        where = mask[:, 1:].bool()
        z_s, z_t, y = out_s.logits[:, :-1][where], out_t.logits[:, :-1][where], ids[:, 1:][where]
    n = y.numel()
    assert counts[term] == counts["kd"] == n
    real = mask.bool()
    cos = 1 - F.cosine_similarity(out_s.last_hidden_state[real], out_t.last_hidden_state[real], dim=-1)
    expected = (0.2 * F.cross_entropy(z_s, y) + 0.7 * 9.0 * _kl_direct(z_s, z_t, 3.0) / n + 0.5 * cos.mean())
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert stats[f"{term}_loss"] == pytest.approx(float(F.cross_entropy(z_s, y, reduction="sum").detach()), rel=1e-5)
    assert objective.term_weights == {term: 0.2, "kd": 0.7, "cos": 0.5}  # the evaluated total weighs them so


def test_teacher_gets_no_gradient_stays_in_eval_and_is_not_saved(wordpiece):
    teacher, student = _pair("tiny-bert-base", wordpiece)
    objective = build_objective(_settings(alpha_cos=1.0), student, wordpiece, teacher=teacher)
    student.train()
    objective.train()  # the Trainer calls this every step
    assert objective.training and not teacher.training
    assert not any(m.training for m in teacher.modules())
    batch = _batch(objective, wordpiece)
    loss, _ = objective.loss(student, batch, {k: float(v) for k, v in objective.counts(batch).items()})
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
    # the frozen teacher is an input of the run: not in the objective's state (checkpoints), not trainable
    assert not any(k.startswith("teacher.") for k in objective.state_dict())
    assert not [p for p in objective.parameters() if p.requires_grad]
    # its targets are deterministic although it has dropout 0.3 (eval mode)
    with torch.no_grad():
        a = objective.predict(objective.teacher, batch)[1]
        b = objective.predict(objective.teacher, batch)[1]
    assert torch.equal(a, b)


def test_every_other_init_copies_the_right_layers(wordpiece):
    teacher, student = _pair("tiny-bert-base", wordpiece, teacher_layers=5, student_layers=3)
    build_objective(_settings(init_from_teacher="every_other"), student, wordpiece, teacher=teacher)
    s, t = student.state_dict(), teacher.state_dict()
    for i, j in ((0, 0), (1, 2), (2, 4)):
        prefix = f"transformer.encoder.layers.{i}."
        keys = [k for k in s if k.startswith(prefix)]
        assert keys
        for k in keys:
            assert torch.equal(s[k], t[k.replace(prefix, f"transformer.encoder.layers.{j}.")]), k
    for k in ("transformer.embed.weight", "transformer.encoder.position.weight",
              "transformer.encoder.embed_norm.weight", "transformer.encoder.token_type.weight", "head.dense.weight",
              "head.norm.bias", "head.bias"):
        assert torch.equal(s[k], t[k]), k
    assert not torch.equal(s["transformer.encoder.layers.1.attn.q_proj.weight"],
                           t["transformer.encoder.layers.1.attn.q_proj.weight"])  # layer 1 is teacher layer 2


def test_every_other_init_of_a_decoder_copies_the_final_norm(bpe):
    teacher, student = _pair("tiny-gpt2", bpe, teacher_layers=4, student_layers=2)
    pairs = dict(init_every_other(student, teacher))
    assert pairs["transformer.decoder.layers.1.ffn.up_proj.weight"] == "transformer.decoder.layers.2.ffn.up_proj.weight"
    assert torch.equal(student.transformer.decoder.norm.weight, teacher.transformer.decoder.norm.weight)


@pytest.mark.parametrize("student_kw,match", [
    ({"n_layers": 3}, r"student of 3 layers needs a teacher of at least 5"),
    ({"ffn_dim": 48}, r"ffn.up_proj.weight has shape \(48, 32\)"),
])
def test_every_other_init_refuses_mismatched_students(student_kw, match, wordpiece):
    layers = student_kw.pop("n_layers", 2)
    teacher, student = _pair("tiny-bert-base", wordpiece, teacher_layers=4, student_layers=layers, **student_kw)
    with pytest.raises(ConfigError, match=match):
        build_objective(_settings(init_from_teacher="every_other"), student, wordpiece, teacher=teacher)


@pytest.mark.parametrize("values,match", [
    ({"temperature": 0.0}, r"objective.temperature=0.0 must be > 0"),
    ({"alpha_kl": -1.0}, r"objective.alpha_kl=-1.0 must be >= 0"),
    ({"alpha_kl": 0.0, "alpha_hard": 0.0}, r"all 0"),
    ({"init_from_teacher": "every_third"}, r"init_from_teacher='every_third' is not one of"),
    ({"temprature": 2.0}, r"did you mean 'temperature'"),
])
def test_bad_settings_are_config_errors(values, match):
    with pytest.raises(ConfigError, match=match):
        _settings(**values)


def test_distill_keys_on_another_objective_are_refused():
    with pytest.raises(ConfigError, match=r"objective.temperature=3.0 does not apply to objective 'mlm'"):
        objective_settings({"name": "mlm", "temperature": 3.0})


def test_mismatched_teachers_are_explained(wordpiece, bpe):
    teacher, student = _pair("tiny-bert-base", wordpiece)
    with pytest.raises(ConfigError, match="needs a teacher"):
        build_objective(_settings(), student, wordpiece, teacher=None)
    small = build_model("tiny-bert-base", vocab_size=wordpiece.vocab_size, dim=16, n_heads=2)
    with pytest.raises(ConfigError, match=r"alpha_cos=1.0 .*model.dim=16.*set objective.alpha_cos=0"):
        build_objective(_settings(alpha_cos=1.0), small, wordpiece, teacher=teacher)
    other_vocab = build_model("tiny-bert-base", vocab_size=wordpiece.vocab_size + 5)
    with pytest.raises(ConfigError, match=r"model.vocab_size \(\d+\) differs from the teacher's"):
        build_objective(_settings(), other_vocab, wordpiece, teacher=teacher)
    gpt_teacher, gpt_student = _pair("tiny-gpt2", bpe)
    with pytest.raises(ConfigError, match=r"student has head='mlm' and the teacher head='lm'"):
        build_objective(_settings(), build_model("tiny-bert-base", vocab_size=bpe.vocab_size), bpe,
                        teacher=gpt_teacher)
    with pytest.raises(ConfigError, match=r"objective.rate=0.3 applies to masked-LM distillation"):
        build_objective(_settings(rate=0.3), gpt_student, bpe, teacher=gpt_teacher)
    headless = build_model("tiny-bert-base", vocab_size=wordpiece.vocab_size, head="none")
    with pytest.raises(ConfigError, match=r"head='none'"):
        build_objective(_settings(), student, wordpiece, teacher=headless)
