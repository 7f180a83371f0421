"""Reading the trace files of the workloads with errors that say where: `json_records` (one JSON object per line,
or a file that is one JSON array of them), `json_file`, and the checked fields `integer` and `items_of`.
Every error is a ValueError `"{path}:{line}: {what is wrong}"` (line 1 for a whole-file document)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def json_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(where, object) for each record of `path`, `where` being `"{path}:{line}"`: one JSON object per non-blank
    line (.jsonl), or, when the file starts with `[`, one JSON array of objects (the ShareGPT V3 download's
    layout; `where` then names the array index). A line that is not JSON, or a record that is not an object, is
    a ValueError naming its line."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.read(1)
            while first and first.isspace():
                first = f.read(1)
            f.seek(0)
            if first == "[":
                for index, record in enumerate(json_file(path)):  # it starts with `[`: a list when it is JSON
                    where = f"{path}:1: record {index}"
                    yield where, _object(record, where)
                return
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{where}: not a JSON line ({error.msg} at column {error.colno})") from None
                yield where, _object(record, where)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start} of a read)") from None


def json_file(path: str | Path) -> Any:
    """The JSON document of `path`; a ValueError `"{path}:{line}: ..."` when it is not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: not JSON ({error.msg} at column {error.colno})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def _object(record: Any, where: str) -> dict:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def integer(record: dict, key: str, where: str, minimum: int | None = None) -> int:
    """`record[key]` as an int: a JSON integer (or a float with no fraction, 100.0), at least `minimum`;
    a ValueError naming `where` and the key when it is missing or anything else."""
    if key not in record:
        raise ValueError(f"{where}: missing {key!r}")
    value = record[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {key!r} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: {key!r} must be >= {minimum}, got {value}")
    return value


def items_of(record: dict, key: str, where: str) -> list:
    """`record[key]`, which must be a JSON array (missing: a ValueError naming `where` and the key)."""
    if key not in record:
        raise ValueError(f"{where}: missing {key!r}")
    value = record[key]
    if not isinstance(value, list):
        raise ValueError(f"{where}: {key!r} must be a list, got {type(value).__name__}")
    return value
