"""A corpus on disk cut into splits: a split is a run of consecutive rows of one file, the unit one Ray task encodes
and one Parquet shard holds. Planning is deterministic (the same files give the same splits), so a shard's name
says which rows it holds, and a rerun knows which shards are already done.

    .txt             one text a line (an empty line is a text, as in `python -m fastbert encode`)
    .jsonl / .ndjson one JSON object a line: the text under `text_field`, optionally an id under `id_field`
    .parquet         a string column `text_field`, optionally an id column `id_field` (string or integer)

A row's id is its `id_field` value (as a string) when one is named, else "<file>:<n>": the file's path relative to
the input folder (its name, for a single file) and the row's number in it, from 1 (for .txt and .jsonl, the line
number). Planning reads only file sizes and Parquet footers, plus one pass over each text file to find where every
`rows_per_split`-th line starts, so that a split is read with one seek; the rows themselves are parsed by the worker
that encodes them, and a bad row is reported with its file and line.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
FORMATS = ("txt", "jsonl", "parquet")
_SCAN_CHUNK = 1 << 24  # bytes per read while finding line starts


class CorpusError(ValueError):
    """A problem with the corpus itself (a missing file, a bad row): the message names the file and the row."""


@dataclass(frozen=True)
class CorpusFile:
    path: str       # relative to the input root, "/"-separated (the prefix of default ids)
    format: str     # txt, jsonl or parquet
    size: int       # bytes, and the modification time: what a rerun compares to know the file is unchanged
    mtime_ns: int


@dataclass(frozen=True)
class Split:
    file: int       # index into the corpus' files
    part: int       # index of the split within its file
    first_row: int  # 0-based row number in the file of its first row
    rows: int
    offset: int     # txt/jsonl: byte offset of its first line; parquet: 0


def list_files(root: str, format: str | None = None) -> list[tuple[str, str]]:
    """(path relative to root, format) of the corpus at `root`: one file, or every file under a folder (recursively,
    sorted, skipping names that start with "." or "_" as Spark and pyarrow do). A file whose suffix is not a corpus
    format is an error rather than skipped, unless `format` says how to read every file."""
    if format is not None and format not in FORMATS:
        raise ValueError(f"format {format!r} is not one of {', '.join(FORMATS)}")
    if not os.path.exists(root):
        raise CorpusError(f"{root!r}: no such file or folder")
    if os.path.isfile(root):
        names = [os.path.basename(root)]
    elif os.path.isdir(root):
        names = []
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = sorted(d for d in subfolders if not d.startswith((".", "_")))
            rel = os.path.relpath(folder, root)
            names += [f if rel == "." else f"{rel}/{f}".replace(os.sep, "/")
                      for f in files if not f.startswith((".", "_"))]
        names.sort()
        if not names:
            raise CorpusError(f"{root!r}: the folder holds no files (an empty corpus)")
    else:
        raise CorpusError(f"{root!r} is neither a file nor a folder")
    out, unknown = [], []
    for name in names:
        kind = format or SUFFIXES.get(os.path.splitext(name)[1].lower())
        if kind is None:
            unknown.append(name)
        else:
            out.append((name, kind))
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise CorpusError(f"{root!r}: {shown}: not a corpus file (the suffixes read are "
                          f"{', '.join(SUFFIXES)}; a format option reads every file as one format)")
    return out


def full_path(root: str, rel: str) -> str:
    return root if os.path.isfile(root) else os.path.join(root, *rel.split("/"))


def describe(root: str, rel: str, kind: str) -> CorpusFile:
    stat = os.stat(full_path(root, rel))
    return CorpusFile(path=rel, format=kind, size=stat.st_size, mtime_ns=stat.st_mtime_ns)


# --------------------------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------------------------
def line_starts(path: str, every: int) -> tuple[int, list[int]]:
    """(number of lines, byte offsets of lines 0, every, 2*every, ...). Lines as `python -m fastbert encode` counts
    them: split at b"\\n", a trailing newline ends the last line rather than starting an empty one."""
    import numpy as np

    starts, newlines, position, last = [0], 0, 0, None
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_SCAN_CHUNK)
            if not chunk:
                break
            found = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            # the newline found[j] starts line newlines + j + 1; keep the lines whose number is a multiple of `every`
            first = (-(newlines + 1)) % every
            starts.extend(int(position + j + 1) for j in found[first::every])
            newlines += len(found)
            position += len(chunk)
            last = chunk[-1]
    lines = newlines + (1 if position and last != 10 else 0)
    return lines, [s for k, s in enumerate(starts) if k * every < lines]


def parquet_rows(path: str, text_field: str, id_field: str | None) -> int:
    """Rows of a Parquet file, its columns checked from the footer (no data read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: not a readable Parquet file ({e})") from None
    schema = parquet.schema_arrow
    for field, what, ok in ((text_field, "a string", (pa.types.is_string, pa.types.is_large_string)),
                            (id_field, "a string or an integer", (pa.types.is_string, pa.types.is_large_string,
                                                                  pa.types.is_integer))):
        if field is None:
            continue
        if field not in schema.names:
            raise CorpusError(f"{path}: no column {field!r} (its columns: {', '.join(map(repr, schema.names))})")
        kind = schema.field(field).type
        if not any(test(kind) for test in ok):
            raise CorpusError(f"{path}: column {field!r} is {kind}, not {what}")
    return parquet.metadata.num_rows


def plan(root: str, files: list[CorpusFile], rows_per_split: int, text_field: str,
         id_field: str | None) -> list[Split]:
    """Every row of every file in exactly one split; splits of a file are consecutive runs of `rows_per_split` rows
    (the last one shorter). A file with no rows has no split."""
    splits = []
    for index, file in enumerate(files):
        path = full_path(root, file.path)
        if file.format == "parquet":
            rows = parquet_rows(path, text_field, id_field)
            offsets = [0] * -(-rows // rows_per_split)
        else:
            if file.format == "txt" and id_field is not None:
                raise CorpusError(f"{path}: an id field is read from .jsonl and .parquet files; a .txt line has "
                                  f"no fields (its id is its line number)")
            rows, offsets = line_starts(path, rows_per_split)
            if file.format == "jsonl" and rows:
                check_first_record(path, text_field, id_field)
        for part, offset in enumerate(offsets):
            first = part * rows_per_split
            splits.append(Split(file=index, part=part, first_row=first, rows=min(rows_per_split, rows - first),
                                offset=offset))
    return splits


def check_first_record(path: str, text_field: str, id_field: str | None) -> None:
    """The first line of a .jsonl file, parsed before any worker starts: a wrong field name fails in a second."""
    with open(path, "rb") as f:
        line = f.readline()
    parse_jsonl(line.rstrip(b"\n").decode("utf-8", errors="replace").rstrip("\r"), path, 1, text_field, id_field)


# --------------------------------------------------------------------------------------------------------------------
# Reading one split (on the worker)
# --------------------------------------------------------------------------------------------------------------------
def decode_line(raw: bytes, path: str, number: int) -> str:
    """One line's bytes (its newline removed) as text, a final \\r dropped; a CorpusError naming the file and line
    when it is not UTF-8."""
    try:
        return raw.decode("utf-8").rstrip("\r")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: line {number} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def parse_jsonl(line: str, path: str, number: int, text_field: str, id_field: str | None) -> tuple[str, str | None]:
    """(text, id or None) of one .jsonl line; a CorpusError naming the file, the line and what is wrong."""
    where = f"{path}: line {number}"
    if not line.strip():
        raise CorpusError(f"{where} is empty (a .jsonl file holds one JSON object on every line)")
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{where} is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise CorpusError(f"{where} is a JSON {type(record).__name__}, not an object")
    values = []
    for field, kinds, what in ((text_field, (str,), "a string"), (id_field, (str, int), "a string or an integer")):
        if field is None:
            values.append(None)
            continue
        if field not in record:
            raise CorpusError(f"{where} has no field {field!r} (its fields: {', '.join(map(repr, record)) or 'none'})")
        value = record[field]
        if not isinstance(value, kinds) or isinstance(value, bool):
            raise CorpusError(f"{where}: field {field!r} is {json.dumps(value)[:40]}, not {what}")
        values.append(value)
    return values[0], None if values[1] is None else str(values[1])


def read_split(root: str, file: CorpusFile, split: Split, text_field: str,
               id_field: str | None) -> tuple[list[str], list[str]]:
    """(texts, ids) of the split's rows, in file order."""
    path = full_path(root, file.path)
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise CorpusError(f"{path}: the file is gone since the job was planned") from None
    if (stat.st_size, stat.st_mtime_ns) != (file.size, file.mtime_ns):
        raise CorpusError(f"{path}: the file changed since the job was planned (size or modification time)")
    if file.format == "parquet":
        return _read_parquet_rows(path, file.path, split, text_field, id_field)
    texts, ids = [], []
    with open(path, "rb") as f:
        f.seek(split.offset)
        for k in range(split.rows):
            raw = f.readline()
            number = split.first_row + k + 1
            line = decode_line(raw[:-1] if raw.endswith(b"\n") else raw, path, number)
            if file.format == "jsonl":
                text, identifier = parse_jsonl(line, path, number, text_field, id_field)
            else:
                text, identifier = line, None
            texts.append(text)
            ids.append(identifier if identifier is not None else f"{file.path}:{number}")
    return texts, ids


def _read_parquet_rows(path: str, rel: str, split: Split, text_field: str,
                       id_field: str | None) -> tuple[list[str], list[str]]:
    """Rows [first_row, first_row + rows) of a Parquet file: only the row groups that hold them, only the needed
    columns, read in batches until the last row is reached."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    meta = parquet.metadata
    groups, group_start, start = [], 0, None
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if group_start + n > split.first_row and group_start < split.first_row + split.rows:
            groups.append(g)
            start = group_start if start is None else start
        group_start += n
    columns = [text_field] + ([id_field] if id_field and id_field != text_field else [])
    texts, ids, position = [], [], start
    for batch in parquet.iter_batches(batch_size=8192, row_groups=groups, columns=columns):
        lo = max(split.first_row - position, 0)
        hi = min(split.first_row + split.rows - position, batch.num_rows)
        if hi > lo:
            part = batch.slice(lo, hi - lo)
            for column, out in ((text_field, texts), (id_field, ids)):
                if column is None:
                    continue
                values = part.column(column).to_pylist()
                if None in values:
                    row = split.first_row + len(out) + values.index(None) + 1
                    raise CorpusError(f"{path}: row {row}: column {column!r} is null")
                out.extend(values if column == text_field else map(str, values))
        position += batch.num_rows
        if position >= split.first_row + split.rows:
            break
    if not id_field:
        ids = [f"{rel}:{split.first_row + k + 1}" for k in range(len(texts))]
    return texts, ids
