"""Parity with transformers for ELECTRA: ElectraModel, ElectraForPreTraining (the discriminator, head "rtd"),
ElectraForMaskedLM (the generator: head "mlm" with GELU whatever hidden_act), and the sequence (dense + GELU on the
first token: cls_act="gelu"), token and QA task classes.

Random-weight transformers models from unusual tiny configs (embedding_size below, equal to and above hidden_size,
tanh-GELU and ReLU bodies, 3 token types, an untied generator head), every parameter perturbed: imported logits
within 1e-4 on a right-padded batch with segment ids, exports that transformers' Auto classes load with the same
logits, identical round trips, transformers' losses; the presets' parameter counts equal transformers'; bad folders
are named errors; and an ELECTRA pretraining run exports its discriminator and its generator, each loading in
transformers with pretune's logits."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import pretune
from pretune import count_parameters
from pretune.interop import InteropError

T = pytest.importorskip("transformers")

V = 99


def _config(**kw):
    base = dict(vocab_size=V, embedding_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=37, max_position_embeddings=64, type_vocab_size=3, layer_norm_eps=1e-6,
                pad_token_id=1)
    return T.ElectraConfig(**{**base, **kw})


def _models():
    return {
        "model": lambda: T.ElectraModel(_config()),
        "model-equal-width": lambda: T.ElectraModel(_config(embedding_size=32, hidden_act="relu")),
        "discriminator": lambda: T.ElectraForPreTraining(_config(hidden_act="gelu_new")),
        "discriminator-equal-width": lambda: T.ElectraForPreTraining(_config(embedding_size=32)),
        "generator": lambda: T.ElectraForMaskedLM(_config(embedding_size=40, hidden_size=16, num_attention_heads=2,
                                                          hidden_act="relu")),
        "generator-untied": lambda: T.ElectraForMaskedLM(_config(tie_word_embeddings=False)),
        "sequence": lambda: T.ElectraForSequenceClassification(_config(num_labels=3, classifier_dropout=0.2)),
        "regression": lambda: T.ElectraForSequenceClassification(_config(num_labels=1, embedding_size=32)),
        "tagging": lambda: T.ElectraForTokenClassification(_config(num_labels=5)),
        "qa": lambda: T.ElectraForQuestionAnswering(_config(embedding_size=32)),
    }


CASES = list(_models())
HEADS = {"model": "none", "discriminator": "rtd", "generator": "mlm", "sequence": "classification",
         "regression": "regression", "tagging": "tagging", "qa": "qa"}


def _perturbed(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb every tensor so each one is tested
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    """(transformers model with every parameter perturbed, its folder, the same weights imported by pretune)."""
    torch.manual_seed(0)
    hf = _perturbed(_models()[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path, pretune.from_hf(path)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, 11), generator=g)
    types = torch.randint(0, 3, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    mask[2, 4:] = 0
    return ids, mask, types


def _compare(hf, ours, batch=None):
    ids, mask, types = batch or _batch()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        got = ours(ids, attention_mask=mask, token_type_ids=types)
    if "start_logits" in want:  # QA: (start, end)
        a = torch.stack([want.start_logits, want.end_logits], -1)
    else:
        a = want.logits if "logits" in want else want.last_hidden_state
    b = got.logits if got.logits is not None else got.last_hidden_state
    assert b.shape == a.shape
    if a.dim() >= 2 and a.shape[:2] == ids.shape:  # per token: the real tokens
        a, b = a[mask.bool()], b[mask.bool()]
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_the_import_maps_the_class_to_our_head(pair):
    name, hf, _, ours = pair
    cfg, hc = ours.config, hf.config
    assert cfg.head == HEADS[name.split("-")[0]]
    assert cfg.embedding_dim == hc.embedding_size and cfg.dim == hc.hidden_size
    assert (ours.transformer.encoder.embed_proj is None) == (hc.embedding_size == hc.hidden_size)
    assert cfg.cls_act == "gelu" and not cfg.pooler and cfg.token_types == 3
    if cfg.head == "mlm":
        assert cfg.head_act == "gelu"  # the generator's head: GELU whatever hidden_act is
        assert (ours.head.weight is ours.transformer.embed.weight) == hc.tie_word_embeddings
    if cfg.head == "rtd":
        assert cfg.head_act == cfg.ffn  # the discriminator's head: hidden_act


def test_from_hf_logits_match(pair):
    _, hf, _, ours = pair
    _compare(hf, ours)


def test_to_hf_loads_in_transformers_with_same_logits(pair, tmp_path):
    _, hf, _, ours = pair
    ours = copy.deepcopy(ours)
    with torch.no_grad():  # weights that differ from the source, so the export is really tested
        for p in ours.parameters():
            p.add_(0.01)
    pretune.to_hf(ours, tmp_path / "out")
    hc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hc["model_type"] == "electra" and hc["architectures"] == [type(hf).__name__]
    auto = {"ElectraModel": T.AutoModel, "ElectraForPreTraining": T.AutoModelForPreTraining,
            "ElectraForMaskedLM": T.AutoModelForMaskedLM,
            "ElectraForSequenceClassification": T.AutoModelForSequenceClassification,
            "ElectraForTokenClassification": T.AutoModelForTokenClassification,
            "ElectraForQuestionAnswering": T.AutoModelForQuestionAnswering}[type(hf).__name__]
    reloaded = auto.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is type(hf)
    _compare(reloaded, ours)


def test_round_trip_is_identical(pair, tmp_path):
    _, _, _, ours = pair
    pretune.to_hf(ours, tmp_path / "rt")
    again = pretune.from_hf(tmp_path / "rt")
    assert again.config == ours.config
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_discriminator_and_task_losses_equal_transformers(pair):
    name, hf, _, ours = pair
    ids, mask, types = _batch()
    g = torch.Generator().manual_seed(2)
    head = ours.config.head
    if head == "rtd":
        labels = torch.randint(0, 2, ids.shape, generator=g)
    elif head == "mlm":
        labels = ids.masked_fill(torch.rand(ids.shape, generator=g) > 0.3, -100).masked_fill(mask == 0, -100)
    elif head == "tagging":
        labels = torch.randint(0, 5, ids.shape, generator=g).masked_fill(mask == 0, -100)
    elif head in ("classification", "regression"):
        labels = torch.randint(0, 3, (3,), generator=g) if head == "classification" else torch.randn(3, generator=g)
    else:
        pytest.skip(f"{name}: no labels loss")
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
        got = ours(ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- presets ----------------------------------------------------------------------------------------------------

# published configs (google/electra-{small,base,large}-discriminator); Clark et al. 2020 Table 1: 14M, 110M, 335M
PUBLISHED = {"electra-small": dict(embedding_size=128, hidden_size=256, num_hidden_layers=12, num_attention_heads=4,
                                   intermediate_size=1024),
             "electra-base": dict(embedding_size=768, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                  intermediate_size=3072),
             "electra-large": dict(embedding_size=1024, hidden_size=1024, num_hidden_layers=24,
                                   num_attention_heads=16, intermediate_size=4096)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_count_equals_transformers(name, capsys):
    from pretune.cli import main

    with torch.device("meta"):
        hf = T.ElectraForPreTraining(T.ElectraConfig(vocab_size=30522, **PUBLISHED[name]))
        ours = pretune.build_model(name)
    want = sum(p.numel() for p in hf.parameters())
    assert count_parameters(ours)["total"] == want
    assert main(["show", name, "--json"]) == 0  # what `pretune show` prints
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["parameters"]["total"] == want
    cfg = ours.config
    assert (cfg.head, cfg.cls_act, cfg.embedding_dim) == ("rtd", "gelu", PUBLISHED[name]["embedding_size"])


@pytest.mark.parametrize("name", [f"tiny-{n}" for n in PUBLISHED])
@pytest.mark.parametrize("head", ["rtd", "mlm", "none", "classification", "tagging"])
def test_tiny_presets_export_to_transformers(name, head, tmp_path):
    extra = {"num_labels": 3} if head in ("classification", "tagging") else {}
    torch.manual_seed(0)
    model = _perturbed(pretune.build_model(name, dropout=0.0, attn_dropout=0.0, head=head, **extra))
    pretune.to_hf(model, tmp_path / "hf")
    arch = json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    assert arch.startswith("Electra")
    hf = getattr(T, arch).from_pretrained(tmp_path / "hf").eval()
    ids, mask, types = _batch()
    _compare(hf, model, (ids % 128, mask, types % 2))


# -- what does not convert ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,match", [
    (dict(architectures=["ElectraForMultipleChoice"]), "ElectraForMultipleChoice"),
    (dict(architectures=["ElectraForCausalLM"], is_decoder=True), "ElectraForCausalLM"),
    (dict(hidden_act="mish"), "hidden_act='mish'"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type='relative_key'"),
    (dict(embedding_size="wide"), "embedding_size='wide'"),
])
def test_bad_configs_are_named(change, match, tmp_path):
    hf = T.ElectraModel(_config())
    hf.save_pretrained(tmp_path)
    hc = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hc, **change}))
    with pytest.raises(InteropError, match=match):
        pretune.from_hf(tmp_path)


def test_exports_that_electra_cannot_hold_say_why(tmp_path):
    base = pretune.build_model("tiny-electra-small")
    with pytest.raises(InteropError, match="pooling='cls'"):
        pretune.to_hf(base.with_head(head="classification", num_labels=2, pooling="mean"), tmp_path / "a")
    with pytest.raises(InteropError, match="head_act"):
        pretune.to_hf(pretune.build_model("tiny-electra-small", head="mlm", head_act="relu"), tmp_path / "b")
    with pytest.raises(InteropError, match="cls_act"):  # a RoBERTa-style classifier on an ELECTRA body
        pretune.to_hf(pretune.build_model("tiny-electra-small", head="classification", num_labels=2,
                                          cls_act="tanh"), tmp_path / "c")


# -- an ELECTRA pretraining run exports both of its models ----------------------------------------------------------

def test_electra_run_exports_discriminator_and_generator(tmp_path, small_corpus, tokenizers_by_kind):
    from pretune.jobs.pretrain import load_run_config, pretrain

    cfg = load_run_config(overrides=[
        "model.preset=tiny-electra-small", "objective.name=electra", f"tokenizer={tokenizers_by_kind['wordpiece']}",
        f"data.train=[{small_corpus}]", f"train.out={tmp_path / 'run'}", "train.steps=3", "train.batch_size=4",
        "train.warmup_steps=1", "train.eval_every=0", "train.save_every=0", "train.keep_last=0",
        "train.tensorboard=false", "train.plot=false", "data.block_size=30", "data.eval_max=4",
        "model.dropout=0.0", "model.attn_dropout=0.0"])
    result = pretrain(cfg, show_progress=False, log=lambda *_: None)
    disc, gen = pretune.load(result.model_dir), pretune.load(result.run_dir / "generator")
    assert (disc.config.head, gen.config.head) == ("rtd", "mlm")
    assert gen.config.dim < disc.config.dim
    assert torch.equal(gen.transformer.embed.weight, disc.transformer.embed.weight)  # trained shared embeddings
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, disc.config.vocab_size, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    for model, want, src in ((disc, "ElectraForPreTraining", result.model_dir),
                             (gen, "ElectraForMaskedLM", result.run_dir / "generator")):
        from pretune.cli import main

        out = tmp_path / f"hf-{want}"
        assert main(["convert", "--to-hf", str(src), "--out", str(out)]) == 0
        hf = T.AutoModelForPreTraining.from_pretrained(out) if want == "ElectraForPreTraining" else \
            T.AutoModelForMaskedLM.from_pretrained(out)
        assert type(hf).__name__ == want
        assert (out / "tokenizer.json").is_file()
        _compare(hf.eval(), model, (ids, mask, torch.zeros_like(ids)))
