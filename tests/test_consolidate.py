"""`pretune consolidate` (a model folder from a training checkpoint) and large exports (`convert --to-hf --dtype
bf16 --max-shard-size`: sharded safetensors with transformers' index file)."""

import json

import pytest
import torch

from pretune.cli import main
from pretune.cli.model import parse_size
from pretune.io.checkpoint import CheckpointError, read_weights, save
from pretune.jobs.consolidate import consolidate
from pretune.jobs.pretrain import load_run_config, pretrain
from pretune.model import build_model


def test_a_plain_checkpoint_consolidates_to_its_model(tmp_path, small_corpus, tokenizers_by_kind):
    cfg = load_run_config(overrides=[
        "model.preset=tiny-gpt2", "objective.name=clm", f"tokenizer={tokenizers_by_kind['bpe']}",
        f"data.train=[{small_corpus}]", f"train.out={tmp_path / 'run'}", "data.block_size=32", "train.steps=2",
        "train.batch_size=4", "train.save_every=1", "train.tensorboard=false", "train.plot=false"])
    pretrain(cfg, show_progress=False, log=lambda *_: None)
    out = consolidate(tmp_path / "run" / "checkpoints" / "step-00000002", tmp_path / "m", dtype="bf16")
    saved, ref = read_weights(out / "model.safetensors"), read_weights(tmp_path / "run" / "model" / "model.safetensors")
    assert (out / "run.yaml").is_file() and (out / "tokenizer.json").is_file()
    assert saved.keys() == ref.keys()
    for n, t in saved.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[n].to(torch.bfloat16)), n


def test_what_is_not_a_checkpoint_is_refused_by_name(tmp_path):
    save(build_model("tiny-gpt2"), tmp_path / "model")
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        consolidate(tmp_path / "model", tmp_path / "out")
    (tmp_path / "ck").mkdir()
    torch.save({"step": 1}, tmp_path / "ck" / "trainer.pt")
    (tmp_path / "ck" / "trainable.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="holds only the tensors its run trained"):
        consolidate(tmp_path / "ck", tmp_path / "out")
    assert main(["consolidate", str(tmp_path / "model"), "--out", str(tmp_path / "out2")]) == 2


def test_sizes_parse_as_transformers_writes_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1234") == 1234
    from pretune.config import ConfigError

    with pytest.raises(ConfigError, match="expected a size"):
        parse_size("five gigs")


def test_a_bf16_export_in_shards_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build_model("tiny-gpt2", vocab_size=300, dropout=0.0, attn_dropout=0.0).eval()
    save(model, tmp_path / "ours")
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf"), "--dtype", "bf16",
                 "--max-shard-size", "20KB"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((tmp_path / "hf" / f).is_file() for f in files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.dtype == torch.bfloat16
    ids = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        ours = model.to(torch.bfloat16)(input_ids=ids).logits.float()
        theirs = hf(input_ids=ids).logits.float()
    torch.testing.assert_close(theirs, ours, atol=2e-2, rtol=0)
    # and pretune reads the sharded folder back
    from pretune.interop import from_hf

    again = from_hf(tmp_path / "hf")
    assert torch.equal(again.transformer.embed.weight.to(torch.bfloat16), model.transformer.embed.weight)
