"""Regenerate ``src/pretune/bundled/`` from the shared real data (maintainers only; not installed).

    python scripts/bundle_data.py [--shared ../shared/data] [--wordnet /usr/share/wordnet]

Copies compact, deterministic subsets of the real corpus and task files, and derives the samples
for the tasks that have no real data here (tagging, QA, regression, seq2seq) from that same real
text by the rules stated in ``src/pretune/bundled/README.md``. Running it twice gives identical
files (fixed seeds, sorted inputs, gzip without timestamps).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "pretune" / "bundled"


# ------------------------------------------------------------------------------------------------ helpers
def read_gz_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def write_gz_text(path: Path, text: str) -> None:
    """gzip with mtime 0 and no file name in the header, so the bytes depend on the text only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as g:
        g.write(text.encode("utf-8"))
    path.write_bytes(buf.getvalue())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def between(lines: list[str], start: str, stop: str | None) -> list[str]:
    """Lines from the first that starts with ``start`` up to (not including) the next that starts with ``stop``."""
    i = next(n for n, line in enumerate(lines) if line.startswith(start))
    j = next((n for n, line in enumerate(lines[i + 1:], i + 1) if stop and line.startswith(stop)), len(lines))
    return lines[i:j]


# ------------------------------------------------------------------------------------------------- corpus
def bundle_corpus(shared: Path) -> None:
    corpus = shared / "corpus"
    austen = read_gz_lines(corpus / "austen.txt.gz")
    emma = between(austen, "EMMA", "MANSFIELD PARK")
    pride = between(austen, "PRIDE AND PREJUDICE", "SENSE AND SENSIBILITY")
    write_gz_text(OUT / "corpus" / "austen_emma_pride.txt.gz", "\n".join(emma + pride) + "\n")
    bible = read_gz_lines(corpus / "web_bible.txt.gz")
    gospels = between(bible, "The book of the genealogy of Jesus Christ", "The first book I wrote")
    write_gz_text(OUT / "corpus" / "web_bible_gospels.txt.gz", "\n".join(gospels) + "\n")
    moby = read_gz_lines(corpus / "mobydick.txt.gz")
    chapters = between(moby, "CHAPTER 1. Loomings.", "CHAPTER 21.")  # the text only: no Gutenberg header
    write_gz_text(OUT / "corpus" / "mobydick_ch1-20.txt.gz", "\n".join(chapters) + "\n")
    (OUT / "corpus" / "enwiki_sample.txt.gz").write_bytes((corpus / "enwiki_sample.txt.gz").read_bytes())


# -------------------------------------------------------------------------------------------- real tasks
def bundle_real_tasks(shared: Path) -> None:
    tasks = shared / "tasks"
    (OUT / "tasks" / "sms_spam").mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev", "test"):  # sms_spam: whole
        src = tasks / "sms_spam" / f"{split}.jsonl"
        (OUT / "tasks" / "sms_spam" / f"{split}.jsonl").write_bytes(src.read_bytes())
    sizes = {"train": 2000, "dev": 250, "test": 250}
    for name in ("wordnet_defines", "wordnet_supersense"):  # the first records of each split (already shuffled)
        for split, n in sizes.items():
            write_jsonl(OUT / "tasks" / name / f"{split}.jsonl", read_jsonl(tasks / name / f"{split}.jsonl")[:n])


# ------------------------------------------------------------------------------------------ derived tasks
_SENT_END = re.compile(r"(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?<!\bSt\.)(?<=[.!?])\s+")
_WORD = re.compile(r"Mrs?\.|Dr\.|St\.|'s\b|[A-Za-z]+(?:'(?!s\b)[a-z]+)?|\d+|-+|[^\sA-Za-z\d]")  # CoNLL-like words

# Names in *Emma* and *Pride and Prejudice* (titles such as Mr./Miss stay outside the entity, as in CoNLL-2003).
PERSONS = """Emma Woodhouse|Emma|Woodhouse|Isabella|John Knightley|George Knightley|Knightley|Weston|Anne Taylor|Taylor|
Harriet Smith|Harriet|Smith|Elton|Augusta|Hawkins|Frank Churchill|Frank|Churchill|Jane Fairfax|Fairfax|Bates|Hetty|
Robert Martin|Martin|Goddard|Perry|Campbell|Dixon|Cole|Otway|Patty|Serle|James|Elizabeth Bennet|Elizabeth|Lizzy|Eliza|
Bennet|Jane|Lydia|Kitty|Catherine|Mary|Fitzwilliam Darcy|Darcy|Georgiana|Charles Bingley|Bingley|Caroline|Louisa|
Hurst|Wickham|George Wickham|William Collins|Collins|Charlotte Lucas|Charlotte|Lucas|William Lucas|Maria|
Catherine de Bourgh|de Bourgh|Anne|Fitzwilliam|Gardiner|Phillips|Forster|Denny|Jenkinson|Reynolds|Younge"""
PLACES = """Highbury|Hartfield|Randalls|Donwell Abbey|Donwell|Abbey Mill Farm|Box Hill|Enscombe|Maple Grove|Richmond|
Surrey|Yorkshire|Ireland|Kingston|Brunswick Square|Weymouth|Bath|Bristol|Southend|Cromer|London|Longbourn|Netherfield|
Pemberley|Rosings|Hunsford|Meryton|Brighton|Derbyshire|Hertfordshire|Kent|Lambton|Gracechurch Street|Scotland|
Gretna Green|Newcastle|Epsom|Barnet|Oxford|Cambridge|Ramsgate|Clapham|Matlock|Chatsworth|Dovedale|Birmingham|England"""


def _gazetteer() -> list[tuple[list[str], str]]:
    entries = [(name.strip().split(), "PER") for name in PERSONS.replace("\n", "").split("|")]
    entries += [(name.strip().split(), "LOC") for name in PLACES.replace("\n", "").split("|")]
    return sorted(entries, key=lambda e: -len(e[0]))  # longest match first


def bio_tags(words: list[str], gazetteer) -> list[str]:
    tags = ["O"] * len(words)
    i = 0
    while i < len(words):
        for name, kind in gazetteer:
            if words[i:i + len(name)] == name and (i == 0 or words[i - 1] != "the" or kind == "LOC"):
                tags[i:i + len(name)] = [f"B-{kind}"] + [f"I-{kind}"] * (len(name) - 1)
                i += len(name) - 1
                break
        i += 1
    return tags


def austen_sentences(shared: Path) -> list[str]:
    text = "\n".join(read_gz_lines(OUT / "corpus" / "austen_emma_pride.txt.gz"))
    out = []
    for para in re.split(r"\n\s*\n", text):
        for s in _SENT_END.split(" ".join(para.split()).replace("_", "")):
            if 5 <= len(s.split()) <= 40 and not s.isupper():
                out.append(s)
    return out


def split3(records: list, n_train: int, n_dev: int, n_test: int) -> dict[str, list]:
    assert len(records) >= n_train + n_dev + n_test, f"only {len(records)} records"
    return {"train": records[:n_train], "dev": records[n_train:n_train + n_dev],
            "test": records[n_train + n_dev:n_train + n_dev + n_test]}


def derive_tagging(sentences: list[str]) -> None:
    gaz = _gazetteer()
    with_ent, without = [], []
    for s in sentences:
        words = _WORD.findall(s)
        tags = bio_tags(words, gaz)
        (with_ent if any(t != "O" for t in tags) else without).append({"tokens": words, "tags": tags})
    rng = random.Random(0)
    rng.shuffle(with_ent)
    rng.shuffle(without)
    records = with_ent[:700] + without[:100]
    rng.shuffle(records)
    for split, recs in split3(records, 600, 100, 100).items():
        write_jsonl(OUT / "tasks" / "austen_ner" / f"{split}.jsonl", recs)


def _gloss(text: str) -> str:
    """A WordNet gloss without its usage examples ('...; "an example"')."""
    return text.split('; "')[0].split(' "')[0].strip().rstrip(";")


def _definitions(shared: Path, split: str) -> list[tuple[str, str]]:
    """(word, gloss) of the positive pairs of a wordnet_defines split, each word once, glosses of 3-14 words."""
    seen, out = set(), []
    for r in read_jsonl(shared / "tasks" / "wordnet_defines" / f"{split}.jsonl"):
        word, gloss = r["text_a"], _gloss(r["text_b"])
        if r["label"] == "defines" and word not in seen and 3 <= len(gloss.split()) <= 14:
            seen.add(word)
            out.append((word, gloss))
    return out


def derive_qa(shared: Path) -> None:
    """A few dictionary entries as the context; "What does W mean?" answered by W's gloss, or unanswerable."""
    sizes = {"train": 500, "dev": 100, "test": 100}
    for split, n in sizes.items():
        rng = random.Random(f"qa-{split}")
        defs = _definitions(shared, split)
        records = []
        for _ in range(n):
            entries = rng.sample(defs, rng.randint(3, 6))
            context = " ".join(f"{w[:1].upper() + w[1:]}: {g}." for w, g in entries)
            if rng.random() < 0.8:
                word, gloss = rng.choice(entries)
                start = context.index(f"{word[:1].upper() + word[1:]}: {gloss}.") + len(word) + 2
                answers = {"text": [gloss], "answer_start": [start]}
            else:  # SQuAD 2.0: a word that is not in the context
                word = rng.choice([w for w, _ in defs if w not in {e[0] for e in entries}])
                answers = {"text": [], "answer_start": []}
            records.append({"context": context, "question": f"What does \"{word}\" mean?", "answers": answers})
        write_jsonl(OUT / "tasks" / "wordnet_qa" / f"{split}.jsonl", records)


def derive_reverse_dictionary(shared: Path) -> None:
    """gloss -> word: a real seq2seq task (a reverse dictionary) from the wordnet_defines positives."""
    sizes = {"train": 1500, "dev": 200, "test": 200}
    for split, n in sizes.items():
        defs = _definitions(shared, split)[:n]
        write_jsonl(OUT / "tasks" / "wordnet_reverse_dictionary" / f"{split}.jsonl",
                    [{"source": g, "target": w} for w, g in defs])


def derive_regression(sentences: list[str]) -> None:
    """Sentence pairs scored 0-5 by how much of text_a survives in text_b (STS-B's scale): text_b is text_a with
    a random share of its words replaced by words of another sentence; label = 5 x the share kept."""
    rng = random.Random(0)
    pool = [s for s in sentences if 6 <= len(s.split()) <= 25]
    rng.shuffle(pool)
    records = []
    for a in pool[:1000]:
        words = a.split()
        other = rng.choice(pool).split()
        keep = rng.random()
        n_keep = round(keep * len(words))
        kept = set(rng.sample(range(len(words)), n_keep))
        b = " ".join(w if i in kept else rng.choice(other) for i, w in enumerate(words))
        records.append({"text_a": a, "text_b": b, "label": round(5 * n_keep / len(words), 3)})
    for split, recs in split3(records, 800, 100, 100).items():
        write_jsonl(OUT / "tasks" / "austen_edit_similarity" / f"{split}.jsonl", recs)


def bundle_wordnet_pos(wordnet: Path) -> None:
    """Multi-label: every part of speech a word form has in WordNet 3.0 (its index.{noun,verb,adj,adv} files, as
    Debian's wordnet-base installs them in /usr/share/wordnet), for the single-word, lower-case lemmas of at least
    three letters that SemCor tags at least once (a common English word); shuffled with seed 0, split 80/10/10."""
    import collections

    labels: dict[str, set[str]] = collections.defaultdict(set)
    tagged: collections.Counter = collections.Counter()
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (wordnet / f"index.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith(" "):  # the licence header
                continue
            f = line.split()
            lemma, n_pointers = f[0], int(f[3])
            tagsense_cnt = int(f[4 + n_pointers + 1])  # after the pointer symbols: sense_cnt, tagsense_cnt
            if re.fullmatch(r"[a-z]{3,}", lemma):
                labels[lemma].add(pos)
                tagged[lemma] += tagsense_cnt
    order = ("noun", "verb", "adj", "adv")
    records = [{"text": w, "label": [p for p in order if p in labels[w]]} for w in sorted(labels) if tagged[w] > 0]
    random.Random(0).shuffle(records)
    n = len(records)
    n_dev = n_test = n // 10
    for split, recs in split3(records, n - n_dev - n_test, n_dev, n_test).items():
        write_jsonl(OUT / "tasks" / "wordnet_pos" / f"{split}.jsonl", recs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shared", default=str(ROOT.parent / "shared" / "data"), help="the shared data folder")
    p.add_argument("--wordnet", default="/usr/share/wordnet", help="WordNet 3.0's dict folder (Debian wordnet-base)")
    args = p.parse_args()
    shared = Path(args.shared)
    bundle_corpus(shared)
    bundle_real_tasks(shared)
    sentences = austen_sentences(shared)
    derive_tagging(sentences)
    derive_regression(sentences)
    derive_qa(shared)
    derive_reverse_dictionary(shared)
    bundle_wordnet_pos(Path(args.wordnet))
    for f in sorted(OUT.rglob("*")):
        if f.is_file() and f.suffix in (".gz", ".jsonl"):
            print(f"{f.relative_to(OUT)}  {f.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
