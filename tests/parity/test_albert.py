"""Parity with transformers for ALBERT: AlbertModel (with and without its pooler), AlbertForMaskedLM (tied and untied
decoder), AlbertForPreTraining (MLM + the sentence-order head: our ``pair_head``), and the sequence (on the pooler
output), token and QA task classes.

Random-weight transformers models from unusual tiny configs (embeddings narrower and wider than the hidden size,
3 shared-layer applications, tanh-GELU, GELU and ReLU bodies, 3 token types, pad id 1), every parameter perturbed:
imported logits (and pooler output, SOP logits) within 1e-4 on a right-padded batch with segment ids, exports that
transformers' Auto classes load with the same outputs, identical round trips, transformers' losses; the presets'
parameter counts equal transformers' (``pretune show``); bad folders and exports ALBERT cannot hold are named
errors; and a ``sop`` pretraining run exports as AlbertForPreTraining with pretune's MLM and SOP logits."""

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
    base = dict(vocab_size=V, embedding_size=24, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                intermediate_size=37, max_position_embeddings=64, type_vocab_size=3, layer_norm_eps=1e-6,
                pad_token_id=1, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return T.AlbertConfig(**{**base, **kw})


def _models():
    return {
        "model": lambda: T.AlbertModel(_config()),
        "model-no-pooler": lambda: T.AlbertModel(_config(hidden_act="relu"), add_pooling_layer=False),
        "mlm": lambda: T.AlbertForMaskedLM(_config(embedding_size=40, hidden_act="gelu")),
        "mlm-untied": lambda: T.AlbertForMaskedLM(_config(tie_word_embeddings=False)),
        "pretraining": lambda: T.AlbertForPreTraining(_config()),
        "pretraining-wide": lambda: T.AlbertForPreTraining(_config(embedding_size=48, hidden_act="relu",
                                                                   num_hidden_layers=1)),
        "sequence": lambda: T.AlbertForSequenceClassification(_config(num_labels=3, classifier_dropout_prob=0.2)),
        "regression": lambda: T.AlbertForSequenceClassification(_config(num_labels=1, embedding_size=16)),
        "tagging": lambda: T.AlbertForTokenClassification(_config(num_labels=5)),
        "qa": lambda: T.AlbertForQuestionAnswering(_config(hidden_act="gelu")),
    }


CASES = list(_models())
HEADS = {"model": "none", "mlm": "mlm", "pretraining": "mlm", "sequence": "classification",
         "regression": "regression", "tagging": "tagging", "qa": "qa"}
AUTO = {"AlbertModel": "AutoModel", "AlbertForMaskedLM": "AutoModelForMaskedLM",
        "AlbertForPreTraining": "AutoModelForPreTraining",
        "AlbertForSequenceClassification": "AutoModelForSequenceClassification",
        "AlbertForTokenClassification": "AutoModelForTokenClassification",
        "AlbertForQuestionAnswering": "AutoModelForQuestionAnswering"}


def _perturbed(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb every tensor so each one is tested
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    """(case, transformers model with every parameter perturbed, its folder, the same weights imported by pretune)."""
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
    """Every output transformers gives (logits per real token, pooler output, SOP logits) equals pretune's."""
    ids, mask, types = batch or _batch()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        got = ours(ids, attention_mask=mask, token_type_ids=types)
    if "start_logits" in want:  # QA: (start, end)
        a = torch.stack([want.start_logits, want.end_logits], -1)
    elif "prediction_logits" in want:  # AlbertForPreTraining: MLM, then SOP below
        a = want.prediction_logits
    else:
        a = want.logits if "logits" in want else want.last_hidden_state
    b = got.logits if got.logits is not None else got.last_hidden_state
    assert b.shape == a.shape
    if a.dim() >= 2 and a.shape[:2] == ids.shape:  # per token: the real tokens
        a, b = a[mask.bool()], b[mask.bool()]
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    if "sop_logits" in want:
        assert got.pair_logits.shape == (3, 2)
        torch.testing.assert_close(got.pair_logits, want.sop_logits, atol=1e-4, rtol=1e-4)
    if got.pooler_output is not None and want.get("pooler_output") is not None:  # AlbertModel always has one: a
        # folder without it loads a fresh one
        torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=1e-4, rtol=1e-4)


def test_the_import_maps_the_class_to_our_head(pair):
    name, hf, _, ours = pair
    cfg, hc = ours.config, hf.config
    assert cfg.head == HEADS[name.split("-")[0]]
    assert cfg.share_layers and len(ours.transformer.encoder.layers) == 1 and cfg.n_layers == hc.num_hidden_layers
    assert cfg.embedding_dim == hc.embedding_size and cfg.dim == hc.hidden_size
    assert ours.transformer.encoder.embed_proj.in_features == hc.embedding_size
    assert cfg.pooler == (getattr(hf, "albert", hf).pooler is not None)
    assert cfg.pair_head == name.startswith("pretraining")
    assert (cfg.token_types, cfg.pad_token_id, cfg.norm_eps) == (3, 1, 1e-6)
    if cfg.head == "mlm":
        assert cfg.head_act == cfg.ffn  # ALBERT's MLM head: hidden_act
        assert (ours.head.weight is ours.transformer.embed.weight) == hc.tie_word_embeddings
    if name == "sequence":
        assert cfg.sentence_pooling == "pooler" and cfg.classifier_dropout == 0.2


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
    assert hc["model_type"] == "albert" and hc["architectures"] == [type(hf).__name__]
    reloaded = getattr(T, AUTO[type(hf).__name__]).from_pretrained(tmp_path / "out").eval()
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


def test_mlm_and_task_losses_equal_transformers(pair):
    name, hf, _, ours = pair
    ids, mask, types = _batch()
    g = torch.Generator().manual_seed(2)
    head = ours.config.head
    kw = {}
    if head == "mlm":
        labels = ids.masked_fill(torch.rand(ids.shape, generator=g) > 0.3, -100).masked_fill(mask == 0, -100)
        if ours.config.pair_head:  # transformers' pretraining loss is MLM + SOP: give it the SOP labels
            order = torch.tensor([0, 1, 1])
            kw = {"sentence_order_label": order}
    elif head == "tagging":
        labels = torch.randint(0, 5, ids.shape, generator=g).masked_fill(mask == 0, -100)
    elif head in ("classification", "regression"):
        labels = torch.randint(0, 3, (3,), generator=g) if head == "classification" else torch.randn(3, generator=g)
    else:
        pytest.skip(f"{name}: no labels loss")
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, **kw).loss
        out = ours(ids, attention_mask=mask, token_type_ids=types, labels=labels)
    got = out.loss
    if kw:  # pretune's loss is the head's (MLM); add the SOP term as transformers does
        got = got + torch.nn.functional.cross_entropy(out.pair_logits, kw["sentence_order_label"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- presets ----------------------------------------------------------------------------------------------------

# the published v2 configs (albert/albert-*-v2 on the Hub; Lan et al. 2020 Table 1): 12M, 18M, 60M, 235M
PUBLISHED = {"albert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                 intermediate_size=3072),
             "albert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                  intermediate_size=4096),
             "albert-xlarge": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                                   intermediate_size=8192),
             "albert-xxlarge": dict(hidden_size=4096, num_hidden_layers=12, num_attention_heads=64,
                                    intermediate_size=16384)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_count_equals_transformers(name, capsys):
    from pretune.cli import main

    with torch.device("meta"):  # AlbertConfig's defaults: vocab 30000, embeddings 128, gelu_new, one group
        hf = T.AlbertForPreTraining(T.AlbertConfig(**PUBLISHED[name]))
        ours = pretune.build_model(name)
    want = sum(p.numel() for p in hf.parameters())
    assert count_parameters(ours)["total"] == want
    assert main(["show", name, "--json"]) == 0  # what `pretune show` prints
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["parameters"]["total"] == want
    cfg = ours.config
    assert (cfg.embedding_dim, cfg.vocab_size, cfg.share_layers, cfg.pair_head) == (128, 30000, True, True)
    assert pretune.interop._family_for_config(cfg).__name__.endswith(".albert")


@pytest.mark.parametrize("name", [f"tiny-{n}" for n in PUBLISHED])
@pytest.mark.parametrize("head", ["mlm", "none", "classification", "tagging", "qa"])
def test_tiny_presets_export_to_transformers(name, head, tmp_path):
    extra = {"num_labels": {"classification": 3, "tagging": 3, "qa": 2}[head]} if head not in ("mlm", "none") else {}
    torch.manual_seed(0)
    base = pretune.build_model(name)
    model = _perturbed(base if head == "mlm" else base.with_head(head=head, **extra))
    assert model.config.pair_head == (head == "mlm")  # a task head replaces the SOP head
    pretune.to_hf(model, tmp_path / "hf")
    arch = json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    assert arch == {"mlm": "AlbertForPreTraining", "none": "AlbertModel", "classification":
                    "AlbertForSequenceClassification", "tagging": "AlbertForTokenClassification",
                    "qa": "AlbertForQuestionAnswering"}[head]
    hf = getattr(T, arch).from_pretrained(tmp_path / "hf").eval()
    ids, mask, types = _batch()
    _compare(hf, model, (ids % 128, mask, types % 2))


def test_mlm_without_sop_head_exports_as_masked_lm(tmp_path):
    model = _perturbed(pretune.build_model("tiny-albert-base", pair_head=False))
    pretune.to_hf(model, tmp_path / "hf")
    hf = T.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "AlbertForMaskedLM"
    ids, mask, types = _batch()
    _compare(hf, model, (ids % 128, mask, types % 2))
    again = pretune.from_hf(tmp_path / "hf")  # the pooler AlbertForMaskedLM has no use for comes back too
    assert again.config == model.config


# -- what does not convert ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,match", [
    (dict(num_hidden_groups=3), "num_hidden_groups=3"),
    (dict(inner_group_num=2), "inner_group_num=2"),
    (dict(architectures=["AlbertForMultipleChoice"]), "AlbertForMultipleChoice"),
    (dict(hidden_act="mish"), "hidden_act='mish'"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type='relative_key'"),
    (dict(embedding_size=32), "embedding_size=32 equal to hidden_size"),
    (dict(embedding_size="wide"), "embedding_size='wide'"),
    (dict(num_attention_heads=5), "n_heads \\(5\\) must divide dim \\(32\\)"),
])
def test_bad_configs_are_named(change, match, tmp_path):
    hf = T.AlbertModel(_config())
    hf.save_pretrained(tmp_path)
    hc = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hc, **change}))
    with pytest.raises(InteropError, match=match):
        pretune.from_hf(tmp_path)


def test_exports_that_albert_cannot_hold_say_why(tmp_path):
    base = pretune.build_model("tiny-albert-base")
    with pytest.raises(InteropError, match="albert: .*pooling='mean'"):
        pretune.to_hf(base.with_head(head="classification", num_labels=2, pooling="mean"), tmp_path / "a")
    with pytest.raises(InteropError, match="albert: .*head_act"):
        pretune.to_hf(pretune.build_model("tiny-albert-base", head_act="relu"), tmp_path / "b")
    with pytest.raises(InteropError, match="albert: needs factorised embeddings"):
        pretune.to_hf(pretune.build_model("tiny-albert-base", embed_dim=None), tmp_path / "c")
    with pytest.raises(InteropError, match="albert: needs share_layers=True"):  # and no other family holds it
        pretune.to_hf(pretune.build_model("tiny-bert-base", pooler=True, pair_head=True), tmp_path / "d")


# -- a sop pretraining run exports as AlbertForPreTraining ----------------------------------------------------------

def test_sop_run_exports_as_albert_for_pretraining(tmp_path, small_corpus, tokenizers_by_kind):
    from pretune.cli import main
    from pretune.jobs.pretrain import load_run_config, pretrain

    cfg = load_run_config(overrides=[
        "model.preset=tiny-albert-base", "objective.name=sop", f"tokenizer={tokenizers_by_kind['wordpiece']}",
        f"data.train=[{small_corpus}]", f"train.out={tmp_path / 'run'}", "train.steps=3", "train.batch_size=4",
        "train.warmup_steps=1", "train.eval_every=0", "train.save_every=0", "train.keep_last=0",
        "train.tensorboard=false", "train.plot=false", "data.packing=doc", "data.block_size=40",
        "data.eval_max=4", "train.lr=1e-2"])
    result = pretrain(cfg, show_progress=False, log=lambda *_: None)
    model = pretune.load(result.model_dir)
    assert model.config.pair_head and model.config.share_layers
    torch.manual_seed(cfg.train.seed)  # the run's initial weights: its SOP head was trained, not left at init
    start = pretune.build_model(model.config)
    assert not torch.equal(model.pair_head.weight, start.pair_head.weight)
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(result.model_dir), "--out", str(out)]) == 0
    hf = T.AutoModelForPreTraining.from_pretrained(out).eval()
    assert type(hf).__name__ == "AlbertForPreTraining"
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, model.config.vocab_size, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    types = (torch.arange(12) >= 6).long().expand(3, -1)
    _compare(hf, model.eval(), (ids, mask, types))  # MLM and SOP logits
