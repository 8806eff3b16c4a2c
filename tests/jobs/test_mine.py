"""pretune.jobs.mine: hard negatives picked from a ranking known by construction (texts embedded as unit vectors at
chosen angles), and against a brute-force numpy reference on random vectors for every setting; the files' checks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pretune.config import ConfigError
from pretune.data.readers import DataError
from pretune.jobs import mine as mine_mod
from pretune.jobs.mine import MineSettings, mine_negatives, read_corpus, read_pairs_for_mining

# texts on the unit circle: cosine of two texts = cos(angle difference); the lengths vary, which cosine ignores
ANGLES = {"q1": 0, "p1": 10, "x": 5, "y": 20, "z": 40, "w": 90, "v": 180,
          "q2": 200, "p2a": 205, "p2b": 230, "u": 210}
LENGTHS = {t: 1 + 0.5 * k for k, t in enumerate(ANGLES)}


def fake_embed(texts):
    return np.array([[LENGTHS[t] * math.cos(math.radians(ANGLES[t])), LENGTHS[t] * math.sin(math.radians(ANGLES[t]))]
                     for t in texts])


# q2 has two positives (two records); "q2" is also an extra corpus text, so it must never be its own negative
ANCHORS, POSITIVES = ["q1", "q2", "q2"], ["p1", "p2a", "p2b"]
EXTRA = ["x", "y", "z", "w", "v", "u", "q2"]


def run(**settings):
    return mine_negatives(ANCHORS, POSITIVES, fake_embed, corpus=EXTRA, settings=MineSettings(**settings))


def test_top_ranks_by_construction():
    q1, q2a, q2b = run()
    # q1 at 0 deg: x (5), y (20), z (40) are the closest texts that are not its positive p1 (10)
    assert q1.negatives == ["x", "y", "z"]
    np.testing.assert_allclose(q1.scores, np.cos(np.radians([5, 20, 40])), atol=1e-6)
    assert q1.positive_score == pytest.approx(math.cos(math.radians(10)), abs=1e-6)
    # q2 at 200 deg: u (210), v (180), w (90) -- never p2a/p2b (its positives) nor the corpus text "q2" itself
    assert q2a.negatives == q2b.negatives == ["u", "v", "w"]
    assert q2a.positive_score == pytest.approx(math.cos(math.radians(5)), abs=1e-6)
    assert q2b.positive_score == pytest.approx(math.cos(math.radians(30)), abs=1e-6)


def test_range_margins_and_scores_by_construction():
    assert run(range_min=1)[0].negatives == ["y", "z", "w"]  # x (rank 1) skipped
    assert run(range_min=1, range_max=3, num_negatives=2)[0].negatives == ["y", "z"]
    assert run(range_min=3, range_max=4, num_negatives=1)[0].negatives == ["w"]
    # margin 0: no negative closer than the positive (x at 5 deg beats p1 at 10 deg)
    assert run(margin=0.0)[0].negatives == ["y", "z", "w"]
    # margin 0.1: below cos(10) - 0.1 = 0.885: y (cos 20 = 0.940) goes too; next after w (90) is p2b (230)
    assert run(margin=0.1)[0].negatives == ["z", "w", "p2b"]
    # the margin reads each record's own positive: q2's p2a is 5 deg away, p2b 30 deg, so for p2b u (10 deg) and
    # v (20 deg) are too close; after w (110 deg) come z (160) and x (165)
    q2a, q2b = run(margin=0.0)[1:]
    assert q2a.negatives == ["u", "v", "w"] and q2b.negatives == ["w", "z", "x"]
    # relative: cos(a,n) <= cos(a,p) (1 - 0.05) = 0.936 for q1: y (0.940) goes
    rel = run(relative_margin=0.05)[0]
    assert rel.negatives == ["z", "w", "p2b"] and all(s <= math.cos(math.radians(10)) * 0.95 for s in rel.scores)
    assert run(max_score=0.9)[0].negatives == ["z", "w", "p2b"]
    assert run(max_score=0.9, min_score=0.5)[0].negatives == ["z"]


def _reference(anchors, positives, corpus, vectors, s: MineSettings, existing=None):
    """Brute force: every candidate scored, sorted by (-cosine, corpus position), filtered one by one."""
    docs = list(dict.fromkeys([*positives, *corpus]))
    unit = {t: v / np.linalg.norm(v) for t, v in vectors.items()}
    out = []
    for i, (a, p) in enumerate(zip(anchors, positives)):
        own = {positives[j] for j in range(len(anchors)) if anchors[j] == a} | {a}
        cand = sorted(((-float(unit[a] @ unit[d]), k, d) for k, d in enumerate(docs) if d not in own))
        ps = float(unit[a] @ unit[p])
        kept = []
        for rank, (neg_s, _, d) in enumerate(cand, start=1):
            sc = -neg_s
            if rank <= s.range_min or (s.range_max is not None and rank > s.range_max):
                continue
            if ((s.margin is not None and sc > ps - s.margin)
                    or (s.relative_margin is not None and sc > ps - abs(ps) * s.relative_margin)
                    or (s.max_score is not None and sc > s.max_score) or (s.min_score is not None and sc < s.min_score)
                    or (existing is not None and d in existing[i])):
                continue
            kept.append(d)
        out.append(kept)
    return out


SETTINGS = [dict(), dict(range_min=5), dict(range_min=3, range_max=40, num_negatives=7), dict(margin=0.0),
            dict(margin=0.05, range_min=2, num_negatives=5), dict(relative_margin=0.1),
            dict(max_score=0.3, min_score=-0.2, num_negatives=4), dict(margin=-0.1, max_score=0.5, min_score=0.45)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_top_equals_brute_force(settings, monkeypatch):
    """Random 8-d texts, 40 pairs over 25 anchors (repeats), 150 more corpus texts; ranks looked at a few at a time
    (_FIRST_LOOK 2, _SEARCH_ROWS 7), so the deeper look and the chunking are exercised."""
    monkeypatch.setattr(mine_mod, "_FIRST_LOOK", 2)
    monkeypatch.setattr(mine_mod, "_SEARCH_ROWS", 7)
    rng = np.random.default_rng(0)
    anchors = [f"a{rng.integers(25)}" for _ in range(40)]
    positives = [f"p{k}" for k in rng.integers(0, 35, size=40)]
    corpus = [f"c{k}" for k in range(150)] + ["a3", "p2"]  # an anchor and a positive among the extra texts too
    vectors = {t: rng.normal(size=8) for t in {*anchors, *positives, *corpus}}
    existing = [[f"c{rng.integers(150)}"] if k % 3 == 0 else [] for k in range(40)]
    embed = lambda texts: np.stack([vectors[t] for t in texts])  # noqa: E731
    s = MineSettings(**settings)
    got = mine_negatives(anchors, positives, embed, corpus=corpus, settings=s, existing=existing)
    want = _reference(anchors, positives, corpus, vectors, s, existing)
    for g, w, a, e in zip(got, want, anchors, existing):
        assert g.negatives == w[: s.num_negatives]
        own = {p for aa, p in zip(anchors, positives) if aa == a}
        assert not own & set(g.negatives) and a not in g.negatives and not set(e) & set(g.negatives)
    assert sum(len(g.negatives) for g in got) > 0


def test_random_sampling_draws_from_the_kept_candidates(monkeypatch):
    rng = np.random.default_rng(1)
    anchors = [f"a{k % 10}" for k in range(20)]
    positives = [f"p{k}" for k in range(20)]
    corpus = [f"c{k}" for k in range(60)]
    vectors = {t: rng.normal(size=6) for t in {*anchors, *positives, *corpus}}
    embed = lambda texts: np.stack([vectors[t] for t in texts])  # noqa: E731
    s = MineSettings(sampling="random", num_negatives=4, range_min=2, range_max=30, margin=0.0, seed=3)
    got = mine_negatives(anchors, positives, embed, corpus=corpus, settings=s)
    want = _reference(anchors, positives, corpus, vectors, s)
    for g, w in zip(got, want):
        assert set(g.negatives) <= set(w) and len(g.negatives) == min(4, len(w))
        assert g.negatives == [d for d in w if d in g.negatives]  # written in rank order
    assert any(g.negatives != w[:4] for g, w in zip(got, want))  # not simply the top
    monkeypatch.setattr(mine_mod, "_SEARCH_ROWS", 3)  # the draw is per record, not per block of anchors
    assert [g.negatives for g in mine_negatives(anchors, positives, embed, corpus=corpus, settings=s)] == \
        [g.negatives for g in got]
    other = mine_negatives(anchors, positives, embed, corpus=corpus, settings=MineSettings(**{**s.__dict__, "seed": 4}))
    assert [g.negatives for g in other] != [g.negatives for g in got]


@pytest.mark.parametrize("settings,message", [
    (dict(num_negatives=0), "--num-negatives"),
    (dict(range_min=-1), "--range-min"),
    (dict(range_min=5, range_max=6, num_negatives=3), "leaves 1 ranks after range_min 5"),
    (dict(relative_margin=1.5), "--relative-margin"),
    (dict(margin=float("nan")), "--margin"),
    (dict(min_score=0.8, max_score=0.2), "min_score 0.8 is above max_score 0.2"),
])
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ConfigError, match=message):
        MineSettings(**settings).validate()


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("rows,message", [
    ([{"anchor": "a", "positive": "b"}, {"anchor": "c"}], r"pairs.jsonl:2: record has no field 'positive'.*"
     r"--positive-field"),
    ([{"anchor": "", "positive": "b"}], "pairs.jsonl:1: field 'anchor' is empty"),
    ([{"anchor": "a", "positive": 3}], "pairs.jsonl:1: field 'positive' is int"),
    ([{"anchor": "a", "positive": "b", "negative": [""]}], "pairs.jsonl:1: field 'negative' already holds"),
    (["{not json"], "pairs.jsonl:1"),
])
def test_bad_pairs_name_file_line_and_field(tmp_path, rows, message):
    with pytest.raises(DataError, match=message):
        read_pairs_for_mining(_write(tmp_path / "pairs.jsonl", rows))


def test_pairs_and_corpus_are_read(tmp_path):
    pairs = read_pairs_for_mining(_write(tmp_path / "p.jsonl", [{"q": "a", "d": "b", "id": 7, "neg": "n"},
                                                                {"q": "c", "d": "e"}]),
                                  anchor_field="q", positive_field="d", negative_field="neg")
    assert pairs.anchors == ["a", "c"] and pairs.positives == ["b", "e"] and pairs.existing == [["n"], []]
    assert pairs.wheres == [f"{tmp_path / 'p.jsonl'}:1", f"{tmp_path / 'p.jsonl'}:2"] and pairs.records[0]["id"] == 7
    (tmp_path / "c.txt").write_text("one\n\ntwo\n")
    assert read_corpus(tmp_path / "c.txt") == ["one", "two"]
    with pytest.raises(DataError, match="c.jsonl:2: field 'body' is empty"):
        read_corpus(_write(tmp_path / "c.jsonl", [{"body": "x"}, {"body": " "}]), field="body")
