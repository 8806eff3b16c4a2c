"""llama.cpp itself (llama-cpp-python, ``make install-llamacpp``) runs the GGUF files pretune writes: it tokenizes
held-out text to pretune's ids, decodes greedily to pretune's tokens (f32: every prompt; q8_0: ≥ 90 % of them),
renders the chat template as pretune does, and applies a GGUF LoRA to give the merged model's tokens. SmolLM2 (the
bundled checkpoint) and tiny Llama / Qwen2 / Gemma / GPT-2 models pretrained here for a few steps with a
pretune-trained byte-level BPE tokenizer; tiny Llama / GPT-2 models with a pretune-trained Unigram tokenizer (NFKC,
written as llama.cpp's UGM model with a character map). Run with ``make test-llamacpp`` (marker ``llamacpp``)."""

import pytest
import torch

import pretune
from conftest import corpus_paragraphs
from pretune import peft
from pretune.generation.prompt import apply_chat_template
from pretune.interop.gguf import read_gguf, write_gguf
from pretune.io.tokenization import train_tokenizer
from pretune.model import TransformerLM
from pretune.presets import get_preset

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

NEW = 32  # greedy tokens compared
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"}]
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def _held_out(n: int) -> list[str]:
    """Paragraphs neither tokenizer nor tiny model trained on (Moby Dick and Wikipedia; they train on Austen)."""
    paras = corpus_paragraphs("mobydick.txt.gz", 200)[100:100 + n // 2] + corpus_paragraphs(
        "enwiki_sample.txt.gz", 40)[20:20 + n - n // 2]
    return [p[:600] for p in paras]


def _llama(path, **kw):
    """llama.cpp on a GGUF file; its KV cache in f32 (llama.cpp's default, f16, rounds keys and values to 1e-3)."""
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False, seed=0, type_k=0, type_v=0,
                           **kw)


def _llamacpp_greedy(llm, ids: list[int]) -> list[int]:
    llm.reset()
    out = []
    for t in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(t))
        if len(out) == NEW:
            break
    return out


def _pretune_greedy(model, ids: list[int]) -> list[int]:
    out = pretune.generate(model, torch.tensor([ids]), max_new_tokens=NEW)
    return out[0, len(ids):].tolist()


def _agree(model, prompt: list[int], ours: list[int], theirs: list[int], tol: float) -> bool:
    """llama.cpp's greedy tokens are pretune's: equal up to where pretune stopped (at EOS; llama.cpp's generator goes
    on), or parting at a tie, where pretune's logits for the two tokens differ by less than ``tol`` (either is the
    greedy choice within the arithmetic's rounding: f32 sums in another order, q8_0's rounded weights)."""
    for n, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ours[:n]])).logits[0, -1]
            return bool(abs(logits[a] - logits[b]) < tol)
    return len(theirs) >= len(ours) > 0


F32_TIE = 1e-3  # f32: llama.cpp's logits are pretune's within ~1e-4 (tests below); a tie is closer than that x10
Q8_TIE = 0.05  # q8_0: its logits are pretune's fp32 ones within ~0.02 on these models (measured); x2.5


def _count(model, llm, prompts, ours, tol) -> int:
    """How many prompts llama.cpp decodes to pretune's greedy tokens ``ours`` (ties within ``tol`` allowed)."""
    return sum(_agree(model, p, o, _llamacpp_greedy(llm, p), tol) for p, o in zip(prompts, ours))


def _prompts(tok, n=10) -> list[list[int]]:
    return [tok.encode(p)[:24] for p in _held_out(n)]


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (bundled)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from pretune.realmodels import smollm2_dir

    loaded = pretune.load_pretrained(smollm2_dir())
    d = tmp_path_factory.mktemp("smol")
    files = {t: write_gguf(loaded.model, d / f"smol.{t}.gguf", tokenizer=loaded.tokenizer, type=t)
             for t in ("f32", "q8_0")}
    return loaded, files


def test_smollm2_tokenizes_held_out_text_as_pretune(smol):
    loaded, files = smol
    llm = _llama(files["f32"], vocab_only=True)
    for text in _held_out(20) + ["digits 1234567 and  spaces\n\n\ttabs", "naïve café — “quotes” 😀"]:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == loaded.tokenizer.encode(text), text


@pytest.fixture(scope="module")
def smol_greedy(smol):
    loaded, _ = smol
    prompts = _prompts(loaded.tokenizer)
    return prompts, [_pretune_greedy(loaded.model, p) for p in prompts]


def test_smollm2_greedy_f32_equal(smol, smol_greedy):
    (loaded, files), (prompts, ours) = smol, smol_greedy
    assert _count(loaded.model, _llama(files["f32"]), prompts, ours, F32_TIE) == len(prompts)


@pytest.mark.xfail(strict=True, reason="measured 5 of 10 held-out text prompts: q8_0's rounding itself parts from "
                   "fp32 greedy decoding of SmolLM2 within 32 tokens (pretune's own de-quantised q8_0 model agrees "
                   "with fp32 on 6 of 10), and llama.cpp's 8-bit activations add their own (docs/convert.md, GGUF)")
def test_smollm2_greedy_q8_0_equal_for_90_percent(smol, smol_greedy):
    (loaded, files), (prompts, ours) = smol, smol_greedy
    same = _count(loaded.model, _llama(files["q8_0"]), prompts, ours, Q8_TIE)
    assert same >= 0.9 * len(prompts), f"q8_0: {same} of {len(prompts)} prompts decode to pretune's tokens"


def test_smollm2_chat_template_round_trips(smol):
    loaded, files = smol
    llm = _llama(files["f32"], vocab_only=True)
    template = llm.metadata["tokenizer.chat_template"]
    assert template == loaded.tokenizer.chat_template
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    theirs = Jinja2ChatFormatter(template=template, eos_token="<|im_end|>", bos_token="<|im_start|>")(messages=CHAT)
    assert theirs.prompt == apply_chat_template(loaded.tokenizer, CHAT, add_generation_prompt=True)
    assert read_gguf(files["q8_0"])[1].chat_template == template  # and back into pretune


# ---------------------------------------------------------------------------------------------
# tiny models pretrained here with a pretune-trained byte-level BPE tokenizer
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bpe():
    tok = train_tokenizer(texts=corpus_paragraphs("austen.txt.gz", 400), kind="bpe", vocab_size=512,
                          show_progress=False)
    tok.chat_template = TEMPLATE
    return tok


def _pretrained(cfg, tok, steps=300):
    """A tiny decoder trained for ``steps`` Adam steps on Austen (so greedy decoding is not one repeated token)."""
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    ids = [i for p in corpus_paragraphs("austen.txt.gz", 400) for i in tok.encode(p) + [tok.eos_id]]
    data = torch.tensor(ids[: (len(ids) // 65) * 65]).view(-1, 65)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = data[torch.randint(len(data), (16,), generator=torch.Generator().manual_seed(step))]
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _tiny(family: str, tok):
    base = dict(vocab_size=tok.vocab_size, dim=64, n_heads=4, ffn_dim=128, n_layers=2, max_seq_len=256,
                dropout=0.0, eos_token_id=tok.eos_id)
    llama = get_preset("tiny-llama").replace(**base, n_kv_heads=2, tie_embeddings=False)
    return {"llama": llama, "qwen2": llama.replace(qkv_bias=True),
            "gemma": llama.replace(norm="rmsnorm_plus_one", ffn="geglu_tanh", scale_embeddings=True,
                                   tie_embeddings=True, head_dim=32),
            "gpt2": get_preset("tiny-gpt2").replace(**base, attn_dropout=0.0)}[family]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2"])
def test_tiny_pretrained_tokenizes_and_decodes_as_pretune(family, bpe, tmp_path):
    model = _pretrained(_tiny(family, bpe), bpe)
    f32 = write_gguf(model, tmp_path / "f32.gguf", tokenizer=bpe)
    llm = _llama(f32)
    for text in _held_out(20):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == bpe.encode(text)
    prompts = _prompts(bpe)
    ours = [_pretune_greedy(model, p) for p in prompts]
    assert len({tuple(o) for o in ours}) > 1  # the prompts lead apart: a real comparison
    assert _count(model, llm, prompts, ours, F32_TIE) == len(prompts)
    q8 = _llama(write_gguf(model, tmp_path / "q8.gguf", tokenizer=bpe, type="q8_0"))
    same = _count(model, q8, prompts, ours, Q8_TIE)
    assert same >= 0.9 * len(prompts), f"q8_0: {same} of {len(prompts)} prompts decode to pretune's tokens"
    assert llm.metadata["tokenizer.chat_template"] == TEMPLATE


def test_gguf_lora_applied_by_llamacpp_gives_the_merged_models_tokens(bpe, tmp_path):
    from pretune.cli import main

    model = _pretrained(_tiny("llama", bpe), bpe, steps=30)
    pretune.save(model, tmp_path / "base", tokenizer=bpe)
    peft.inject(model, peft.PeftConfig(method="lora", r=4, alpha=8, targets=["q_proj", "k_proj", "v_proj",
                                                                             "o_proj", "down_proj"]))
    with torch.no_grad():  # a trained-looking adapter: B away from zero, changing what the model says
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    peft.save_adapter(model, tmp_path / "lora", base=str(tmp_path / "base"))
    assert main(["convert", "--to-gguf", str(tmp_path / "base"), "--out", str(tmp_path / "base.gguf")]) == 0
    assert main(["convert", "--to-gguf", str(tmp_path / "lora"), "--out", str(tmp_path / "lora.gguf")]) == 0
    merged = peft.merged_model(model)
    prompts = _prompts(bpe)
    ours = [_pretune_greedy(merged, p) for p in prompts]
    base_only = [_pretune_greedy(pretune.load(tmp_path / "base"), p) for p in prompts]
    assert ours != base_only  # the adapter changes the tokens
    llm = _llama(tmp_path / "base.gguf", lora_path=str(tmp_path / "lora.gguf"), logits_all=True)
    assert all(_agree(merged, p, o, _llamacpp_greedy(llm, p), F32_TIE) for o, p in zip(ours, prompts))
    for p in prompts:  # and the logits themselves: llama.cpp's x A B on the base equals the merged weights' x W
        llm.reset()
        llm.eval(p)
        with torch.no_grad():
            want = merged(torch.tensor([p])).logits[0]
        torch.testing.assert_close(torch.tensor(llm.scores[:len(p)]), want, rtol=0, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# a pretune-trained Unigram tokenizer (NFKC) as llama.cpp's UGM ("t5") model with a character map
# ---------------------------------------------------------------------------------------------
NFKC_TEXTS = ["ﬁne ﬂour, ½ cup… “quoted” — ‘single’ Ｆｕｌｌ－ｗｉｄｔｈ ｶﾀｶﾅ ㍻ ㎏ ™ №",
              "e\u0301 a\u0308 n\u0303 decomposed, é ä ñ composed; Ⅻ ① ⁵ ₂ ℌ 𝐛𝐨𝐥𝐝 ǅ ĳ Å",
              "  tabs\tand\n\nnew\r\nlines \u00a0nbsp\u3000ideographic  and   runs  ",
              "naïve café 😀 한국어 日本語 ΟΔΟΣ"]


@pytest.fixture(scope="module")
def unigram():
    return train_tokenizer(texts=corpus_paragraphs("austen.txt.gz", 400), kind="unigram", vocab_size=512,
                           sentinels=0, show_progress=False)


@pytest.mark.parametrize("lowercase", [False, True])
def test_unigram_tokenizes_held_out_and_nfkc_text_as_pretune(lowercase, unigram, tmp_path):
    tok = unigram if not lowercase else train_tokenizer(
        texts=corpus_paragraphs("austen.txt.gz", 400), kind="unigram", vocab_size=512, sentinels=0, lowercase=True,
        show_progress=False)
    model = TransformerLM(_tiny("llama", tok))
    llm = _llama(write_gguf(model, tmp_path / "u.gguf", tokenizer=tok), vocab_only=True)
    for text in _held_out(20) + NFKC_TEXTS:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text), text
    # the limit docs/convert.md names: NFKC composing a mark with the letter a compatibility character ends in
    # (ﬁ + ◌́ -> fí) is a sequence the character map does not list, so llama.cpp's ids differ there
    assert llm.tokenize("ﬁ\u0301ne".encode(), add_bos=False, special=False) != tok.encode("ﬁ\u0301ne")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tiny_pretrained_with_unigram_tokenizes_and_decodes_as_pretune(family, unigram, tmp_path):
    model = _pretrained(_tiny(family, unigram), unigram)
    llm = _llama(write_gguf(model, tmp_path / "f32.gguf", tokenizer=unigram))
    for text in _held_out(20):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == unigram.encode(text)
    prompts = _prompts(unigram)
    ours = [_pretune_greedy(model, p) for p in prompts]
    assert len({tuple(o) for o in ours}) > 1  # the prompts lead apart: a real comparison
    assert _count(model, llm, prompts, ours, F32_TIE) == len(prompts)
