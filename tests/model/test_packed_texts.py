"""``Layout.packed_hidden_states``: right-padded texts laid end to end in fewer rows give every state the padded rows
give (within 1e-5), for every family and position scheme, forward and backward; the padding reads zeros; the rows are
a first-fit packing; it falls back to the padded rows where packing cannot apply or saves nothing."""

from __future__ import annotations

import pytest
import torch

from pretune import ModelConfig, build_model
from pretune.model.layout import layout_of, pack_texts

V = 100
ATOL, RTOL = 1e-5, 1e-4
POSITIONS = ("none", "sinusoidal", "learned", "relative", "alibi", "rope", "disentangled")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(arch: str, position: str) -> torch.nn.Module:
    cfg = ModelConfig(arch=arch, vocab_size=V, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64,
                      dropout=0.0, attn_dropout=0.0, head="none", position=position)
    torch.manual_seed(0)
    model = build_model(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(lengths)
    ids = torch.randint(1, V, (len(lengths), T), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask  # padding id 0


LENGTHS = [20, 3, 4, 2, 5, 3, 6, 2, 4, 3]  # one long text and many short ones: packing pays


def _spy(layout) -> list[tuple]:
    """Record the (rows, width) and whether document_ids were given of every hidden_states call of ``layout``."""
    calls = []
    inner = layout.hidden_states

    def hidden_states(model, ids, mask, **kw):
        calls.append((tuple(ids.shape), kw.get("document_ids") is not None))
        return inner(model, ids, mask, **kw)

    layout.hidden_states = hidden_states
    return calls


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
def test_packed_states_equal_the_padded_rows(arch, position):
    model = _model(arch, position)
    layout = layout_of(model.config)
    ids, mask = _batch(LENGTHS)
    want = layout.hidden_states(model, ids, mask)
    calls = _spy(layout)
    got = layout.packed_hidden_states(model, ids, mask)
    [(shape, packed)] = calls
    assert packed and shape[0] * shape[1] < ids.numel()  # the texts went through fewer positions
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=RTOL)
    assert got.shape == want.shape and not got[~real].any()  # padding reads zeros


def test_gradients_through_the_packed_rows_equal_the_padded_ones():
    model = _model("encoder", "learned").train()  # dropout 0: the same maths in training
    layout = layout_of(model.config)
    ids, mask = _batch(LENGTHS)
    w = torch.randn(32, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (layout.hidden_states, layout.packed_hidden_states):
        model.zero_grad()
        ((fn(model, ids, mask) * w).sum(-1) * mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=ATOL, rtol=RTOL, msg=n)


def test_pack_texts_is_a_first_fit_of_the_longest_first():
    lengths = [5, 9, 2, 7, 3, 1, 4]
    rows = pack_texts(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))  # every text once
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert rows == [[1, 5], [3, 4], [0, 6], [2]]  # 9 (+1), 7 (+3), 5 (+4), then 2 fits nowhere left
    assert pack_texts([4, 4], 4) == [[0], [1]]


def test_the_padded_rows_are_read_where_packing_cannot_apply_or_saves_nothing():
    model = _model("encoder", "learned")
    layout = layout_of(model.config)
    calls = _spy(layout)
    ids, mask = _batch([6, 6, 5, 6])  # nearly full rows: nothing to save
    layout.packed_hidden_states(model, ids, mask)
    ids, mask = _batch(LENGTHS)
    left = mask.flip(1)  # left padding: not the layout packing reads
    layout.packed_hidden_states(model, ids.flip(1), left)
    assert calls == [((4, 6), False), ((10, 20), False)]


def test_adapters_routed_per_row_keep_the_padded_rows():
    """Under ``pretune.peft.route`` each row has its own adapter: packing would move texts under another's."""
    from pretune import peft

    model = _model("encoder", "learned")
    peft.inject(model, peft.PeftConfig(method="lora", r=2, alpha=4, dropout=0.0, targets=["q_proj"]), name="a")
    layout = layout_of(model.config)
    calls = _spy(layout)
    ids, mask = _batch(LENGTHS)
    with peft.route(model, ["a"] + [None] * (len(LENGTHS) - 1)):
        layout.packed_hidden_states(model, ids, mask)
    layout.packed_hidden_states(model, ids, mask)  # no routing: packed
    assert calls == [((10, 20), False), (calls[1][0], True)]
