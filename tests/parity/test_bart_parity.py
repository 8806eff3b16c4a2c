"""Parity with transformers' BART: random-weight BartForConditionalGeneration / BartModel /
BartForSequenceClassification / BartForQuestionAnswering from small unusual configs (3 encoder + 1 decoder layers,
a decoder with its own head count and FFN width, scaled embeddings, ReLU or tanh-GELU FFNs, a forced first token, a
regression head), every parameter and the
final_logits_bias buffer perturbed: imported outputs within 1e-4 on a right-padded batch, exports that transformers'
Auto classes load with the same outputs, identical round trips, the loss of ``labels``, greedy and beam-search
tokens identical to ``generate`` (forced first and last tokens included), ``pretune show``'s parameter counts, bad
folders and configs refused by name, and a model pretrained with configs/pretrain/bart-denoise.yaml loading in
BartForConditionalGeneration with the same logits."""

from __future__ import annotations

import json

import pytest
import torch

import pretune
from pretune import ConfigError, count_parameters
from pretune.generation import generate
from pretune.interop import InteropError

T = pytest.importorskip("transformers")

V = 99
NEW = 8
EOS, PAD = 2, 1


def _config(**kw):
    base = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=40)
    return T.BartConfig(**{**base, **kw})


def _variants():
    """name -> (transformers class, config, extra config.json keys)."""
    return {
        "lm": (T.BartForConditionalGeneration, _config(), {}),
        "lm-scaled-relu-forced-bos": (T.BartForConditionalGeneration, _config(
            encoder_layers=3, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            scale_embedding=True, activation_function="relu", dropout=0.2, attention_dropout=0.1),
            {"forced_bos_token_id": 0}),
        # the decoder's own heads (self- and cross-attention: 2 of 16 against the encoder's 4 of 8) and FFN width
        "lm-split": (T.BartForConditionalGeneration, _config(decoder_attention_heads=2, decoder_ffn_dim=53), {}),
        "body-gelu-new": (T.BartModel, _config(activation_function="gelu_new", encoder_layers=1), {}),
        "classification": (T.BartForSequenceClassification, _config(
            num_labels=3, id2label={0: "neg", 1: "neutral", 2: "pos"}, label2id={"neg": 0, "neutral": 1, "pos": 2},
            classifier_dropout=0.1, scale_embedding=True), {}),
        "regression": (T.BartForSequenceClassification, _config(num_labels=1, problem_type="regression"), {}),
        "qa": (T.BartForQuestionAnswering, _config(encoder_layers=3, decoder_layers=2, encoder_attention_heads=2,
                                                   decoder_attention_heads=8, decoder_ffn_dim=24), {}),
    }


VARIANTS = list(_variants())
LM = ["lm", "lm-scaled-relu-forced-bos", "lm-split"]
AUTO = {"BartForConditionalGeneration": "AutoModelForSeq2SeqLM", "BartModel": "AutoModel",
        "BartForSequenceClassification": "AutoModelForSequenceClassification",
        "BartForQuestionAnswering": "AutoModelForQuestionAnswering"}


def _perturb(hf, scale: float = 0.05):
    """HF inits norms to 1/0, biases and final_logits_bias to 0: perturb every tensor so each one is tested."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
        if hasattr(hf, "final_logits_bias"):
            hf.final_logits_bias.add_(torch.randn(hf.final_logits_bias.shape, generator=g) * scale)
    return hf.eval()


def _save(hf, path, extra: dict):
    hf.save_pretrained(path)
    for name in ("config.json", "generation_config.json"):  # as facebook/bart-large writes forced_bos_token_id
        file = path / name
        if extra and file.is_file():
            file.write_text(json.dumps({**json.loads(file.read_text()), **extra}, indent=2))
    return type(hf).from_pretrained(path).eval()


_MADE: dict[str, tuple] = {}


def _made(name: str, tmp_path_factory) -> tuple:
    """(variant, transformers model, its folder, the folder imported with pretune.from_hf), made once."""
    if name not in _MADE:
        cls, cfg, extra = _variants()[name]
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        hf = _save(_perturb(cls(cfg), scale=0.2 if name in LM else 0.05), path, extra)
        _MADE[name] = (name, hf, path, pretune.from_hf(path))
    return _MADE[name]


@pytest.fixture(params=VARIANTS)
def pair(request, tmp_path_factory):
    return _made(request.param, tmp_path_factory)


@pytest.fixture(params=LM)
def lm_pair(request, tmp_path_factory):
    return _made(request.param, tmp_path_factory)


def _batch():
    """Right-padded <s> ... </s> rows (one EOS each, as BART's tokenizer makes them) and decoder inputs."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    for row, n in ((0, 11), (1, 7), (2, 4)):
        mask[row, n:] = 0
        ids[row, 0], ids[row, n - 1] = 0, EOS
    ids = ids.masked_fill(mask == 0, PAD)
    dec = torch.randint(3, V, (3, 6), generator=g)
    dec[:, 0] = EOS
    dec_mask = torch.ones_like(dec)
    dec_mask[2, 4:] = 0
    return ids, mask, dec, dec_mask


def _outputs(model, batch, *, ours: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the outputs to compare, the positions that count)."""
    ids, mask, dec, dec_mask = batch
    with torch.no_grad():
        if ours:
            task = model.config.head in ("classification", "regression", "qa")
            out = model(ids, attention_mask=mask) if task else model(
                ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
            got = out.logits if out.logits is not None else out.last_hidden_state
        else:
            task = not isinstance(model, (T.BartForConditionalGeneration, T.BartModel))
            out = model(input_ids=ids, attention_mask=mask) if task else model(
                input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
            if isinstance(model, T.BartForQuestionAnswering):
                got = torch.stack([out.start_logits, out.end_logits], -1)
            else:
                got = out.logits if hasattr(out, "logits") else out.last_hidden_state
    if got.dim() == 2:  # one vector per row
        return got, torch.ones(got.shape[0], dtype=torch.bool)
    return got, (mask if got.shape[1] == ids.shape[1] else dec_mask).bool()


def _assert_same(hf, ours, batch=None):
    batch = batch or _batch()
    a, keep = _outputs(hf, batch, ours=False)
    b, _ = _outputs(ours, batch, ours=True)
    assert a.shape == b.shape
    torch.testing.assert_close(b[keep], a[keep], atol=1e-4, rtol=1e-4)


def test_from_hf_outputs_match(pair):
    name, hf, _, ours = pair
    cfg = ours.config
    assert (cfg.arch, cfg.position_offset, cfg.max_seq_len, cfg.task_stack) == ("encoder-decoder", 2, 42, "decoder")
    assert cfg.head == {"lm": "lm", "body": "none", "classification": "classification", "regression": "regression",
                        "qa": "qa"}[name.split("-")[0]]
    assert cfg.logit_bias == (cfg.head == "lm")
    _assert_same(hf, ours)


def test_each_quirk_changes_the_outputs_so_parity_pins_it(pair):
    """The offset, the embedding LayerNorm, the scale, the logit bias, the shifted decoder input and the decoder's
    own head count (the same weight shapes: only the split into heads differs) all matter."""
    _, hf, _, ours = pair
    batch = _batch()
    ref, keep = _outputs(ours, batch, ours=True)
    cfg = ours.config
    changes = {"position_offset": dict(position_offset=0), "embed_norm": dict(embed_norm=False),
               "scale_embeddings": dict(scale_embeddings=not cfg.scale_embeddings)}
    if cfg.head == "lm":
        changes["logit_bias"] = dict(logit_bias=False)
    if cfg.decoder_heads is not None:
        changes["decoder_heads"] = dict(decoder_heads=None)
    if cfg.head != "lm" and cfg.head != "none":
        changes["task_stack"] = dict(task_stack="encoder", pooling="mean" if cfg.head != "qa" else None)
    for name, fields in changes.items():
        other = pretune.build_model(cfg.replace(**fields)).eval()
        state = ours.state_dict()
        mine = other.state_dict()
        other.load_state_dict({k: state[k] if k in state and state[k].shape == v.shape else v
                               for k, v in mine.items()})
        out, _ = _outputs(other, batch, ours=True)
        assert out.shape != ref.shape or (out - ref)[keep].abs().max() > 1e-4, name


def test_to_hf_loads_in_transformers_with_same_outputs(pair, tmp_path):
    _, hf, path, _ = pair
    ours = pretune.from_hf(path)
    with torch.no_grad():  # weights that differ from the source, so the export is really tested
        for t in ours.state_dict().values():
            t.add_(0.01)
    pretune.to_hf(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "bart" and written["architectures"] == [type(hf).__name__]
    loaded = getattr(T, AUTO[type(hf).__name__]).from_pretrained(tmp_path / "out").eval()
    assert type(loaded) is type(hf)
    if ours.config.logit_bias:
        assert torch.equal(loaded.final_logits_bias[0], ours.head.bias)
    _assert_same(loaded, ours)


def test_round_trip_is_identical(pair, tmp_path):
    _, _, _, ours = pair
    pretune.to_hf(ours, tmp_path / "rt")
    again = pretune.from_hf(tmp_path / "rt")
    assert again.config == ours.config
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_show_counts_the_parameters_transformers_counts(pair, capsys):
    _, hf, path, ours = pair
    assert count_parameters(ours)["total"] == hf.num_parameters()
    from pretune.cli import main

    assert main(["show", str(path)]) == 0
    total = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["total"])
    assert total.split()[1] == f"{hf.num_parameters():,}"


@pytest.mark.parametrize("name", ["lm", "classification", "regression"])
def test_labels_loss_equals_transformers(name, tmp_path_factory):
    """LM labels (-100 ignored; the fused loss includes final_logits_bias) and class labels."""
    _, hf, _, ours = _made(name, tmp_path_factory)
    ids, mask, _, _ = _batch()
    if ours.config.head == "lm":
        labels = torch.randint(3, V, (3, 5), generator=torch.Generator().manual_seed(2))
        labels[1, 3:] = -100
    elif ours.config.head == "regression":
        labels = torch.tensor([0.5, -1.0, 2.0])
    else:
        labels = torch.tensor([2, 0, 1])
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        got = ours(ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --- generation ------------------------------------------------------------------------------------------
def _hf_generate(hf, ids, mask, **kw):
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, do_sample=False, **kw)


@pytest.mark.parametrize("options", [{}, dict(num_beams=3), dict(num_beams=4, num_return_sequences=2,
                                                                 length_penalty=0.6)],
                         ids=["greedy", "beam3", "beam4-two"])
def test_generate_gives_the_tokens_of_transformers(lm_pair, options):
    """Right-padded encoder inputs; the decoder starts from </s>; the token at max_new_tokens is forced to </s>
    (and, in the forced-bos variant, the first to <s>); EOS is also a token greedy decoding makes in row 0 but not
    in row 2, so that rows end early while others go on."""
    name, hf, _, ours = lm_pair
    ids, mask, _, _ = _batch()
    probe = _hf_generate(hf, ids, mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=PAD)[:, 1:].tolist()
    eos = next(t for t in probe[0] if t not in probe[2] + [0, EOS])
    kw = dict(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, **options)
    want = _hf_generate(hf, ids, mask, **kw)
    got = generate(ours, ids, mask, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got[:, 0] == EOS).all()  # decoder_start_token_id
    if "forced-bos" in name:
        assert (got[:, 1] == 0).all()
    if not options:
        assert (got[0] == eos).any() and got.shape[1] > int((got[0] == eos).nonzero()[0]) + 1  # row 0 ended early


def test_generate_with_the_config_defaults_gives_the_tokens_of_transformers(lm_pair):
    """No arguments: eos, pad, decoder start and the forced tokens all come from the imported config; a row that
    runs to max_new_tokens ends with the forced </s>."""
    _, hf, _, ours = lm_pair
    ids, mask, _, _ = _batch()
    for kw in ({}, dict(num_beams=3)):
        want = _hf_generate(hf, ids, mask, max_new_tokens=NEW, **kw)
        got = pretune.generate(ours, ids, mask, max_new_tokens=NEW, **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert ours.config.forced_eos_token_id == EOS and (got[:, 1:] == EOS).any(1).all()


# --- presets and bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,kw", [
    ("bart-base", dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                       decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)),
    ("bart-large", {}),  # BartConfig's defaults are bart-large's shape
])
def test_presets_have_the_parameters_of_transformers(preset, kw):
    with torch.device("meta"):
        hf = T.BartForConditionalGeneration(T.BartConfig(**kw))
        ours = pretune.build_model(preset)
    assert count_parameters(ours)["total"] == hf.num_parameters()


@pytest.mark.parametrize("preset", ["tiny-bart-base", "tiny-bart-large"])
def test_tiny_presets_export_to_transformers(preset, tmp_path):
    model = pretune.build_model(preset, dropout=0.0, attn_dropout=0.0).eval()
    with torch.no_grad():
        model.head.bias.normal_()
    pretune.to_hf(model, tmp_path / "hf")
    hf = T.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is T.BartForConditionalGeneration
    assert hf.generation_config.forced_eos_token_id == EOS and hf.generation_config.decoder_start_token_id == EOS
    _assert_same(hf, model)


@pytest.mark.parametrize("change,message", [
    (dict(tie_word_embeddings=False), "tie_word_embeddings=False is not supported"),
    (dict(activation_function="tanh"), "activation_function='tanh' is not supported"),
    (dict(architectures=["BartForCausalLM"]), "architectures='BartForCausalLM' is not supported"),
    (dict(d_model=None), "config.json has no 'd_model'"),
])
def test_bad_folders_are_refused_by_name(change, message, tmp_path):
    hf = T.BartForConditionalGeneration(_config())
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(InteropError, match=message):
        pretune.from_hf(tmp_path)


@pytest.mark.parametrize("change,message", [
    (dict(decoder_attention_heads=3), r"decoder_heads \(3\) must divide dim \(32\)"),
    (dict(decoder_ffn_dim=0), r"decoder_ffn_dim must be > 0"),
])
def test_bad_decoder_sizes_are_refused_by_name(change, message, tmp_path):
    hf = T.BartForConditionalGeneration(_config())
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConfigError, match=message):
        pretune.from_hf(tmp_path)


def test_a_decoder_with_its_own_heads_and_ffn_width_imports_and_exports_unchanged(tmp_path_factory, tmp_path):
    """encoder_attention_heads 4 / decoder_attention_heads 2, encoder_ffn_dim 37 / decoder_ffn_dim 53: the config
    keeps both (decoder_heads, decoder_ffn_dim), the decoder is built with them, and the export is the original
    transformers model again: the same config sizes and every tensor equal."""
    _, hf, _, ours = _made("lm-split", tmp_path_factory)
    cfg = ours.config
    assert (cfg.n_heads, cfg.decoder_heads, cfg.ffn_dim, cfg.decoder_ffn_dim) == (4, 2, 37, 53)
    assert (cfg.decoder_config.n_heads, cfg.decoder_config.ffn_dim) == (2, 53)
    state = ours.state_dict()
    assert state["transformer.encoder.layers.0.ffn.up_proj.weight"].shape == (37, 32)
    assert state["transformer.decoder.layers.2.ffn.up_proj.weight"].shape == (53, 32)
    assert count_parameters(ours)["total"] == hf.num_parameters()
    pretune.to_hf(ours, tmp_path / "out")
    back = T.BartForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    sizes = ("d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
             "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings", "activation_function")
    assert {k: getattr(back.config, k) for k in sizes} == {k: getattr(hf.config, k) for k in sizes}
    want, got = hf.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    _assert_same(back, ours)


def test_untied_embedding_copies_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = T.BartForConditionalGeneration(_config())
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.decoder.embed_tokens.weight"] = tensors["model.shared.weight"] + 1
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InteropError, match="'decoder.embed_tokens.weight' differs from the shared token embedding"):
        pretune.from_hf(tmp_path)


@pytest.mark.parametrize("fields,message", [
    (dict(head="tagging", num_labels=3), "bart: head='tagging' has no Hugging Face class"),
    (dict(head="classification", num_labels=2, task_stack="encoder", pooling="mean"),
     "bart: BART's task classes read the decoder"),
    (dict(head="classification", num_labels=2, pooling="cls"), r"bart: BartForSequenceClassification classifies "
                                                                r"dense \+ tanh on the decoder's state"),
    (dict(norm_eps=1e-6), "bart: needs norm_eps=1e-05"),
    (dict(position_offset=0), "bart: needs position_offset=2"),
    (dict(n_kv_heads=4, decoder_heads=8), "bart: needs plain multi-head attention in the decoder .*got 8 heads, 4 "
                                          "key/value heads"),
])
def test_configs_bart_cannot_hold_are_refused_with_the_reason(fields, message, tmp_path):
    model = pretune.build_model("tiny-bart-base", **fields)
    with pytest.raises(InteropError, match=message):
        pretune.to_hf(model, tmp_path / "out")


# --- a model pretrained with the BART config ---------------------------------------------------------------
def test_bart_denoise_config_pretrains_and_exports_to_transformers(tmp_path, small_corpus, tokenizers_by_kind):
    """configs/pretrain/bart-denoise.yaml (shrunk, a few steps on the bundled corpus with the BPE tokenizer, whose
    <mask> the infilling needs) -> `pretune convert --to-hf` -> BartForConditionalGeneration: the same logits."""
    from pathlib import Path

    from pretune.cli import main
    from pretune.jobs.pretrain import load_run_config, pretrain

    config = Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "bart-denoise.yaml"
    cfg = load_run_config(config, [
        "model.n_layers=2", "model.dim=32", "model.n_heads=4", "model.ffn_dim=48", "model.max_seq_len=66",
        f"tokenizer={tokenizers_by_kind['bpe']}", f"data.train=[{small_corpus}]", f"train.out={tmp_path / 'run'}",
        "train.steps=3", "train.batch_size=4", "train.warmup_steps=1", "train.eval_every=0", "train.save_every=0",
        "train.keep_last=0", "train.tensorboard=false", "train.plot=false", "data.eval_max=4"])
    result = pretrain(cfg, show_progress=False, log=lambda *_: None)
    assert result.steps == 3 and result.train_loss == result.train_loss
    mcfg = pretune.load(result.model_dir).config
    assert (mcfg.arch, mcfg.position_offset, mcfg.logit_bias, mcfg.decoder_start_token_id) == (
        "encoder-decoder", 2, True, EOS)
    assert main(["convert", "--to-hf", str(result.model_dir), "--out", str(tmp_path / "hf")]) == 0
    hf = T.BartForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ours = pretune.load(result.model_dir).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, mcfg.vocab_size, (2, 64), generator=g)  # the full 64 positions
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    dec = torch.randint(5, mcfg.vocab_size, (2, 64), generator=g)
    dec_mask = torch.ones_like(dec)
    _assert_same(hf, ours, (ids, mask, dec, dec_mask))


@pytest.mark.parametrize("name,arch", [("classification", "BartForSequenceClassification"),
                                       ("qa", "BartForQuestionAnswering"), ("seq2seq", "BartForConditionalGeneration")])
def test_a_finetuned_bart_exports_to_its_transformers_class(name, arch, tmp_path, tokenizers_by_kind):
    """A tiny BART body (BPE tokenizer) finetuned 3 steps with configs/finetune/NAME.yaml: the classifier reads the
    decoder at each input's final </s> (the task's inputs end with it), the QA head every decoder state, the seq2seq
    model generates; each exports to transformers' class with the same outputs."""
    from pathlib import Path

    from pretune.io.checkpoint import save
    from pretune.io.tokenization import Tokenizer
    from pretune.jobs.finetune import finetune, load_finetune_config

    tok = Tokenizer.load(tokenizers_by_kind["bpe"])
    torch.manual_seed(0)
    body = pretune.build_model("tiny-bart-base", vocab_size=tok.vocab_size)
    save(body, tmp_path / "body", tokenizer=tokenizers_by_kind["bpe"])
    config = Path(__file__).resolve().parents[2] / "configs" / "finetune" / f"{name}.yaml"
    cfg = load_finetune_config(config, [
        f"model.init={tmp_path / 'body'}", f"train.out={tmp_path / 'run'}", "tune.epochs=0", "train.steps=3",
        "train.batch_size=8", "train.plot=false", "train.keep_last=0"])
    result = finetune(cfg, show_progress=False, log=lambda *a, **k: None)
    assert result.steps == 3 and result.test and all(v == v for v in result.test.values())
    ours = pretune.load(result.model_dir).eval()
    assert ours.config.task_stack == "decoder"
    pretune.to_hf(ours, tmp_path / "hf")
    hf = getattr(T, arch).from_pretrained(tmp_path / "hf").eval()
    ids, mask, dec, dec_mask = _batch()
    ids = torch.where(ids > 4, ids + 5, ids)  # the tokenizer's specials: <s> 0, <pad> 1, </s> 2, <unk> 3, <mask> 4
    _assert_same(hf, ours, (ids, mask, dec, dec_mask))
