"""The recipes' data, read strictly: a row that does not parse, a value of another type than the rest of its
column or a file that is not UTF-8 is an error naming the file and line, never a merged, dropped or re-typed row.
Every byte of a value is kept: nothing is stripped, unquoted (a .tsv is TSV, not CSV) or normalised.

Standard library only, with fat5.files (which is too; see fat5/recipes/arguments.py): `datasets` is imported only for
--dataset_name.
"""

import csv
import json
import re
from array import array
from pathlib import Path

from fat5.cli import CommandError, error_line
from fat5.files import open_binary

FORMATS = (".csv", ".tsv", ".json", ".jsonl")
# How a .tsv is read: "none", as TSV (IANA text/tab-separated-values); "csv", with CSV quote rules.
TSV_QUOTING = ("none", "csv")
# The longest field read, in characters, unless --max_field_chars says otherwise: far above any text a model
# trains on, low enough that a CSV quote left open stops the reading long before the rest of a large file has
# become one field in memory.
MAX_FIELD_CHARS = 1 << 24
BYTE_ORDER_MARK = "\ufeff"
LONE_CR = re.compile(rb"(?<=\r)(?!\n)")


class Table:
    """The rows of one split as columns ({name: list}), with where each row stands for error messages: a file's
    line, or a row number."""

    def __init__(self, name, columns, lines=None, typed=True):
        self.name = name
        self.columns = columns
        self.lines = lines
        # Whether values carry their JSON / Arrow types: a CSV's are all text.
        self.typed = typed

    def __len__(self):
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def where(self, row):
        return f"{self.name}:{self.lines[row]}" if self.lines else f"{self.name} row {row + 1}"

    def head(self, count):
        """The first `count` rows."""
        lines = self.lines[:count] if self.lines else None
        return Table(self.name, {column: values[:count] for column, values in self.columns.items()}, lines,
                     self.typed)

    def column(self, name, flag):
        if name not in self.columns:
            raise CommandError(f"{self.name} has no column {name!r} (columns: {', '.join(self.columns)}); "
                               f"name it with {flag}")
        return self.columns[name]

    def texts(self, name, flag):
        """The values of a column that must hold non-empty text."""
        values = self.column(name, flag)
        for row, value in enumerate(values):
            if not isinstance(value, str) or not value.strip():
                raise CommandError(f"{self.where(row)}: column {name!r} is empty or not text ({value!r})")
        return values


def read_table(path, tsv_quoting="none", max_field_chars=MAX_FIELD_CHARS):
    """A .csv / .tsv / .json (a list of objects) / .jsonl file as a Table. A .csv, .tsv or .jsonl is read as a
    stream (memory holds the rows and about one record more); a .json is parsed whole by json."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise CommandError(f"{path}: unknown format (use {', '.join(FORMATS)})")
    with open_binary(path) as file:
        if suffix == ".json":
            columns, count = read_json(path, file, max_field_chars)
            lines = None
        else:
            if suffix == ".jsonl":
                columns, lines = read_jsonl(path, text_lines(path, file), max_field_chars)
            elif suffix == ".tsv" and tsv_quoting == "none":
                columns, lines = read_tsv(path, text_lines(path, file), max_field_chars)
            else:
                # The csv module ends a record at a lone "\r" too: split there, so that its line count stays ours.
                columns, lines = read_csv(path, text_lines(path, file, split_at_lone_cr=True),
                                          "\t" if suffix == ".tsv" else ",", max_field_chars)
            count = len(lines)
    if not count:
        raise CommandError(f"{path}: no rows{' (only a header?)' if suffix in ('.csv', '.tsv') else ''}")
    table = Table(str(path), columns, lines, typed=suffix in (".json", ".jsonl"))
    check_types(table)
    return table


def text_lines(path, file, split_at_lone_cr=False):
    """The lines of a UTF-8 file, each with its line end, decoded one at a time so that a byte that is not UTF-8
    names its line. A line ends at "\n" (UTF-8 never uses that byte inside a character), and with
    split_at_lone_cr also at a "\r" not followed by "\n"."""
    number = 0
    for raw in file:  # a binary file's lines end at b"\n" only
        for piece in LONE_CR.split(raw) if split_at_lone_cr and b"\r" in raw else (raw,):
            if not piece:  # what LONE_CR.split leaves after a "\r" that ends the file
                continue
            number += 1
            if b"\0" in piece:
                # UTF-16 text without a byte-order mark is valid UTF-8 with a NUL after every ASCII character.
                raise CommandError(f"{path}:{number}: a NUL byte (UTF-16 text?); save it as UTF-8")
            try:
                text = piece.decode("utf-8")
            except UnicodeDecodeError as error:
                raise CommandError(f"{path}:{number}: not UTF-8 text (byte 0x{piece[error.start]:02x}); save it "
                                   f"as UTF-8") from None
            # A spreadsheet's byte-order mark must not become part of the first column's name.
            yield text.removeprefix(BYTE_ORDER_MARK) if number == 1 else text


def read_csv(path, lines, delimiter, max_field_chars):
    """Columns and the line each row starts on. Quoted fields may span lines; a row with another number of
    fields than the header (an unclosed quote merges rows into one) is an error."""
    reader = csv.reader(lines, delimiter=delimiter, strict=True)
    # The csv module's limit is the process's: set for this file, then put back.
    previous_limit = csv.field_size_limit(max_field_chars)
    start = 1
    try:
        columns = header_columns(path, next(reader, None), delimiter, max_field_chars)
        starts = array("q")
        start = reader.line_num + 1
        for fields in reader:
            if fields and len(fields) != len(columns):
                raise CommandError(f"{path}:{start}: {len(fields)} fields where the header has {len(columns)} "
                                   f"({line_span(start, reader.line_num)}; an unclosed quote or an unquoted "
                                   f"{delimiter!r}?)")
            if fields:  # the csv module's reading of an empty line: no record
                for values, field in zip(columns.values(), fields, strict=True):
                    values.append(field)
                starts.append(start)
            start = reader.line_num + 1
    except csv.Error as error:
        # The csv module's words for a field over its limit (a field it has read up to the limit, not further).
        if str(error).startswith("field larger than field limit"):
            spans = reader.line_num > start
            raise field_too_long(f"{path}:{start}", max_field_chars, line_span(start, reader.line_num) + (
                "; a quote left open makes the rest of the file one field" if spans else "")) from None
        raise CommandError(f"{path}:{start}: not valid CSV ({error}; an unclosed quote?)") from None
    finally:
        csv.field_size_limit(previous_limit)
    return columns, starts


def read_tsv(path, lines, max_field_chars):
    """Columns and the line of each row, read as TSV (IANA text/tab-separated-values): a line is a row, a tab
    separates fields, nothing is quoted, so quote characters are data. An empty line is a row of one empty
    field, so an error where the header has more columns."""
    columns, starts = None, array("q")
    for number, line in enumerate(lines, 1):
        fields = without_line_end(line).split("\t")
        if columns is None:
            columns = header_columns(path, fields, "\t", max_field_chars)
            continue
        if len(fields) != len(columns):
            cause = "an empty line" if fields == [""] else "a tab missing or added, or a value cut by a line break"
            raise CommandError(f"{path}:{number}: {len(fields)} fields where the header has {len(columns)} "
                               f"({cause}?; a .tsv holds one row a line, --tsv_quoting csv reads quoted values)")
        check_lengths(f"{path}:{number}", fields, max_field_chars)
        for values, field in zip(columns.values(), fields, strict=True):
            values.append(field)
        starts.append(number)
    if columns is None:
        raise CommandError(f"{path}: file is empty")
    return columns, starts


def without_line_end(line):
    """A TSV line without its "\n" or "\r\n" (a Windows line end: a value never ends with that "\r")."""
    if line.endswith("\n"):
        return line[:-2] if line.endswith("\r\n") else line[:-1]
    return line


def header_columns(path, names, delimiter, max_field_chars):
    """{name: []} for a header's column names; a name given twice would merge two columns into one."""
    if names is None:
        raise CommandError(f"{path}: file is empty")
    if names in ([], [""]):
        raise CommandError(f"{path}:1: the first line, the header naming the columns, is empty")
    check_lengths(f"{path}:1", names, max_field_chars)
    if len(set(names)) != len(names):
        raise CommandError(f"{path}:1: the header names a column twice ({delimiter.join(names)})")
    return {name: [] for name in names}


def check_lengths(where, fields, max_field_chars):
    if fields and max(map(len, fields)) > max_field_chars:
        raise field_too_long(where, max_field_chars)


def field_too_long(where, max_field_chars, context=""):
    return CommandError(f"{where}: a field longer than --max_field_chars={max_field_chars} characters"
                        f"{f' ({context})' if context else ''}; raise --max_field_chars if it is meant to be")


def line_span(start, end):
    return f"lines {start}-{end}" if end > start else f"line {start}"


def read_jsonl(path, lines, max_field_chars):
    """Columns and the line of each row: one JSON object a line (JSON Lines). An empty line is an error, as
    for a TSV: a line is a row."""
    columns, starts = None, array("q")
    # Lines end at "\n" only: JSON strings may hold other characters str.splitlines() would break at.
    for number, line in enumerate(lines, 1):
        where = f"{path}:{number}"
        if not line.strip():
            raise CommandError(f"{where}: an empty line (JSON Lines holds one object a line)")
        try:
            row = json.loads(line, object_pairs_hook=json_object)
        except json.JSONDecodeError as error:
            raise CommandError(f"{where}: not JSON ({error.msg})") from None
        except RecursionError:
            raise too_deep(where) from None
        columns = add_row(columns, where, row, max_field_chars)
        starts.append(number)
    if columns is None:
        raise CommandError(f"{path}: file is empty")
    return columns, starts


def read_json(path, file, max_field_chars):
    """Columns and the number of rows of a .json file, one list of objects, parsed whole by the standard library's
    json (memory holds the file's text while it is parsed, then the rows)."""
    raw = file.read()
    try:
        text = raw.decode("utf-8").removeprefix(BYTE_ORDER_MARK)
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise CommandError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[error.start]:02x}); save it as UTF-8") \
            from None
    if not text.strip():
        raise CommandError(f"{path}: file is empty")
    try:
        rows = json.loads(text, object_pairs_hook=json_object)
    except json.JSONDecodeError as error:
        if error.msg.startswith("Unterminated string") and len(text) - error.pos > 12 * max_field_chars + 2:
            # A string longer than any field within the limit can be written (a character is at most 12 characters
            # of JSON, "\\ud83d\\ude00"): most likely one never closed.
            raise field_too_long(f"{path}:{error.lineno}", max_field_chars, "a JSON string never closed?") from None
        what = "more after the list" if error.msg == "Extra data" else error.msg
        raise CommandError(f"{path}:{error.lineno}: not JSON ({what})") from None
    except RecursionError:
        raise too_deep(path) from None
    if not isinstance(rows, list):
        raise CommandError(f"{path}: expected a list of objects, one a row")
    columns = None
    for number, row in enumerate(rows, 1):
        columns = add_row(columns, f"{path} row {number}", row, max_field_chars)
    return columns or {}, len(rows)


class KeyTwice(dict):
    """A JSON object that names a key twice, where json would keep the last value silently (`key`: one such)."""


def json_object(pairs):
    """json's object_pairs_hook: a JSON object as a dict, a KeyTwice when it names a key twice (refused with its
    row by `add_row`)."""
    row = dict(pairs)
    if len(row) != len(pairs):
        seen = set()
        row = KeyTwice(row)
        row.key = next(key for key, _ in pairs if key in seen or seen.add(key))
    return row


def key_twice(value):
    """A key that an object in the JSON value `value` names twice, or None."""
    if isinstance(value, KeyTwice):
        return value.key
    for child in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        key = key_twice(child)
        if key is not None:
            return key
    return None


def too_deep(where):
    return CommandError(f"{where}: not JSON this reader can read (nested too deeply)")


def add_row(columns, where, row, max_field_chars):
    """The columns ({key: list}, made from the first row's keys when None) with a JSON row appended. Every row
    is an object with the first row's keys: a key missing or added would drop or invent a value."""
    if not isinstance(row, dict):
        raise CommandError(f"{where}: expected an object, got {type(row).__name__}")
    try:
        twice = key_twice(row)
    except RecursionError:
        raise too_deep(where) from None
    if twice is not None:
        raise CommandError(f"{where}: an object names the key {twice!r} twice (one of its values would be dropped)")
    if columns is None:
        columns = {key: [] for key in row}
    elif row.keys() != columns.keys():
        missing = [key for key in columns if key not in row]
        extra = [key for key in row if key not in columns]
        raise CommandError(f"{where}: keys differ from the first row's (missing: {missing}, extra: {extra})")
    check_lengths(where, [value for value in row.values() if isinstance(value, str)], max_field_chars)
    for key, values in columns.items():
        values.append(row[key])
    return columns


def check_types(table):
    """One JSON type per column (null aside): a column mixing them would be re-typed by Arrow, or labels
    such as 1 and "1" confused."""
    for column, values in table.columns.items():
        first = {}
        for row, value in enumerate(values):
            if value is not None:
                first.setdefault(type(value), row)
        if len(first) > 1:
            (type_a, row_a), (type_b, row_b) = list(first.items())[:2]
            raise CommandError(f"{table.where(row_b)}: column {column!r} holds a {type_b.__name__} "
                               f"({values[row_b]!r}) where {table.where(row_a)} holds a {type_a.__name__}; "
                               f"use one type a column")


def load_dataset_splits(name, config, splits):
    """{split: Table} from a `datasets` dataset (Hub or local); each split is the first whose name starts like
    it (validation_matched, ...)."""
    import datasets

    try:
        loaded = datasets.load_dataset(name, config)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as error:
        raise CommandError(f"--dataset_name {name}: cannot load it ({error_line(error)})") from None
    tables = {}
    for split in splits:
        found = next((candidate for candidate in loaded if candidate.startswith(split[:4])), None)
        if found is None:
            raise CommandError(f"--dataset_name {name} has no {split} split (splits: {', '.join(loaded)})")
        tables[split] = Table(f"--dataset_name {name} split {found}", loaded[found].to_dict())
    return tables


def write_predictions(path, columns):
    """A CSV with one column per entry of `columns` ({name: list}), written whole then renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(list(columns))
            writer.writerows(zip(*columns.values(), strict=True))
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def exact_match(predictions, references):
    return {"accuracy": sum(p == r for p, r in zip(predictions, references, strict=True)) / len(references)}
