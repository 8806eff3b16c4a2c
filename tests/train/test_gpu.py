"""The CUDA paths (run with `pytest -m gpu` on a machine with a GPU; skipped elsewhere): bf16 training, SDPA's
flash kernel, torch.compile, and the nccl process group of a torchrun job."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bf16_training_steps_on_the_gpu_lower_the_loss():
    from pretune.model import build_model

    torch.manual_seed(0)
    model = build_model("tiny-gpt2", dropout=0.0, attn_dropout=0.0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 128, (8, 64), device="cuda")
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.0


def test_causal_attention_runs_on_the_flash_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pretune.model import build_model

    model = build_model("tiny-llama", dim=128, n_heads=2, n_kv_heads=2).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 64), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if the flash kernel cannot take these inputs
        model(input_ids=ids).logits.float().sum().backward()


def test_compiled_blocks_match_eager():
    from pretune.model import build_model

    torch.manual_seed(0)
    model = build_model("tiny-gpt2", dropout=0.0, attn_dropout=0.0).cuda().eval()
    ids = torch.randint(0, 128, (2, 32), device="cuda")
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        for block in model.transformer.decoder.layers:
            block.compile()
        compiled = model(input_ids=ids).logits
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_pretraining_under_torchrun_uses_nccl(tmp_path, small_corpus, tokenizers_by_kind, parallel):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "pretune", "pretrain", "--preset",
            "tiny-gpt2", "--objective", "clm", "--tokenizer", str(tokenizers_by_kind["bpe"]), "--data",
            str(small_corpus), "--steps", "4", "--out", str(tmp_path / "run"), "--quiet", "train.batch_size=8",
            "data.block_size=48", "train.tensorboard=false", "train.plot=false", f"train.parallel={parallel}"]
    res = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def _fast_and_reference(name: str, **overrides):
    from pretune.model import build_model

    torch.manual_seed(0)
    fast = build_model(name, dropout=0.0, attn_dropout=0.0, **overrides).cuda()
    ref = build_model(name, fast=False, dropout=0.0, attn_dropout=0.0, **overrides).cuda()
    ref.load_state_dict(fast.state_dict())
    return fast, ref


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-t5-small", "tiny-bert-base"])
def test_fast_model_equals_the_reference_on_the_gpu(name):
    """The fast wing on CUDA (stacked q/k/v and gate/up, the written-out backwards, the fused LM head + loss): the
    reference's logits, loss and gradients in fp32 (TF32 off), and its logits to bf16 rounding under autocast."""
    torch.backends.cuda.matmul.allow_tf32 = False
    fast, ref = _fast_and_reference(name)
    ids = torch.randint(1, 100, (4, 32), device="cuda")
    kw = {"decoder_input_ids": ids[:, :16]} if fast.config.arch == "encoder-decoder" else {}
    labels = kw.get("decoder_input_ids", ids)
    losses, grads = [], []
    for model in (fast, ref):
        loss = model.train()(ids, labels=labels, **kw).loss
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, list(model.parameters()), allow_unused=True))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = fast.eval()(ids, **kw).logits, ref.eval()(ids, **kw).logits
    torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


def test_fast_model_generates_the_references_tokens_on_the_gpu():
    from pretune.generation import generate

    fast, ref = _fast_and_reference("tiny-llama")
    ids = torch.randint(1, 100, (3, 8), device="cuda")
    kw = dict(max_new_tokens=12, min_new_tokens=12)
    assert torch.equal(generate(fast.eval(), ids, **kw), generate(ref.eval(), ids, **kw))
    compiled = generate(fast, ids, compile=True, **kw)
    assert torch.equal(compiled, generate(fast, ids, **kw))


def test_compiled_fast_training_step_matches_eager_on_the_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    fast, _ = _fast_and_reference("tiny-llama")
    ids = torch.randint(1, 100, (4, 32), device="cuda")
    eager = fast.train()(ids, labels=ids).loss
    compiled = torch.compile(fast)(ids, labels=ids).loss
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
