"""Readers: every format (plain, JSONL, CSV/TSV, Parquet, gzip), folders and globs, each DataError, streaming."""

import gzip
import json
import time

import pytest

from pretune.data.readers import (
    SUPPORTED_EXTS,
    DataError,
    count_bytes,
    expand_sources,
    iter_documents,
    iter_records,
)


def write(path, text: str | bytes, *, gz: bool = False):
    data = text.encode("utf-8") if isinstance(text, str) else text
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        with gzip.open(path, "wb", compresslevel=1) as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


PLAIN = "First line\nof para one.\n\n\n  \nPara two, one line.\r\n\nPara three\nhas\nthree lines.\n"


# ---------------------------------------------------------------------------------- plain text


def test_plain_blank_line_split(tmp_path):
    p = write(tmp_path / "a.txt", PLAIN)
    want = ["First line\nof para one.", "Para two, one line.", "Para three\nhas\nthree lines."]
    assert list(iter_documents(p)) == want


def test_plain_line_split(tmp_path):
    p = write(tmp_path / "a.txt", PLAIN)
    docs = list(iter_documents(p, doc_split="line"))
    assert docs == ["First line", "of para one.", "Para two, one line.", "Para three", "has", "three lines."]


def test_plain_file_split_keeps_blank_lines(tmp_path):
    p = write(tmp_path / "a.md", PLAIN)
    (doc,) = iter_documents(p, doc_split="file")
    assert doc == PLAIN.replace("\r", "").rstrip("\n")


def test_plain_strips_bom_and_crlf(tmp_path):
    p = write(tmp_path / "a.text", "\ufeffHello there.\r\nSecond line.\r\n")
    assert list(iter_documents(p)) == ["Hello there.\nSecond line."]


@pytest.mark.parametrize("name", ["a.txt.gz", "a.TXT.GZ", "a.md.gz"])
def test_plain_gzip(tmp_path, name):
    p = write(tmp_path / name, PLAIN, gz=True)
    assert len(list(iter_documents(p))) == 3


# --------------------------------------------------------------------------------------- JSONL


JSONL = '{"text": "doc one", "id": 1}\n\n{"text": "doc two", "body": "other"}\n{"text": "   "}\n'


@pytest.mark.parametrize("name, gz", [("a.jsonl", False), ("a.ndjson", False), ("a.jsonl.gz", True)])
def test_jsonl(tmp_path, name, gz):
    p = write(tmp_path / name, JSONL, gz=gz)
    assert list(iter_documents(p)) == ["doc one", "doc two"]  # blank line and blank text skipped
    assert list(iter_records(p)) == [(1, {"text": "doc one", "id": 1}), (3, {"text": "doc two", "body": "other"}),
                                     (4, {"text": "   "})]


def test_jsonl_other_field_and_doc_split_ignored(tmp_path):
    p = write(tmp_path / "a.jsonl", '{"body": "x\\n\\ny"}\n')
    assert list(iter_documents(p, field="body", doc_split="line")) == ["x\n\ny"]


def test_jsonl_invalid_json_names_file_and_line(tmp_path):
    p = write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON .*column 10.*one JSON object per line"):
        list(iter_documents(p))


def test_jsonl_not_an_object(tmp_path):
    p = write(tmp_path / "a.jsonl", '["text"]\n')
    with pytest.raises(DataError, match=r"a\.jsonl:1: JSON list .*expected one JSON object per line"):
        list(iter_documents(p))


def test_jsonl_missing_field_lists_fields(tmp_path):
    p = write(tmp_path / "a.jsonl", '{"text": "ok"}\n{"body": "x", "id": 3}\n')
    with pytest.raises(DataError, match=r"a\.jsonl:2: record has no field 'text'; it has fields \['body', 'id'\]"):
        list(iter_documents(p))


@pytest.mark.parametrize("value, kind", [("42", "int"), ("null", "NoneType"), ('["a"]', "list")])
def test_jsonl_field_not_a_string(tmp_path, value, kind):
    p = write(tmp_path / "a.jsonl", f'{{"text": {value}}}\n')
    with pytest.raises(DataError, match=rf"a\.jsonl:1: field 'text' is {kind} .*expected a string"):
        list(iter_documents(p))


# ------------------------------------------------------------------------------------- CSV/TSV


def test_csv_quoted_multiline_field(tmp_path):
    p = write(tmp_path / "a.csv", 'id,text\n1,"hello, world"\n2,"two\nlines ""quoted"""\n\n3,last\n')
    assert list(iter_documents(p)) == ["hello, world", 'two\nlines "quoted"', "last"]
    assert [n for n, _ in iter_records(p)] == [2, 3, 6]  # the record's first line; the header is line 1
    assert list(iter_records(p))[0] == (2, {"id": "1", "text": "hello, world"})


def test_tsv_quotes_are_literal(tmp_path):
    p = write(tmp_path / "a.tsv.gz", 'sentence\tlabel\n"it\'s good" she said\t1\n', gz=True)
    assert list(iter_documents(p, field="sentence")) == ['"it\'s good" she said']
    assert list(iter_records(p)) == [(2, {"sentence": '"it\'s good" she said', "label": "1"})]


def test_csv_gzip(tmp_path):
    p = write(tmp_path / "a.csv.gz", "text\nalpha\nbeta\n", gz=True)
    assert list(iter_documents(p)) == ["alpha", "beta"]


def test_csv_missing_column_lists_columns(tmp_path):
    p = write(tmp_path / "a.csv", "id,body\n1,x\n")
    with pytest.raises(DataError, match=r"a\.csv:1: no column 'text'; the header has columns \['id', 'body'\]"):
        list(iter_documents(p))


def test_csv_wrong_number_of_fields(tmp_path):
    p = write(tmp_path / "a.csv", "id,text\n1,x\n2\n")
    with pytest.raises(DataError, match=r"a\.csv:3: row has 1 fields; expected 2"):
        list(iter_documents(p))


def test_csv_unterminated_quote(tmp_path):
    p = write(tmp_path / "a.csv", 'text\n"open\n')
    with pytest.raises(DataError, match=r"a\.csv:\d+: malformed CSV"):
        list(iter_documents(p))


# ----------------------------------------------------------------------------------------- Parquet


def write_parquet(path, columns: dict, row_group_size: int | None = None):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def test_parquet_streams_batches(tmp_path):
    texts = [f"document {i}" for i in range(2500)]  # > one 1024-row batch, several row groups
    p = write_parquet(tmp_path / "a.parquet", {"text": texts, "n": list(range(2500))}, row_group_size=700)
    assert list(iter_documents(p)) == texts
    records = list(iter_records(p))
    assert records[0] == (1, {"text": "document 0", "n": 0}) and records[-1][0] == 2500


def test_parquet_other_field(tmp_path):
    p = write_parquet(tmp_path / "a.parquet", {"body": ["x", " ", "y"]})
    assert list(iter_documents(p, field="body")) == ["x", "y"]


def test_parquet_missing_column(tmp_path):
    p = write_parquet(tmp_path / "a.parquet", {"body": ["x"], "id": [1]})
    with pytest.raises(DataError, match=r"a\.parquet: no column 'text'; the file has columns \['body', 'id'\]"):
        list(iter_documents(p))


def test_parquet_non_string_and_null(tmp_path):
    p = write_parquet(tmp_path / "a.parquet", {"text": [1, 2]})
    with pytest.raises(DataError, match=r"a\.parquet: row 1: field 'text' is int \(1\); expected a string"):
        list(iter_documents(p))
    p = write_parquet(tmp_path / "b.parquet", {"text": ["a", None]})
    with pytest.raises(DataError, match=r"b\.parquet: row 2: field 'text' is NoneType"):
        list(iter_documents(p))


def test_parquet_empty_and_corrupt(tmp_path):
    pa = pytest.importorskip("pyarrow")
    p = write_parquet(tmp_path / "empty.parquet", {"text": pa.array([], pa.string())})
    with pytest.raises(DataError, match=r"empty\.parquet: no documents \(empty file\?\)"):
        list(iter_documents(p))
    bad = write(tmp_path / "bad.parquet", b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable Parquet file"):
        list(iter_documents(bad))


# ------------------------------------------------------------------------------- sources: folders, globs


@pytest.fixture
def tree(tmp_path):
    write(tmp_path / "d" / "b.txt", "b doc")
    write(tmp_path / "d" / "a.jsonl", '{"text": "a doc"}\n')
    write(tmp_path / "d" / "sub" / "c.txt.gz", "c doc", gz=True)
    write(tmp_path / "d" / "README", "not data")
    write(tmp_path / "d" / "notes.pdf", "not data")
    return tmp_path


def test_folder_is_recursive_sorted_and_filtered(tree):
    d = tree / "d"
    assert expand_sources(d) == [d / "a.jsonl", d / "b.txt", d / "sub" / "c.txt.gz"]
    assert list(iter_documents(d)) == ["a doc", "b doc", "c doc"]


def test_glob_patterns(tree):
    d = tree / "d"
    assert expand_sources(str(d / "**" / "*.txt*")) == [d / "b.txt", d / "sub" / "c.txt.gz"]
    assert expand_sources(str(d / "*")) == [d / "a.jsonl", d / "b.txt", d / "sub" / "c.txt.gz"]  # folder expanded


def test_list_of_sources_keeps_order_and_dedups(tree):
    d = tree / "d"
    got = expand_sources([d / "b.txt", str(d / "*.jsonl"), d])
    assert got == [d / "b.txt", d / "a.jsonl", d / "sub" / "c.txt.gz"]


def test_source_matching_nothing_is_named(tree):
    with pytest.raises(DataError, match=r"nothere\.txt: no such file or folder"):
        expand_sources([tree / "d", tree / "nothere.txt"])
    with pytest.raises(DataError, match=r"\*\.csv: glob pattern matched nothing"):
        expand_sources(str(tree / "d" / "*.csv"))
    with pytest.raises(DataError, match=r"\*\.pdf: glob pattern matched 1 path\(s\) but no data files"):
        expand_sources(str(tree / "d" / "*.pdf"))
    (tree / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: folder holds no data files; expected files ending in \.txt"):
        expand_sources(tree / "empty")
    with pytest.raises(DataError, match="no data sources given"):
        expand_sources([])


def test_unknown_extension_lists_supported(tree):
    with pytest.raises(DataError, match=r"notes\.pdf: unknown file type; expected one of .*\.jsonl.*\.parquet"):
        list(iter_documents(tree / "d" / "notes.pdf"))
    assert ".csv.gz" in SUPPORTED_EXTS and ".parquet.gz" not in SUPPORTED_EXTS


def test_count_bytes(tree):
    d = tree / "d"
    assert count_bytes(d) == sum(p.stat().st_size for p in [d / "a.jsonl", d / "b.txt", d / "sub" / "c.txt.gz"])


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_empty_file(tmp_path, content):
    p = write(tmp_path / "e.txt", content)
    with pytest.raises(DataError, match=r"e\.txt: no documents \(empty file\?\)"):
        list(iter_documents(p))
    for name in ("e.jsonl", "e.csv"):
        with pytest.raises(DataError, match=rf"{name.replace('.', '[.]')}: no (documents|records)"):
            list(iter_documents(write(tmp_path / name, content)))
        with pytest.raises(DataError, match=r"no records \(empty file\?\)"):
            list(iter_records(tmp_path / name))


def test_bad_utf8_names_line_and_byte_offset(tmp_path):
    p = write(tmp_path / "bad.txt", b"fine line\nsecond \xff line\n")
    with pytest.raises(DataError) as e:
        list(iter_documents(p))
    msg = str(e.value)
    assert "bad.txt:2:" in msg and "0xff" in msg and "byte offset 17 in the file" in msg  # 10 + len("second ")
    assert 'errors=replace' in msg


def test_bad_utf8_in_gzip_offset_is_decompressed(tmp_path):
    p = write(tmp_path / "bad.jsonl.gz", b'{"text": "ok"}\n{"text": "\xc3("}\n', gz=True)  # 15 + 10 bytes before it
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz:2: .*byte offset 25 in the decompressed stream"):
        list(iter_documents(p))


def test_errors_replace_goes_on(tmp_path):
    p = write(tmp_path / "bad.txt", b"caf\xe9 au lait.\n\nnext doc\n")
    assert list(iter_documents(p, errors="replace")) == ["caf\ufffd au lait.", "next doc"]
    q = write(tmp_path / "bad.csv", b"text\ncaf\xe9\n")
    assert list(iter_records(q, errors="replace")) == [(2, {"text": "caf\ufffd"})]


def test_corrupt_gzip(tmp_path):
    p = write(tmp_path / "a.txt.gz", b"this is not gzip data")
    with pytest.raises(DataError, match=r"a\.txt\.gz: corrupt or truncated gzip data"):
        list(iter_documents(p))
    whole = gzip.compress(b"line one\n" * 1000)
    q = write(tmp_path / "t.txt.gz", whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"t\.txt\.gz: corrupt or truncated gzip data"):
        list(iter_documents(q))


def test_iter_records_rejects_plain_text(tmp_path):
    with pytest.raises(DataError, match=r"a\.txt: plain text has no records"):
        list(iter_records(write(tmp_path / "a.txt", "x")))


def test_bad_arguments(tmp_path):
    p = write(tmp_path / "a.txt", "x")
    with pytest.raises(ValueError, match=r"doc_split='para'; expected one of 'blank_line', 'line', 'file'"):
        list(iter_documents(p, doc_split="para"))
    with pytest.raises(ValueError, match=r"errors='ignore'"):
        list(iter_documents(p, errors="ignore"))
    with pytest.raises(ValueError, match=r"limit \(-1\)"):
        list(iter_documents(p, limit=-1))


# --------------------------------------------------------------------------------- limit, streaming


def test_limit_spans_files_and_stops_early(tmp_path):
    write(tmp_path / "a.txt", "a1\n\na2\n")
    write(tmp_path / "b.txt", "b1\n")
    write(tmp_path / "c.txt", "")  # would raise "no documents" if it were opened
    assert list(iter_documents(tmp_path, limit=3)) == ["a1", "a2", "b1"]
    assert list(iter_documents(tmp_path, limit=0)) == []


@pytest.mark.parametrize("name", ["big.txt", "big.jsonl.gz"])
def test_streaming_reads_only_what_is_needed(tmp_path, name):
    # ~8 MB of documents with an undecodable byte at the very end: reading the first document must
    # not touch the end of the file (whole-file reading would raise), and must be fast
    n = 200_000
    if name.endswith(".jsonl.gz"):
        body = "".join(json.dumps({"text": f"document number {i} " * 2}) + "\n" for i in range(n)).encode()
    else:
        body = "".join(f"document number {i} is here.\n\n" for i in range(n)).encode()
    p = write(tmp_path / name, body + b"\xff\n", gz=name.endswith(".gz"))
    assert len(body) > 5_000_000
    t = time.perf_counter()
    assert list(iter_documents(p, limit=1))[0].startswith("document number 0 ")
    docs = iter_documents(p)
    assert next(docs).startswith("document number 0 ")
    assert time.perf_counter() - t < 0.5
    docs.close()
    with pytest.raises(DataError, match=rf"{n * (1 if name.endswith('.gz') else 2) + 1}:"):
        list(iter_documents(p))
