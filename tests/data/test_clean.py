"""C4-style cleaning: each rule on hand-made pages (what goes, what the report counts), each rule off,
unwrapping, dedup, and clean_files' outputs."""

import gzip
import json

import pytest

from pretune.data.clean import (
    EMPTY,
    RULES,
    CleanConfig,
    CleanReport,
    DedupState,
    clean_document,
    clean_documents,
    clean_files,
    load_bad_words,
    logical_lines,
)
from pretune.data.readers import DataError, iter_documents

# three good lines: each ends in ".", has >= 5 words and is one sentence -> a page of 3 sentences
GOOD = [
    "The quick brown fox jumps over the lazy dog.",
    "A second sentence follows the first one here.",
    "Finally the third sentence closes this small page.",
]


def run(lines, cfg=None, state=None):
    """(cleaned page or None, report) for one page made of ``lines``."""
    report = CleanReport()
    cfg = cfg or CleanConfig(dedup=False)
    return clean_document("\n".join(lines), cfg, report, state), report


def removed(report):
    """The non-zero removal counts: {rule: (pages, lines)}."""
    keys = set(RULES) | {EMPTY}
    out = {k: (report.pages_removed.get(k, 0), report.lines_removed.get(k, 0)) for k in keys}
    return {k: v for k, v in out.items() if v != (0, 0)}


def balanced(report):
    return report.lines_in == report.lines_out + sum(report.lines_removed.values())


# ----------------------------------------------------------------------------------- line rules


def test_good_page_passes_unchanged():
    page, report = run(GOOD)
    assert page == "\n".join(GOOD)
    assert removed(report) == {}
    assert (report.pages_in, report.pages_out, report.lines_in, report.lines_out) == (1, 1, 3, 3)
    assert report.chars_in == report.chars_out == len(page)


def test_strip_citations():
    lines = GOOD + ["History[edit]", "[citation needed]", "Paris is the capital of France.[1][12] It is large [3]."]
    page, report = run(lines)
    assert page.split("\n") == GOOD + ["Paris is the capital of France. It is large."]
    assert report.citations_stripped == 5
    assert removed(report) == {"strip_citations": (0, 1), "require_terminal_punct": (0, 1)}  # "History" has no "."
    page, report = run(lines, CleanConfig(dedup=False, strip_citations=False))
    assert page.split("\n") == GOOD + ["Paris is the capital of France.[1][12] It is large [3]."]
    assert report.citations_stripped == 0
    assert "[a] and [x1]" in run(GOOD + ["Notes [a] and [x1] stay where they are."])[0]


def test_drop_javascript():
    js = "Please enable JavaScript in your browser to continue."
    page, report = run(GOOD + [js])
    assert page == "\n".join(GOOD) and removed(report) == {"drop_javascript": (0, 1)}
    page, report = run(GOOD + [js], CleanConfig(dedup=False, drop_javascript=False))
    assert js in page and removed(report) == {}


@pytest.mark.parametrize("phrase", ["terms of use", "privacy policy", "cookie policy", "uses cookies",
                                    "use of cookies", "use cookies"])
def test_drop_policy(phrase):
    line = f"Please read our {phrase.upper()} before going on here."
    page, report = run(GOOD + [line])
    assert line not in page and removed(report) == {"drop_policy": (0, 1)}
    page, _ = run(GOOD + [line], CleanConfig(dedup=False, drop_policy=False))
    assert line in page


def test_require_terminal_punct():
    ok = ["He said it was fine, I think!", "Was it really fine with all of them?", 'She wrote "it is all fine with me"',
          "She wrote \u201cit is all fine with me\u201d", "He said \u2018it is all fine then\u2019",
          "Il a dit \u00abc'est tout bon ici\u00bb", "And then it all went on and on\u2026"]
    bad = ["Home About Contact Blog Shop", "A heading that has no punctuation", "The list goes on and on,"]
    page, report = run(GOOD + ok + bad)
    assert page.split("\n") == GOOD + ok
    assert removed(report) == {"require_terminal_punct": (0, 3)}
    page, report = run(GOOD + bad, CleanConfig(dedup=False, require_terminal_punct=False))
    assert page.split("\n") == GOOD + bad


def test_require_min_words():
    page, report = run(GOOD + ["Four words only here.", "Exactly five words are here."])
    assert page.split("\n") == GOOD + ["Exactly five words are here."]
    assert removed(report) == {"require_min_words": (0, 1)}
    page, report = run(GOOD + ["Four words only here."], CleanConfig(dedup=False, min_words=4))
    assert removed(report) == {}
    page, report = run(GOOD + ["Tiny."], CleanConfig(dedup=False, require_min_words=False))
    assert page.endswith("Tiny.")


def test_first_line_rule_gets_the_count():
    # has "javascript" AND no terminal punctuation AND < 5 words: javascript runs first
    page, report = run(GOOD + ["JavaScript required"])
    assert removed(report) == {"drop_javascript": (0, 1)}


def test_page_with_no_line_left_is_empty():
    page, report = run(["Home", "About us", "Contact"])
    assert page is None
    assert removed(report) == {"require_terminal_punct": (0, 3), EMPTY: (1, 0)}
    assert report.pages_out == 0 and balanced(report)


# ----------------------------------------------------------------------------------- page rules


def test_drop_lorem_ipsum():
    page, report = run(GOOD + ["Lorem Ipsum dolor sit amet, consectetur adipiscing."])
    assert page is None and removed(report) == {"drop_lorem_ipsum": (1, 4)}
    page, _ = run(GOOD + ["Lorem Ipsum dolor sit amet, consectetur adipiscing."],
                  CleanConfig(dedup=False, drop_lorem_ipsum=False))
    assert page is not None


def test_drop_curly_brace():
    code = "The function body is { return x; } in this code."
    page, report = run(GOOD + [code])
    assert page is None and removed(report) == {"drop_curly_brace": (1, 4)}
    assert run(GOOD + [code], CleanConfig(dedup=False, drop_curly_brace=False))[0] is not None


def test_page_rules_see_only_kept_lines():
    # the "{" is on a line the line rules drop, so the page stays (C4 order: lines first)
    page, report = run(GOOD + ["menu { item"])
    assert page == "\n".join(GOOD) and removed(report) == {"require_terminal_punct": (0, 1)}


def test_first_page_rule_gets_the_count():
    page, report = run(GOOD + ["This lorem ipsum line has a { brace in it."])
    assert removed(report) == {"drop_lorem_ipsum": (1, 4)}


def test_drop_bad_words_whole_words_any_case():
    page, report = run(GOOD + ["What the FUCK is going on in here?"])
    assert page is None and removed(report) == {"drop_bad_words": (1, 4)}
    # substrings of innocent words do not count (the Scunthorpe problem)
    assert run(GOOD + ["Scunthorpe and Shitake are not bad words at all."])[0] is not None
    assert run(GOOD + ["Moby Dick is a novel about a whale, and an ass is a donkey."])[0] is not None
    page, _ = run(GOOD + ["What the fuck is going on in here?"], CleanConfig(dedup=False, drop_bad_words=False))
    assert page is not None


def test_bad_words_file(tmp_path):
    f = tmp_path / "words.txt"
    f.write_text("# my list\nbanana\n\nrubber  duck\nc++\n")
    cfg = CleanConfig(dedup=False, bad_words_file=str(f))
    assert run(GOOD + ["I ate a Banana for breakfast this morning."], cfg)[0] is None
    assert run(GOOD + ["A yellow RUBBER\tDUCK floats in the bath."], cfg)[0] is None  # phrase, any whitespace
    assert run(GOOD + ["He writes C++ code every single day."], cfg)[0] is None
    assert run(GOOD + ["Bananas and rubber ducks are fine though."], cfg)[0] is not None  # whole words only
    assert run(GOOD + ["What the fuck is going on in here?"], cfg)[0] is not None  # replaces the built-in list
    assert load_bad_words(None).find("oh SHIT.") == "shit"


def test_bad_words_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"bad_words_file '.*nope\.txt': no such file"):
        run(GOOD, CleanConfig(dedup=False, bad_words_file=str(tmp_path / "nope.txt")))
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(DataError, match=r"empty\.txt: bad-words file has no entries"):
        run(GOOD, CleanConfig(dedup=False, bad_words_file=str(tmp_path / "empty.txt")))


def test_require_min_sentences():
    page, report = run(GOOD[:2])
    assert page is None and removed(report) == {"require_min_sentences": (1, 2)}
    two_in_one = ["First sentence of the line. Second one is here.", "And then a third one ends it."]
    assert run(two_in_one)[0] is not None  # sentences, not lines, are counted
    assert run(GOOD[:2], CleanConfig(dedup=False, min_sentences=2))[0] is not None
    assert run(GOOD[:1], CleanConfig(dedup=False, require_min_sentences=False))[0] == GOOD[0]


# ---------------------------------------------------------------------------------------- dedup


def test_dedup_removes_later_copies_of_three_sentence_spans():
    cfg = CleanConfig()
    state = DedupState()
    report = CleanReport()
    first = "One fish swam here today. Two fish swam there too. Red fish swam far away. Blue fish stayed home."
    second = ["A brand new opening sentence here.",
              "one  FISH swam here today. Two fish swam there too. Red fish swam far away.",  # case, spaces differ
              "A brand new closing sentence here. And one more to be safe."]
    assert clean_document(first, cfg, report, state) == first  # first occurrence kept whole
    out = clean_document("\n".join(second), cfg, report, state)
    assert out == "A brand new opening sentence here.\nA brand new closing sentence here. And one more to be safe."
    assert report.sentences_deduped == 3
    assert removed(report) == {"dedup": (0, 1)}
    assert balanced(report)
    # the same page with dedup off keeps everything
    out = list(clean_documents([first, "\n".join(second)], CleanConfig(dedup=False)))
    assert out[1] == "\n".join(second)


def test_dedup_within_a_page_keeps_first_occurrence():
    cfg = CleanConfig(require_min_words=False)
    four = "Yes it is. " * 4  # overlapping repeats are not copies of an earlier span
    assert clean_document(four, cfg, CleanReport(), DedupState()) == four.strip()
    six = "Yes it is. " * 6
    report = CleanReport()
    assert clean_document(six, cfg, report, DedupState()) == ("Yes it is. " * 3).strip()
    assert report.sentences_deduped == 3


def test_dedup_can_drop_the_page():
    state = DedupState()
    report = CleanReport()
    page = "\n".join(GOOD)
    assert clean_document(page, CleanConfig(), report, state) == page
    assert clean_document(page + "\nOne more new sentence is here.", CleanConfig(), report, state) is None
    assert removed(report) == {"dedup": (1, 4)}  # 3 lines emptied by dedup + the 1 left when the page went
    assert balanced(report) and len(state) == 1 + 1  # the new span of page 2 is remembered too


# --------------------------------------------------------------------------------------- unwrap


WRAPPED = """Emma Woodhouse, handsome, clever, and rich, with a comfortable home
and happy disposition, seemed to unite some of the best blessings of
existence; and had lived nearly twenty-one years in the world with very
little to distress or vex her. She was the youngest of the two daughters
of a most affectionate, indulgent father. Her mother had died long ago."""


def test_unwrap_joins_hard_wrapped_paragraphs():
    cfg = CleanConfig(dedup=False)
    (line,) = logical_lines(WRAPPED, cfg)
    assert line == " ".join(WRAPPED.split("\n"))
    page, report = run([WRAPPED], cfg)
    assert page == line and report.lines_in == 1 and removed(report) == {}
    # without unwrapping, C4's line rules eat the wrapped lines
    page, report = run([WRAPPED], CleanConfig(dedup=False, unwrap=False))
    assert page is None and removed(report) == {"require_terminal_punct": (0, 4), "require_min_sentences": (1, 1)}


def test_unwrap_leaves_other_paragraphs_alone():
    cfg = CleanConfig()
    verses = "In the beginning was the word.\nAnd the word was with God.\nThe same was in the beginning."
    assert logical_lines(verses, cfg) == verses.split("\n")  # every line ends in punctuation
    wide = "= Title =\n" + "A long encyclopedia paragraph on one line, " * 5
    assert logical_lines(wide, cfg) == wide.strip().split("\n")  # a line wider than unwrap_max_width
    two = WRAPPED + "\n\n\nCHAPTER II\n\n" + WRAPPED
    assert len(logical_lines(two, cfg)) == 3  # paragraphs are joined separately
    hyphens = "in a comfortable home and with what very self-\ndenying, generous friendship she had always\nwished"
    assert logical_lines(hyphens, cfg) == [hyphens.replace("-\n", "-").replace("\n", " ")]


def test_unwrap_continues_sentences_over_lines():
    cfg = CleanConfig()
    long_start = "God said to the people who were gathered there in the valley of the long river, "
    lines = [long_start * 2, "\u201cLet there be light,\u201d and there was light.", "Heading:", "* list item",
             "ends with a dash\u2014", "and goes on."]
    assert logical_lines("\n".join(lines), cfg) == [
        long_start * 2 + "\u201cLet there be light,\u201d and there was light.",
        "Heading:", "* list item", "ends with a dash\u2014and goes on."]
    assert logical_lines("\n".join(lines), CleanConfig(unwrap=False)) == [s.strip() for s in lines]


# --------------------------------------------------------------------------------- config, report


@pytest.mark.parametrize("name", ["min_words", "min_sentences", "unwrap_max_width"])
def test_config_validation(name):
    with pytest.raises(ValueError, match=rf"CleanConfig\.{name} \(0\) must be an integer >= 1"):
        CleanConfig(**{name: 0})


def test_all_rules_off_keeps_every_line():
    off = CleanConfig(**{r: False for r in RULES}, unwrap=False)
    page, report = run(["Home", "x { y", "lorem ipsum", "Hello[1]"], off)
    assert page == "Home\nx { y\nlorem ipsum\nHello[1]" and removed(report) == {}


def test_report_format_and_dict():
    report = CleanReport()
    docs = ["\n".join(GOOD), "Home\nAbout", "\n".join(GOOD[:2]), "\n".join(GOOD + ["Lorem ipsum dolor sit amet."])]
    out = list(clean_documents(docs, CleanConfig(), report))
    assert out == ["\n".join(GOOD)]
    assert (report.pages_in, report.pages_out, report.lines_in, report.lines_out) == (4, 1, 11, 3)
    assert removed(report) == {"require_terminal_punct": (0, 2), EMPTY: (1, 0), "require_min_sentences": (1, 2),
                               "drop_lorem_ipsum": (1, 4)}
    assert balanced(report)
    text = report.format()
    for rule in RULES:
        assert rule in text
    assert "25.0%" in text  # pages kept
    d = json.loads(json.dumps(report.to_dict()))
    assert d["pages_removed"]["drop_lorem_ipsum"] == 1 and d["lines_out"] == 3


# ---------------------------------------------------------------------------------- clean_files


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "in.txt"
    dup = "\n".join(GOOD)
    src.write_text(f"{WRAPPED}\n\nMenu\nHome\n\n{dup}\n\n{dup}\n\nLorem ipsum is here. Yes it is. Really it is.\n")
    return src


@pytest.mark.parametrize("name", ["out.jsonl", "out.jsonl.gz", "out.txt", "out.txt.gz"])
def test_clean_files_formats(corpus, tmp_path, name):
    out = tmp_path / "sub" / name
    report = clean_files(corpus, out, CleanConfig(), show_progress=False)
    want = [" ".join(WRAPPED.split("\n")), "\n".join(GOOD)]  # second copy deduped, menu and lorem ipsum gone
    assert report.pages_in == 5 and report.pages_out == 2
    if name.startswith("out.jsonl"):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(out, "rt", encoding="utf-8") as f:
            assert [json.loads(line) for line in f] == [{"text": t} for t in want]
    assert list(iter_documents(out)) == want  # the .txt output reads back page for page
    assert sorted(p.name for p in out.parent.iterdir()) == [name]  # no temp file left


def test_clean_files_gzip_output_is_reproducible(corpus, tmp_path):
    a, b = tmp_path / "a.txt.gz", tmp_path / "b.txt.gz"
    clean_files(corpus, a, CleanConfig(), show_progress=False)
    clean_files(corpus, b, CleanConfig(), show_progress=False)
    assert a.read_bytes() == b.read_bytes()


def test_clean_files_never_leaves_half_written_output(tmp_path):
    src = tmp_path / "in.txt"
    src.write_bytes(("\n".join(GOOD) + "\n\n").encode() * 50 + b"\xff\n")
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    with pytest.raises(DataError, match="not valid UTF-8"):
        clean_files(src, out, CleanConfig(), show_progress=False)
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.jsonl"]


def test_clean_files_bad_output_name(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"out\.csv'?: unknown file type; expected a name ending in \.jsonl"):
        clean_files(corpus, tmp_path / "out.csv", CleanConfig(), show_progress=False)


def test_clean_files_bad_source_writes_nothing(tmp_path):
    with pytest.raises(DataError, match=r"nothere\.txt: no such file or folder"):
        clean_files(tmp_path / "nothere.txt", tmp_path / "out" / "o.jsonl", CleanConfig(), show_progress=False)
    assert list(tmp_path.iterdir()) == []
