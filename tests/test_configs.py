"""Every example config under configs/ parses and runs a few steps, shrunk to a tiny model.

Pretraining configs run on a small real corpus with the tokenizer kind their header names; each objective a
config's header offers (``objective.name=...``, whole-word and span masking) runs too. Finetuning configs run on
the bundled data their ``${bundled:...}`` paths name, from a tiny checkpoint of the family they are meant for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pretune.jobs.finetune import finetune, load_finetune_config
from pretune.jobs.pretrain import load_run_config, pretrain

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# pretraining config -> the tokenizer kind its header asks for
TOKENIZER = {"albert-sop": "wordpiece", "bart-denoise": "bpe", "bert-mlm": "wordpiece", "bert-nsp": "wordpiece",
             "deberta-mlm": "wordpiece",
             "electra": "wordpiece", "gpt2-clm": "bpe", "gpt2-prefix-lm": "bpe", "llama-clm": "bpe",
             "roberta-mlm": "bpe", "t5-span": "unigram", "t5-variants": "unigram"}
# the variants a config's header offers, each run as its own case
VARIANTS = {"bert-mlm": [(), ("objective.whole_word=true",), ("objective.span_masking=true",)],
            "t5-variants": [(f"objective.name={o}",) for o in ("bert_style", "iid_mask", "iid_spans", "drop_tokens",
                                                                "deshuffle", "prefix_lm")]}
PRETRAIN_CASES = [(name, extra) for name in sorted(TOKENIZER) for extra in VARIANTS.get(name, [()])]


def test_every_pretraining_config_has_a_case():
    assert {p.stem for p in (CONFIGS / "pretrain").glob("*.yaml")} == set(TOKENIZER)


def _shrunk_model(cfg) -> list[str]:
    """Overrides that shrink the config's model to 1 layer x 32 wide, keeping every architectural choice."""
    m = cfg.model_config(vocab_size=100)
    out = ["model.n_layers=1", "model.dim=32", "model.n_heads=2", "model.ffn_dim=64", "model.max_seq_len=64"]
    if m.arch == "encoder-decoder":
        out.append("model.n_decoder_layers=1")
    if m.head_dim:
        out.append("model.head_dim=16")
    if m.embed_dim:
        out.append("model.embed_dim=16")
    if m.n_kv_heads:
        out.append("model.n_kv_heads=1")
    return out


@pytest.mark.parametrize("name,extra", PRETRAIN_CASES, ids=[f"{n}{''.join('-' + e.split('=')[1] for e in x)}"
                                                             for n, x in PRETRAIN_CASES])
def test_pretraining_config_runs(name, extra, tmp_path, small_corpus, tokenizers_by_kind):
    config = CONFIGS / "pretrain" / f"{name}.yaml"
    cfg = load_run_config(config, list(extra))
    run = [*extra, *_shrunk_model(cfg), f"tokenizer={tokenizers_by_kind[TOKENIZER[name]]}",
           f"data.train=[{small_corpus}]", f"train.out={tmp_path / 'run'}", "train.steps=2", "train.batch_size=4",
           "train.warmup_steps=1", "train.eval_every=0", "train.save_every=0", "train.keep_last=0",
           "train.tensorboard=false", "train.plot=false", "data.block_size=40", "data.eval_max=4"]
    cfg = load_run_config(config, run)
    result = pretrain(cfg, show_progress=False, log=lambda *_: None)
    assert result.steps == 2 and result.train_loss == result.train_loss  # ran, finite
    assert (result.model_dir / "model.safetensors").is_file()


# the lectures' encoder families: their configs' models export to the transformers class of the family
EXPORTS = {"bart-denoise": "BartForConditionalGeneration", "electra": "ElectraForPreTraining",
           "albert-sop": "AlbertForPreTraining", "deberta-mlm": "DebertaV2ForMaskedLM"}


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_family_configs_export_to_transformers_with_equal_logits(name, tmp_path, small_corpus, tokenizers_by_kind):
    import json

    import torch

    transformers = pytest.importorskip("transformers")
    from pretune.interop import to_hf
    from pretune.io.checkpoint import load

    config = CONFIGS / "pretrain" / f"{name}.yaml"
    cfg = load_run_config(config, [])
    run = [*_shrunk_model(cfg), f"tokenizer={tokenizers_by_kind[TOKENIZER[name]]}", f"data.train=[{small_corpus}]",
           f"train.out={tmp_path / 'run'}", "train.steps=3", "train.batch_size=4", "train.warmup_steps=1",
           "train.eval_every=0", "train.save_every=0", "train.keep_last=0", "train.tensorboard=false",
           "train.plot=false", "data.block_size=40", "data.eval_max=4"]
    pretrain(load_run_config(config, run), show_progress=False, log=lambda *_: None)
    model = load(tmp_path / "run" / "model").eval()
    to_hf(model, tmp_path / "hf")
    arch = json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    assert arch == EXPORTS[name]
    hf = getattr(transformers, arch).from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(5, model.config.vocab_size, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    extra = {"decoder_input_ids": ids[:, :7]} if model.config.arch == "encoder-decoder" else {}
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask, **extra)
        theirs = hf(input_ids=ids, attention_mask=mask, **extra)
    field = {"ElectraForPreTraining": "logits", "AlbertForPreTraining": "prediction_logits"}.get(arch, "logits")
    keep = mask.bool() if not extra else torch.ones(2, 7, dtype=torch.bool)
    torch.testing.assert_close(getattr(theirs, field)[keep], ours.logits[keep], atol=1e-4, rtol=0)


# finetuning config -> the checkpoint families it is run with (an encoder, or the seq2seq families)
FINETUNE_CASES = [("classification", "bert"), ("classification-supersense", "bert"), ("pair", "bert"),
                  ("pair", "gpt2"), ("regression", "bert"), ("tagging", "bert"), ("qa", "bert"), ("seq2seq", "t5"),
                  ("seq2seq", "gpt2")]


def test_every_finetuning_config_has_a_case():
    assert {p.stem for p in (CONFIGS / "finetune").glob("*.yaml")} == {name for name, _ in FINETUNE_CASES}


@pytest.fixture(scope="module")
def tiny_checkpoints(tokenizers_by_kind, tmp_path_factory) -> dict[str, Path]:
    """A random-weight tiny checkpoint of each family, saved with its tokenizer (what `pretrain` leaves)."""
    import torch

    from pretune.io.checkpoint import save
    from pretune.io.tokenization import Tokenizer
    from pretune.model import TransformerLM
    from pretune.presets import get_preset

    d = tmp_path_factory.mktemp("ckpts")
    out = {}
    for family, preset, kind in (("bert", "tiny-bert-base", "wordpiece"), ("gpt2", "tiny-gpt2", "bpe"),
                                 ("t5", "tiny-t5-small", "unigram")):
        tok = Tokenizer.load(tokenizers_by_kind[kind])
        pad = tok.pad_id if tok.pad_id is not None else 0
        torch.manual_seed(0)
        model = TransformerLM(get_preset(preset, vocab_size=tok.vocab_size, pad_token_id=pad,
                                         decoder_start_token_id=pad))
        out[family] = save(model, d / family, tokenizer=tokenizers_by_kind[kind])
    return out


@pytest.mark.parametrize("name,family", FINETUNE_CASES, ids=[f"{n}-{f}" for n, f in FINETUNE_CASES])
def test_finetuning_config_runs(name, family, tmp_path, tiny_checkpoints):
    cfg = load_finetune_config(CONFIGS / "finetune" / f"{name}.yaml", [
        f"model.init={tiny_checkpoints[family]}", f"train.out={tmp_path / 'run'}", "tune.epochs=0", "train.steps=3",
        "train.batch_size=8", "train.plot=false", "train.keep_last=0"])
    assert Path(cfg.data.train).is_file() and Path(cfg.data.test).is_file()  # ${bundled:...} resolved
    result = finetune(cfg, show_progress=False, log=lambda *a, **k: None)
    assert result.steps == 3
    assert result.test and all(v == v for v in result.test.values())  # scored with the task's metrics, finite
