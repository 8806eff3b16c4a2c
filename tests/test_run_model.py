"""The model a training run starts from (``loading.build_run_model``): pretraining and finetuning build it the same
way, from a preset and a tokenizer or from a checkpoint with overrides."""

import json

import pytest
import torch

import pretune
from pretune.config import ConfigError
from pretune.jobs.finetune import load_finetune_config
from pretune.jobs.finetune import prepare as prepare_finetune
from pretune.jobs.pretrain import load_run_config
from pretune.jobs.pretrain import prepare as prepare_pretrain
from pretune.loading import build_run_model


@pytest.fixture(scope="module")
def bos_only_tokenizer(small_corpus, tmp_path_factory):
    """A BPE tokenizer with <s> and </s> but no pad token: a new encoder-decoder's decoding starts from <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([line for line in small_corpus.read_text().splitlines() if line.strip()], trainer)
    path = tmp_path_factory.mktemp("bos_tok") / "tokenizer.json"
    tk.save(str(path))
    return path


def _both_jobs(tmp_path, small_corpus, model: list[str], tokenizer) -> tuple:
    """The models pretraining (objective denoise) and finetuning (task seq2seq) start from with the same ``model.*``
    settings and tokenizer."""
    rows = [{"source": f"word {i}", "target": f"the {i}"} for i in range(8)]
    data = tmp_path / "s2s.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pre = load_run_config(None, [*model, f"tokenizer={tokenizer}", "objective.name=denoise",
                                 f"data.train=[{small_corpus}]", f"train.out={tmp_path / 'pre'}", "data.block_size=32"])
    ft = load_finetune_config(None, [*model, f"tokenizer={tokenizer}", "task.name=seq2seq", f"data.train={data}",
                                     f"train.out={tmp_path / 'ft'}", "train.batch_size=4"])
    _, pretrained, _, _, _ = prepare_pretrain(pre, show_progress=False)
    finetuned = prepare_finetune(ft, show_progress=False, log=lambda *a: None).model
    return pretrained, finetuned


@pytest.mark.parametrize("tok", ["unigram", "bos-only"])
def test_pretraining_and_finetuning_build_a_preset_alike(tmp_path, small_corpus, tokenizers_by_kind,
                                                         bos_only_tokenizer, tok):
    """An encoder-decoder from a preset gets the same config through both jobs: the tokenizer's vocabulary, pad and
    decoder start (the pad token, T5's choice; without one, <s>: finetuning kept the preset's 0 before the two
    builders became one)."""
    path = tokenizers_by_kind["unigram"] if tok == "unigram" else bos_only_tokenizer
    t = pretune.load_tokenizer(path)
    pre, ft = _both_jobs(tmp_path, small_corpus, ["model.preset=tiny-t5-small"], path)
    assert pre.config.to_dict() == ft.config.to_dict()
    start = t.pad_id if tok == "unigram" else t.bos_id
    assert start not in (None, 0) or tok == "unigram"
    assert ft.config.decoder_start_token_id == start and ft.config.vocab_size == t.vocab_size
    assert ft.config.pad_token_id == (t.pad_id if t.pad_id is not None else 0)


def test_a_checkpoint_takes_the_same_overrides_in_both_jobs(tmp_path, small_corpus, tokenizers_by_kind):
    """model.init with model.dropout: both jobs start from the checkpoint's weights with the new dropout (pretraining
    used to ignore the model.* keys beside init)."""
    tok = tokenizers_by_kind["unigram"]
    ckpt = pretune.build_model("tiny-t5-small", vocab_size=pretune.load_tokenizer(tok).vocab_size, dropout=0.1)
    pretune.save(ckpt, tmp_path / "ckpt", tokenizer=tok)
    pre, ft = _both_jobs(tmp_path, small_corpus, [f"model.init={tmp_path / 'ckpt'}", "model.dropout=0.0"], tok)
    for model in (pre, ft):
        assert model.config.dropout == 0.0
        for (k, a), b in zip(ckpt.transformer.state_dict().items(), model.transformer.state_dict().values()):
            assert torch.equal(a, b), k


def test_an_override_that_changes_the_checkpoints_weights_is_refused(tmp_path, tokenizers_by_kind):
    tok = tokenizers_by_kind["wordpiece"]
    pretune.save(pretune.build_model("tiny-bert-base", vocab_size=pretune.load_tokenizer(tok).vocab_size),
                 tmp_path / "ckpt", tokenizer=tok)
    with pytest.raises(ConfigError, match=r"model\.n_layers=3 \(it has 2\) would change the shapes"):
        build_run_model({"init": str(tmp_path / "ckpt"), "n_layers": 3})
    model, _ = build_run_model({"init": str(tmp_path / "ckpt"), "preset": "tiny-gpt2", "n_layers": 2})
    assert model.config.arch == "encoder"  # with init, the preset is not read; an override equal to its value is fine
