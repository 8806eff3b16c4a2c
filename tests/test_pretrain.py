"""End-to-end pretraining: every objective trains a tiny model on real text with its loss falling;
objective × architecture mismatches are refused; bad configs are clear errors."""

import json

import pytest

from pretune.config import ConfigError
from pretune.jobs.pretrain import load_run_config, pretrain

# objective -> (preset, tokenizer kind, extra overrides)
CASES = {
    "clm": ("tiny-gpt2", "bpe", []),
    "prefix_lm": ("tiny-gpt2", "bpe", []),
    "mlm": ("tiny-bert-base", "wordpiece", []),
    "nsp": ("tiny-bert-base", "wordpiece", ["data.packing=doc"]),
    "sop": ("tiny-bert-base", "wordpiece", ["data.packing=doc"]),
    "electra": ("tiny-electra-small", "wordpiece", ["objective.electra_lambda=10.0"]),
    "span": ("tiny-t5-small", "unigram", []),
    "iid_spans": ("tiny-t5-small", "unigram", []),
    "bert_style": ("tiny-t5-small", "wordpiece", []),
    "iid_mask": ("tiny-t5-small", "unigram", []),
    "drop_tokens": ("tiny-t5-small", "unigram", []),
    "deshuffle": ("tiny-t5-small", "unigram", []),
    "denoise": ("tiny-t5-small", "bpe", []),
}


def _run(tmp_path, objective, preset, tok_path, extra=(), steps=40, **kw):
    overrides = [f"model.preset={preset}", f"objective.name={objective}", f"tokenizer={tok_path}",
                 f"train.out={tmp_path / 'run'}", f"train.steps={steps}", "train.batch_size=16", "train.lr=1e-2",
                 "train.warmup_steps=4", "train.log_every=1", "train.eval_every=0", "train.save_every=0",
                 "train.tensorboard=false", "train.plot=false", "data.block_size=60", "model.max_seq_len=128",
                 "model.dropout=0.0", "model.attn_dropout=0.0", *extra]
    cfg = load_run_config(overrides=overrides, base=kw.get("base"))
    return cfg


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


@pytest.mark.parametrize("objective", list(CASES))
def test_every_objective_trains(objective, tmp_path, small_corpus, tokenizers_by_kind, tmp_path_factory):
    preset, kind, extra = CASES[objective]
    cfg = _run(tmp_path, objective, preset, tokenizers_by_kind[kind], extra)
    cfg.data.train = [str(small_corpus)]
    result = pretrain(cfg, show_progress=False, log=lambda *_: None)
    losses = _losses(tmp_path / "run")
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"{objective}: loss {first:.3f} -> {last:.3f} did not fall clearly"
    assert (result.model_dir / "model.safetensors").is_file()
    assert (result.model_dir / "tokenizer.json").is_file()
    assert result.eval and all(v == v for v in result.eval.values())  # evaluated, finite


@pytest.mark.parametrize("objective,preset,reason", [
    ("mlm", "tiny-gpt2", "bidirectional encoder"),
    ("span", "tiny-bert-base", "needs a decoder"),
    ("clm", "tiny-bert-base", "needs a decoder-only"),
    ("electra", "tiny-t5-small", "needs an encoder"),
])
def test_objective_architecture_mismatch_is_explained(objective, preset, reason, tmp_path, small_corpus,
                                                      tokenizers_by_kind):
    cfg = _run(tmp_path, objective, preset, tokenizers_by_kind["wordpiece"])
    cfg.data.train = [str(small_corpus)]
    with pytest.raises(ConfigError, match=reason):
        pretrain(cfg, show_progress=False, log=lambda *_: None)


def test_block_size_above_max_positions(tmp_path, small_corpus, tokenizers_by_kind):
    cfg = _run(tmp_path, "mlm", "tiny-bert-base", tokenizers_by_kind["wordpiece"], ["data.block_size=200"])
    cfg.data.train = [str(small_corpus)]
    with pytest.raises(ConfigError, match=r"block_size=200 .*max_seq_len is 128.*at most 126"):
        pretrain(cfg, show_progress=False, log=lambda *_: None)


def test_span_without_sentinels_is_explained(tmp_path, small_corpus):
    from pretune.io.tokenization import train_tokenizer

    tok = train_tokenizer([small_corpus], kind="wordpiece", vocab_size=400, sentinels=0, show_progress=False)
    path = tok.save(tmp_path / "tok.json")
    cfg = _run(tmp_path, "span", "tiny-t5-small", path)
    cfg.data.train = [str(small_corpus)]
    with pytest.raises(ConfigError, match="sentinel"):
        pretrain(cfg, show_progress=False, log=lambda *_: None)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        load_run_config(overrides=["train.lrr=1"])
    with pytest.raises(ConfigError, match="unknown config section 'trian'"):
        load_run_config(overrides=["trian.lr=1"])
    with pytest.raises(ConfigError, match="objective.name='mlmm'.*did you mean 'mlm'"):
        load_run_config(overrides=["objective.name=mlmm"])
    with pytest.raises(ConfigError, match="precision='fp8'"):
        load_run_config(overrides=["train.precision=fp8"])
    with pytest.raises(ConfigError, match="must be an integer"):
        load_run_config(overrides=["train.steps=ten"])


def test_yaml_then_overrides_precedence(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("model: tiny-gpt2\nobjective: {name: clm}\ntrain: {lr: 0.002, steps: 5}\n")
    cfg = load_run_config(y, ["--train.steps=7"], base={"train": {"steps": 3, "batch_size": 4}})
    assert cfg.model == {"preset": "tiny-gpt2"} and cfg.objective.name == "clm"
    assert cfg.train.lr == 0.002 and cfg.train.steps == 7 and cfg.train.batch_size == 4
    assert cfg.model_config(vocab_size=300).vocab_size == 300


def test_continue_pretraining_a_checkpoint_without_its_head(tmp_path, small_corpus, tokenizers_by_kind):
    """model.init: a checkpoint saved without an MLM head (like the real MiniLM) gets a fresh one; the body
    starts from the checkpoint's weights."""
    import torch

    import pretune
    from pretune.io.tokenization import Tokenizer
    from pretune.jobs.pretrain import prepare

    tok = Tokenizer.load(tokenizers_by_kind["wordpiece"])
    body = pretune.build_model("tiny-bert-base", head="none", vocab_size=tok.vocab_size, max_seq_len=128)
    pretune.save(body, tmp_path / "ckpt")
    cfg = _run(tmp_path, "mlm", "tiny-bert-base", tokenizers_by_kind["wordpiece"], ["data.block_size=40"],
               base={"model": {"init": str(tmp_path / "ckpt")}})
    cfg.data.train = [str(small_corpus)]
    _, model, _, _, _ = prepare(cfg, show_progress=False)
    assert model.config.head == "mlm"
    for (k, a), b in zip(body.transformer.state_dict().items(), model.transformer.state_dict().values()):
        assert torch.equal(a, b), k
    result = pretrain(cfg, show_progress=False, log=lambda *_: None)
    assert pretune.load(result.model_dir).config.head == "mlm"
