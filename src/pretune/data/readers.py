"""Streamed document readers: plain text, JSONL, CSV/TSV and Parquet; single files, folders or globs; gzip.

Every reader is a generator that holds at most one document (or one Parquet record batch) in memory,
so a corpus larger than RAM streams through. Text files are read in binary and decoded line by line
here, which lets a decoding error name the file, the line and the byte offset of the bad byte, and
lets plain and gzip-compressed files share one code path.

    for doc in iter_documents("data/**/*.jsonl.gz", field="text"):
        ...
"""

from __future__ import annotations

import csv
import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Literal

Source = str | os.PathLike
Sources = Source | Sequence[Source]
DocSplit = Literal["blank_line", "line", "file"]
Errors = Literal["strict", "replace"]

PLAIN_EXTS = (".txt", ".text", ".md")  # one document per paragraph / line / file (doc_split)
JSONL_EXTS = (".jsonl", ".ndjson")  # one JSON object per line, text in `field`
TABLE_EXTS = (".csv", ".tsv")  # header row, text in column `field`
PARQUET_EXTS = (".parquet",)  # read in record batches, text in column `field`
_GZIPPABLE = PLAIN_EXTS + JSONL_EXTS + TABLE_EXTS
SUPPORTED_EXTS = _GZIPPABLE + tuple(e + ".gz" for e in _GZIPPABLE) + PARQUET_EXTS
_DOC_SPLITS = ("blank_line", "line", "file")
_ERRORS = ("strict", "replace")
_GLOB_CHARS = frozenset("*?[")
_PARQUET_BATCH_ROWS = 1024  # rows per record batch: bounded memory, few Python round trips
_CSV_FIELD_LIMIT = 2**31 - 1  # csv's default 128 KiB per field is too small for whole documents


class DataError(ValueError):
    """Bad input data: the message names the file, the line (and byte offset where relevant) and
    what was expected."""


# --------------------------------------------------------------------------------------- sources


def _format_of(path: Path) -> tuple[str, bool]:
    """(base extension, gzip-compressed?) of ``path``; DataError for an extension we cannot read."""
    name = path.name.lower()
    for ext in sorted(SUPPORTED_EXTS, key=len, reverse=True):  # ".jsonl.gz" before ".gz"-less forms
        if name.endswith(ext):
            return (ext[:-3], True) if ext.endswith(".gz") else (ext, False)
    raise DataError(f"{path}: unknown file type; expected one of {', '.join(SUPPORTED_EXTS)}")


def _is_supported(path: Path) -> bool:
    name = path.name.lower()
    return any(name.endswith(ext) for ext in SUPPORTED_EXTS)


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and _is_supported(p))


def expand_sources(sources: Sources) -> list[Path]:
    """The data files named by ``sources``, in reading order.

    Args:
        sources: one source or a sequence of them. A source is a file (any supported extension,
            see ``SUPPORTED_EXTS``), a folder (searched recursively; files with a supported
            extension, sorted by path) or a glob pattern (``"data/**/*.jsonl"``; ``**`` recurses;
            matches sorted; matched folders are expanded as above).

    Returns:
        The files, each once (the first mention wins), in the order of ``sources``.

    Raises:
        DataError: a source matches nothing (it is named), a folder or pattern holds no supported
            file, or a named file has an unsupported extension.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if len(sources) == 0:
        raise DataError("no data sources given; expected a file, folder or glob pattern")
    files: list[Path] = []
    for source in sources:
        text = os.path.expanduser(os.fspath(source))
        path = Path(text)
        if path.is_file():
            _format_of(path)  # unknown extension -> DataError listing the supported ones
            found = [path]
        elif path.is_dir():
            found = _files_under(path)
            if not found:
                raise DataError(f"{text}: folder holds no data files; expected files ending in "
                                f"{', '.join(SUPPORTED_EXTS)}")
        elif _GLOB_CHARS & set(text):
            matches = sorted(glob.glob(text, recursive=True))
            found = []
            for m in map(Path, matches):
                found.extend(_files_under(m) if m.is_dir() else [m] if _is_supported(m) else [])
            if not found:
                what = (f"matched {len(matches)} path(s) but no data files" if matches else "matched nothing")
                raise DataError(f"{text}: glob pattern {what}; expected files ending in {', '.join(SUPPORTED_EXTS)}")
        else:
            raise DataError(f"{text}: no such file or folder (and not a glob pattern)")
        files.extend(found)
    seen: set[Path] = set()
    unique = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def count_bytes(sources: Sources, *, uncompressed: bool = False) -> int:
    """Total size in bytes of the files named by ``sources``, e.g. for the total of a progress bar:
    on disk, or with ``uncompressed=True`` the text size of ``.gz`` files (read from the gzip trailer,
    which holds the uncompressed size modulo 4 GiB — exact below that, an estimate above)."""
    total = 0
    for p in expand_sources(sources):
        size = p.stat().st_size
        if uncompressed and p.name.endswith(".gz") and size >= 18:
            with open(p, "rb") as f:
                f.seek(-4, os.SEEK_END)
                isize = int.from_bytes(f.read(4), "little")
            size = isize or size
        total += size
    return total


# ------------------------------------------------------------------------------------ text lines


def _open_binary(path: Path, compressed: bool) -> IO[bytes]:
    return gzip.open(path, "rb") if compressed else open(path, "rb")


def _iter_lines(path: Path, compressed: bool, errors: Errors) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its line ending) of a UTF-8 text file, streamed.

    A leading byte-order mark is dropped. With ``errors="strict"`` an undecodable byte raises a
    DataError naming the file, line and byte offset (within the decompressed stream for gzip).
    """
    offset = 0  # byte offset of the current line's first byte
    lineno = 0
    try:
        with _open_binary(path, compressed) as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8", errors)
                except UnicodeDecodeError as e:
                    bad = offset + e.start
                    where = "in the decompressed stream" if compressed else "in the file"
                    raise DataError(
                        f"{path}:{lineno}: byte 0x{raw[e.start]:02x} at byte offset {bad} {where} (column "
                        f"byte {e.start}) is not valid UTF-8; expected UTF-8 text. Re-encode the file (e.g. iconv -f "
                        f"latin1 -t utf-8), or read bad bytes as U+FFFD with errors=replace (--errors replace, "
                        f"data.errors=replace)") from None
                offset += len(raw)
                if lineno == 1 and line.startswith("\ufeff"):
                    line = line[1:]
                yield lineno, line.rstrip("\r\n")
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path}: corrupt or truncated gzip data after line {lineno} ({e}); "
                        f"expected a complete gzip file") from None


def _plain_documents(path: Path, compressed: bool, doc_split: DocSplit, errors: Errors) -> Iterator[str]:
    lines = _iter_lines(path, compressed, errors)
    if doc_split == "line":
        for _, line in lines:
            if line.strip():
                yield line
    elif doc_split == "blank_line":
        para: list[str] = []
        for _, line in lines:
            if line.strip():
                para.append(line)
            elif para:
                yield "\n".join(para)
                para = []
        if para:
            yield "\n".join(para)
    else:  # "file": the whole file is one document; only that document is held in memory
        text = "\n".join(line for _, line in lines)
        if text.strip():
            yield text


# --------------------------------------------------------------------------------------- records


def _jsonl_records(path: Path, compressed: bool, errors: Errors) -> Iterator[tuple[int, dict]]:
    for lineno, line in _iter_lines(path, compressed, errors):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                            f"expected one JSON object per line") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: JSON {type(record).__name__} ({_short(record)}); "
                            f"expected one JSON object per line")
        yield lineno, record


def _table_records(path: Path, ext: str, compressed: bool, errors: Errors,
                   field: str | None = None) -> Iterator[tuple[int, dict]]:
    """CSV (RFC 4180 quoting; a quoted field may span lines) or TSV (no quoting, as GLUE's files:
    fields hold no tabs or newlines, and quotes are literal). The number is the record's first line;
    ``field``, if given, must be a column (checked at the header)."""
    csv.field_size_limit(max(csv.field_size_limit(), _CSV_FIELD_LIMIT))
    numbered = _iter_lines(path, compressed, errors)
    state = {"line": 0}

    def lines() -> Iterator[str]:
        for lineno, line in numbered:
            state["line"] = lineno
            yield line + "\n"

    dialect = dict(delimiter="\t", quoting=csv.QUOTE_NONE) if ext == ".tsv" else dict(delimiter=",")
    reader = csv.reader(lines(), strict=True, **dialect)
    try:
        header = next(reader, None)
        while header is not None and not any(h.strip() for h in header):  # blank lines before the header
            header = next(reader, None)
        if header is None:
            return
        sep = dialect["delimiter"]
        if len(header) == 1:  # one column: is the file separated by something else?
            other = max((";", "\t", "|", ","), key=header[0].count)
            if other != sep and header[0].count(other):
                shown = "tab" if other == "\t" else repr(other)
                want = "tab-separated (.tsv)" if ext == ".tsv" else "comma-separated (.csv)"
                hint = " (or name it .tsv)" if other == "\t" else ""
                raise DataError(f"{path}:{state['line']}: the header {header[0]!r:.80} is one column: the file looks "
                                f"{shown}-separated; expected {want}. Convert it to commas{hint}, or to JSONL")
        if field is not None and field not in header:
            raise DataError(f"{path}:{state['line']}: no column {field!r}; the header has columns {header} "
                            f"(pick one with field=...)")
        while True:
            start = state["line"] + 1
            row = next(reader, None)
            if row is None:
                return
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank line
            if len(row) != len(header):
                raise DataError(f"{path}:{start}: row has {len(row)} fields; expected {len(header)} "
                                f"as in the header {header}")
            yield start, dict(zip(header, row))
    except csv.Error as e:
        raise DataError(f"{path}:{state['line']}: malformed {ext[1:].upper()} ({e})") from None


def _parquet_file(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading .parquet files needs pyarrow (pip install pyarrow)") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses for bad files
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None


def _parquet_records(path: Path, columns: list[str] | None = None) -> Iterator[tuple[int, dict]]:
    pf = _parquet_file(path)
    names = pf.schema_arrow.names
    for c in columns or []:
        if c not in names:
            raise DataError(f"{path}: no column {c!r}; the file has columns {names} (pick one with field=...)")
    row = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
        for record in batch.to_pylist():
            row += 1
            yield row, record


def iter_records(path: Source, *, errors: Errors = "strict") -> Iterator[tuple[int, dict]]:
    """Records of one JSONL, CSV/TSV or Parquet file, streamed (for labelled data).

    Args:
        path: a ``.jsonl``/``.ndjson``/``.csv``/``.tsv`` file (optionally ``.gz``) or ``.parquet``.
        errors: ``"strict"``: a non-UTF-8 byte raises DataError; ``"replace"``: it becomes U+FFFD.

    Yields:
        ``(number, record)``: the 1-based line number (JSONL; CSV/TSV: the record's first line, the
        header being line 1) or row number (Parquet), and the record as a dict (CSV/TSV values are
        strings; Parquet values are Python objects).

    Raises:
        DataError: bad JSON, a line that is not a JSON object, a CSV row with the wrong number of
            fields, bad UTF-8, a plain-text or unknown file type, or a file with no records.
    """
    _check_choice("errors", errors, _ERRORS)
    path = Path(path)
    ext, compressed = _format_of(path)
    if ext in PLAIN_EXTS:
        raise DataError(f"{path}: plain text has no records; expected a {', '.join(JSONL_EXTS + TABLE_EXTS)} "
                        f"(optionally .gz) or .parquet file")
    empty = True
    for rec in _records(path, ext, compressed, errors):
        empty = False
        yield rec
    if empty:
        raise DataError(f"{path}: no records (empty file?)")


def _records(path: Path, ext: str, compressed: bool, errors: Errors,
             field: str | None = None) -> Iterator[tuple[int, dict]]:
    if ext in JSONL_EXTS:
        return _jsonl_records(path, compressed, errors)
    if ext in TABLE_EXTS:
        return _table_records(path, ext, compressed, errors, field)
    return _parquet_records(path, [field] if field is not None else None)


def record_where(path: Path, num: int) -> str:
    """How an error names a record: ``file:line`` (JSONL, CSV/TSV) or ``file: row N`` (Parquet)."""
    return f"{path}: row {num}" if str(path).lower().endswith(PARQUET_EXTS) else f"{path}:{num}"


def record_text(record: dict, field: str, where: str, *, hint: str = "field=...") -> str:
    """``record[field]`` as a string; a missing field or a non-string value is a DataError naming ``where``
    and the fields the record has (``hint``: how the user picks another field)."""
    if field not in record:
        raise DataError(f"{where}: record has no field {field!r}; it has fields {sorted(record)} "
                        f"(pick one with {hint})")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is {type(text).__name__} ({_short(text)}); expected a string")
    return text


def _record_documents(path: Path, ext: str, compressed: bool, field: str, errors: Errors) -> Iterator[str]:
    for num, record in _records(path, ext, compressed, errors, field):
        text = record_text(record, field, record_where(path, num))
        if text.strip():
            yield text


# ------------------------------------------------------------------------------------- documents


def iter_documents(sources: Sources, *, field: str = "text", doc_split: DocSplit = "blank_line",
                   errors: Errors = "strict", limit: int | None = None) -> Iterator[str]:
    """Documents (strings) from files, folders or globs, streamed in file order.

    Args:
        sources: see :func:`expand_sources`.
        field: the JSON field / CSV column / Parquet column holding the text.
        doc_split: plain-text files only: ``"blank_line"``: a document is a run of non-blank lines
            (a paragraph; lines joined with ``"\\n"``); ``"line"``: every non-blank line is a
            document; ``"file"``: the whole file is one document (read line by line, but held in
            memory whole). JSONL/CSV/TSV/Parquet: one record is one document; blank texts are skipped.
        errors: ``"strict"``: a non-UTF-8 byte raises DataError (file, line, byte offset);
            ``"replace"``: it becomes U+FFFD and reading goes on.
        limit: stop after this many documents (None: all). Files past the limit are not opened.

    Raises:
        DataError: see :func:`expand_sources` and :func:`iter_records`; also a file that yields no
            document, a record without ``field``, or a ``field`` that is not a string.
    """
    _check_choice("doc_split", doc_split, _DOC_SPLITS)
    _check_choice("errors", errors, _ERRORS)
    if limit is not None and limit < 0:
        raise ValueError(f"limit ({limit}) must be >= 0 or None")
    paths = expand_sources(sources)
    remaining = limit
    for path in paths:
        if remaining == 0:
            return
        ext, compressed = _format_of(path)
        if ext in PLAIN_EXTS:
            docs = _plain_documents(path, compressed, doc_split, errors)
        else:
            docs = _record_documents(path, ext, compressed, field, errors)
        n = 0
        for doc in docs:
            n += 1
            yield doc
            if remaining is not None:
                remaining -= 1
                if remaining == 0:
                    docs.close()
                    return
        if n == 0:
            raise DataError(f"{path}: no documents (empty file?)")


def _check_choice(name: str, value: str, choices: Iterable[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {', '.join(map(repr, choices))}")


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
