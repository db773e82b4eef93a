"""The recipes' data, read strictly: a row that does not parse, a value of another type than the rest of its
column or a file that is not UTF-8 is an error naming the file and line, never a merged, dropped or re-typed row.

Standard library only (see recipes/arguments.py): `datasets` is imported only for --dataset_name.
"""

import csv
import io
import json
from pathlib import Path

from convert.cli import CommandError, error_line
from convert.files import read_bytes

FORMATS = (".csv", ".tsv", ".json", ".jsonl")


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


def read_table(path):
    """A .csv / .tsv / .json (a list of objects) / .jsonl file as a Table."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise CommandError(f"{path}: unknown format (use {', '.join(FORMATS)})")
    raw = read_bytes(path)
    try:
        # utf-8-sig: a spreadsheet's byte-order mark must not become part of the first column's name.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        raise CommandError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[error.start]:02x}); save it as UTF-8") \
            from None
    if not text.strip():
        raise CommandError(f"{path}: file is empty")
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        rows, lines = read_csv(path, text, "\t" if suffix == ".tsv" else ",")
    elif suffix == ".jsonl":
        rows, lines = read_jsonl(path, text)
    else:
        rows, lines = read_json(path, text), None
    if not rows:
        raise CommandError(f"{path}: no rows (only a header?)")
    table = Table(str(path), {column: [row[column] for row in rows] for column in rows[0]}, lines,
                  typed=suffix in (".json", ".jsonl"))
    check_types(table)
    return table


def read_csv(path, text, delimiter):
    """Rows as dicts and the line each starts on. Quoted fields may span lines; a row with another number of
    fields than the header (an unclosed quote merges rows into one) is an error."""
    # newline="": line ends inside quoted fields are kept as written, as the csv module requires.
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    rows, lines = [], []
    start = 1
    try:
        header = next(reader)
        start = reader.line_num + 1
        for fields in reader:
            if fields and len(fields) != len(header):
                spans = f"lines {start}-{reader.line_num}" if reader.line_num > start else f"line {start}"
                raise CommandError(f"{path}:{start}: {len(fields)} fields where the header has {len(header)} "
                                   f"({spans}; an unclosed quote or an unquoted '{delimiter}'?)")
            if fields:
                rows.append(dict(zip(header, fields, strict=True)))
                lines.append(start)
            start = reader.line_num + 1
    except csv.Error as error:
        raise CommandError(f"{path}:{start}: not valid CSV ({error}; an unclosed quote?)") from None
    if len(set(header)) != len(header):
        raise CommandError(f"{path}:1: the header names a column twice ({delimiter.join(header)})")
    return rows, lines


def read_jsonl(path, text):
    rows, lines = [], []
    # Lines end at "\n" only: JSON strings may hold other characters str.splitlines() would break at.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise CommandError(f"{path}:{number}: not JSON ({error.msg})") from None
        check_row(path, f"{path}:{number}", row, rows)
        rows.append(row)
        lines.append(number)
    return rows, lines


def read_json(path, text):
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as error:
        raise CommandError(f"{path}:{error.lineno}: not JSON ({error.msg})") from None
    if not isinstance(rows, list):
        raise CommandError(f"{path}: expected a list of objects, one a row")
    for number, row in enumerate(rows, 1):
        check_row(path, f"{path} row {number}", row, rows[:number - 1])
    return rows


def check_row(path, where, row, previous):
    """Every row is an object with the first row's keys: a key missing or added would drop or invent a value."""
    if not isinstance(row, dict):
        raise CommandError(f"{where}: expected an object, got {type(row).__name__}")
    if previous and list(row) != list(previous[0]):
        missing = [key for key in previous[0] if key not in row]
        extra = [key for key in row if key not in previous[0]]
        if missing or extra:
            raise CommandError(f"{where}: keys differ from the first row's (missing: {missing}, extra: {extra})")


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
