"""Task heads to and from transformers: *ForSequenceClassification / *ForTokenClassification /
*ForQuestionAnswering of BERT, RoBERTa, GPT-2, Llama, Qwen2, Qwen3, Mistral, Gemma and Gemma 2.

Tiny random-weight HF models built here (nothing is downloaded) -> save_pretrained -> pretune.from_hf
-> the same logits on a right-padded batch; our model -> pretune.to_hf -> transformers' Auto* classes
load it with no missing or unexpected tensors and give the same logits; label maps survive.
"""

import json

import pytest
import torch

import pretune
from pretune import InteropError
from pretune.model import TransformerLM

transformers = pytest.importorskip("transformers")
T = transformers

V = 99
PAD = {"bert": 0, "roberta": 1, "gpt2": 0, "llama": 0, "qwen2": 0, "qwen3": 0, "mistral": 0, "gemma": 0, "gemma2": 0}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TAGS = 5  # tagging heads keep HF's default names (LABEL_0..LABEL_4) -> labels None on our side


def _body(family: str, **kw):
    if family == "bert":
        return T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=37, max_position_embeddings=64, **kw)
    if family == "roberta":
        return T.RobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=37, max_position_embeddings=66, type_vocab_size=1, **kw)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                            eos_token_id=0, pad_token_id=PAD["gpt2"], **kw)
    if family == "qwen2":  # q/k/v biases
        return T.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             pad_token_id=PAD["qwen2"], **kw)
    if family == "qwen3":  # q/k norms, head_dim 12 != 32 / 4
        return T.Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
                             pad_token_id=PAD["qwen3"], **kw)
    if family == "mistral":  # a window of 3 keys on rows of 11
        return T.MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
                               max_position_embeddings=64, pad_token_id=PAD["mistral"], **kw)
    if family == "gemma":
        return T.GemmaConfig(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
                             pad_token_id=PAD["gemma"], **kw)
    if family == "gemma2":  # the task heads do not soft-cap their logits
        return T.Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=12, sliding_window=3,
                              attn_logit_softcapping=2.0, final_logit_softcapping=0.5, max_position_embeddings=64,
                              pad_token_id=PAD["gemma2"], **kw)
    return T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=PAD["llama"], **kw)


# (family, HF class, task kind, config extras)
CASES = {
    "bert-seq": ("bert", "BertForSequenceClassification", "seq", {"id2label": LABELS}),
    "bert-regression": ("bert", "BertForSequenceClassification", "seq",
                        {"num_labels": 1, "problem_type": "regression"}),
    "bert-token": ("bert", "BertForTokenClassification", "token", {"num_labels": TAGS}),
    "bert-qa": ("bert", "BertForQuestionAnswering", "qa", {}),
    "roberta-seq": ("roberta", "RobertaForSequenceClassification", "seq", {"id2label": LABELS}),
    "roberta-token": ("roberta", "RobertaForTokenClassification", "token", {"num_labels": TAGS}),
    "roberta-qa": ("roberta", "RobertaForQuestionAnswering", "qa", {}),
    "gpt2-seq": ("gpt2", "GPT2ForSequenceClassification", "seq", {"id2label": LABELS}),
    "gpt2-regression": ("gpt2", "GPT2ForSequenceClassification", "seq",
                        {"num_labels": 1, "problem_type": "regression"}),
    "gpt2-token": ("gpt2", "GPT2ForTokenClassification", "token", {"num_labels": TAGS}),
    "gpt2-qa": ("gpt2", "GPT2ForQuestionAnswering", "qa", {}),
    "llama-seq": ("llama", "LlamaForSequenceClassification", "seq", {"id2label": LABELS}),
    "llama-token": ("llama", "LlamaForTokenClassification", "token", {"num_labels": TAGS}),
    "llama-qa": ("llama", "LlamaForQuestionAnswering", "qa", {}),
    "qwen2-seq": ("qwen2", "Qwen2ForSequenceClassification", "seq", {"id2label": LABELS}),
    "qwen2-token": ("qwen2", "Qwen2ForTokenClassification", "token", {"num_labels": TAGS}),
    "qwen3-seq": ("qwen3", "Qwen3ForSequenceClassification", "seq", {"id2label": LABELS}),
    "qwen3-qa": ("qwen3", "Qwen3ForQuestionAnswering", "qa", {}),
    "mistral-seq": ("mistral", "MistralForSequenceClassification", "seq", {"id2label": LABELS}),
    "mistral-qa": ("mistral", "MistralForQuestionAnswering", "qa", {}),  # its body under model., not transformer.
    "gemma-seq": ("gemma", "GemmaForSequenceClassification", "seq", {"id2label": LABELS}),
    "gemma-token": ("gemma", "GemmaForTokenClassification", "token", {"num_labels": TAGS}),
    "gemma2-seq": ("gemma2", "Gemma2ForSequenceClassification", "seq", {"id2label": LABELS}),
    "gemma2-token": ("gemma2", "Gemma2ForTokenClassification", "token", {"num_labels": TAGS}),
}
AUTO = {"seq": "AutoModelForSequenceClassification", "token": "AutoModelForTokenClassification",
        "qa": "AutoModelForQuestionAnswering"}
HEAD = {"seq": ("classification", "regression"), "token": ("tagging",), "qa": ("qa",)}


def _randomize(model):
    """HF inits norms to 1/0 and biases to 0: perturb every tensor so each one is tested."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _batch(pad: int):
    """Right-padded batch: real tokens never equal the pad id, padded positions hold it."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    return ids.masked_fill(mask == 0, pad), mask


def _hf_logits(hf, kind, ids, mask):
    out = hf(input_ids=ids, attention_mask=mask)
    if kind == "qa":
        return torch.stack([out.start_logits, out.end_logits], dim=-1)
    return out.logits


def _assert_same(ours, theirs, kind, mask):
    assert ours.shape == theirs.shape
    if kind == "seq":
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    else:  # per-token outputs: padded positions are don't-cares
        keep = mask.bool()
        torch.testing.assert_close(ours[keep], theirs[keep], atol=1e-5, rtol=1e-5)


def _hf_model(case):
    family, cls, kind, extra = CASES[case]
    torch.manual_seed(0)
    return family, kind, _randomize(getattr(T, cls)(_body(family, **extra))).eval()


@pytest.fixture(params=list(CASES))
def hf_folder(request, tmp_path):
    family, kind, hf = _hf_model(request.param)
    hf.save_pretrained(tmp_path / "hf")
    return family, kind, hf, tmp_path / "hf"


def test_from_hf_task_head_logits_match(hf_folder):
    family, kind, hf, path = hf_folder
    ours = pretune.from_hf(path)
    assert ours.config.head in HEAD[kind]
    ids, mask = _batch(PAD[family])
    with torch.no_grad():
        _assert_same(ours(ids, attention_mask=mask).logits, _hf_logits(hf, kind, ids, mask), kind, mask)


def test_to_hf_task_head_loads_cleanly_with_same_logits_and_labels(hf_folder, tmp_path):
    family, kind, hf, path = hf_folder
    ours = pretune.from_hf(path)
    with torch.no_grad():  # make our weights differ from the source so the export is really tested
        for p in ours.parameters():
            p.add_(0.01)
    pretune.to_hf(ours, tmp_path / "exported")
    back, info = getattr(T, AUTO[kind]).from_pretrained(tmp_path / "exported", output_loading_info=True)
    assert type(back) is type(hf)  # the Auto* class resolves to the same task class
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert back.config.id2label == hf.config.id2label
    assert back.config.num_labels == hf.config.num_labels
    if kind == "seq":
        want = "regression" if ours.config.head == "regression" else "single_label_classification"
        assert back.config.problem_type == want
    ids, mask = _batch(PAD[family])
    with torch.no_grad():
        _assert_same(ours(ids, attention_mask=mask).logits, _hf_logits(back.eval(), kind, ids, mask), kind, mask)
    again = pretune.from_hf(tmp_path / "exported")  # and back: the same config and tensors
    assert again.config == ours.config
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_our_classification_head_on_imported_bert_matches_bert_for_sequence_classification(tmp_path):
    """Acceptance: a classification head put on an imported BERT gives the same logits as
    transformers.BertForSequenceClassification with the same weights."""
    torch.manual_seed(0)
    body = _randomize(T.BertModel(_body("bert"))).eval()  # a pretrained body with its pooler
    body.save_pretrained(tmp_path / "bert")
    imported = pretune.from_hf(tmp_path / "bert")
    assert imported.config.pooler
    cfg = imported.config.replace(head="classification", num_labels=3, labels=list(LABELS.values()))
    ours = TransformerLM(cfg).eval()
    missing, unexpected = ours.load_state_dict(imported.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == ["head.out.bias", "head.out.weight"]
    hf = T.BertForSequenceClassification.from_pretrained(tmp_path / "bert", id2label=LABELS).eval()
    with torch.no_grad():
        hf.classifier.weight.copy_(ours.head.out.weight)
        hf.classifier.bias.copy_(ours.head.out.bias)
    ids, mask = _batch(PAD["bert"])
    types = torch.zeros_like(ids)
    types[:, 5:] = 1  # a sentence pair
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        torch.testing.assert_close(ours(ids, mask, types).logits, theirs, atol=1e-5, rtol=1e-5)
    # and the export of that model is a BertForSequenceClassification with those labels and logits
    pretune.to_hf(ours, tmp_path / "exported")
    back = T.AutoModelForSequenceClassification.from_pretrained(tmp_path / "exported").eval()
    assert type(back) is T.BertForSequenceClassification and back.config.id2label == LABELS
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids, attention_mask=mask, token_type_ids=types).logits, theirs,
                                   atol=1e-5, rtol=1e-5)


def test_imported_labels_and_regression(tmp_path):
    for case, head, labels in (("bert-seq", "classification", list(LABELS.values())),
                               ("bert-regression", "regression", None), ("bert-token", "tagging", None),
                               ("roberta-seq", "classification", list(LABELS.values())), ("gpt2-qa", "qa", None)):
        _, _, hf = _hf_model(case)
        hf.save_pretrained(tmp_path / case)
        cfg = pretune.from_hf(tmp_path / case).config
        assert (cfg.head, cfg.labels, cfg.num_labels) == (head, labels, hf.config.num_labels), case
    assert pretune.from_hf(tmp_path / "roberta-seq").config.sentence_pooling == "cls"
    assert pretune.from_hf(tmp_path / "bert-seq").config.sentence_pooling == "pooler"


def test_gpt2_export_sets_pad_token_id_for_last_token_pooling(tmp_path):
    model = pretune.build_model("tiny-gpt2", head="classification", num_labels=2, pad_token_id=7).eval()
    pretune.to_hf(model, tmp_path / "hf")
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["GPT2ForSequenceClassification"] and hf_cfg["pad_token_id"] == 7
    hf = T.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    ids, mask = _batch(7)
    ids = ids % model.config.vocab_size
    ids = torch.where(ids == 7, 8, ids).masked_fill(mask == 0, 7)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, theirs, atol=1e-5, rtol=1e-5)


def test_tagging_export_of_a_bert_with_pooler_leaves_the_pooler_out(tmp_path):
    torch.manual_seed(0)
    T.BertModel(_body("bert")).save_pretrained(tmp_path / "bert")
    imported = pretune.from_hf(tmp_path / "bert")
    model = TransformerLM(imported.config.replace(head="tagging", num_labels=4)).eval()
    model.load_state_dict(imported.state_dict(), strict=False)
    pretune.to_hf(model, tmp_path / "hf")
    hf, info = T.AutoModelForTokenClassification.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(hf) is T.BertForTokenClassification
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, mask = _batch(0)
    with torch.no_grad():
        _assert_same(model(ids, attention_mask=mask).logits, hf.eval()(input_ids=ids, attention_mask=mask).logits,
                     "token", mask)


def test_convert_cli_with_a_task_head(tmp_path):
    from pretune.cli import main

    _, _, hf = _hf_model("roberta-seq")
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]) == 0
    back = T.AutoModelForSequenceClassification.from_pretrained(tmp_path / "back").eval()
    ids, mask = _batch(PAD["roberta"])
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids, attention_mask=mask).logits,
                                   hf(input_ids=ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# configs with no HF equivalent are refused, saying why
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,overrides,match", [
    ("tiny-bert-base", {"head": "classification", "num_labels": 3, "pooler": False, "pooling": "cls"},
     r"BertForSequenceClassification classifies the BERT pooler output.*got pooling='cls'"),
    ("tiny-bert-base", {"head": "classification", "num_labels": 3, "pooler": True, "pooling": "mean"},
     r"BertForSequenceClassification classifies the BERT pooler output.*got pooling='mean'"),
    ("tiny-roberta-base", {"token_types": 1, "head": "regression", "num_labels": 1, "pooler": True},
     r"RobertaForSequenceClassification classifies dense \+ tanh on the first token.*got pooling='pooler'"),
    ("tiny-gpt2", {"head": "classification", "num_labels": 3, "pooling": "mean"},
     r"GPT2ForSequenceClassification classifies the last real token.*got pooling='mean'"),
    ("tiny-llama", {"head": "classification", "num_labels": 1},
     r"LlamaForSequenceClassification reads num_labels=1 as regression"),
    ("tiny-t5-small", {"head": "classification", "num_labels": 3},
     r"t5: head='classification' has no Hugging Face T5 class"),
    ("tiny-t5-small", {"decoder_heads": 2}, r"t5: needs decoder_heads=None, got 2"),  # one num_heads, one d_ff
    ("tiny-t5-small", {"decoder_ffn_dim": 96}, r"t5: needs decoder_ffn_dim=None, got 96"),
])
def test_export_without_hf_equivalent_says_why(preset, overrides, match, tmp_path):
    model = pretune.build_model(preset, **overrides)
    with pytest.raises(InteropError, match=match):
        pretune.to_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_task_imports_say_why(tmp_path):
    _, _, hf = _hf_model("bert-seq")
    hf.save_pretrained(tmp_path / "hf")
    _edit_config(tmp_path / "hf", problem_type="multi_label_classification")
    assert pretune.from_hf(tmp_path / "hf").config.multi_label  # no longer refused (tests/tasks/test_multilabel.py)
    _edit_config(tmp_path / "hf", problem_type=None, architectures=["BertForMultipleChoice"])
    with pytest.raises(InteropError, match="'BertForMultipleChoice' is not supported.*BertForQuestionAnswering"):
        pretune.from_hf(tmp_path / "hf")
    t5 = T.T5ForSequenceClassification(T.T5Config(vocab_size=V, d_model=16, d_kv=4, d_ff=20, num_layers=1,
                                                  num_heads=4, relative_attention_num_buckets=8))
    t5.save_pretrained(tmp_path / "t5")
    with pytest.raises(InteropError, match="'T5ForSequenceClassification' is not supported"):
        pretune.from_hf(tmp_path / "t5")


def test_folder_without_architectures_is_read_from_its_head_tensors(tmp_path):
    for case in ("bert-seq", "bert-token", "roberta-seq", "gpt2-seq", "llama-token", "llama-qa"):
        family, kind, hf = _hf_model(case)
        hf.save_pretrained(tmp_path / case)
        _edit_config(tmp_path / case, architectures=None)
        ours = pretune.from_hf(tmp_path / case)
        ids, mask = _batch(PAD[family])
        with torch.no_grad():
            _assert_same(ours(ids, attention_mask=mask).logits, _hf_logits(hf, kind, ids, mask), kind, mask)
