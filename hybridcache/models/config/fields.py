"""Readers of config.json values: a file's JSON object, token ids, booleans, `Fields` (the text model's fields read
with transformers' defaults), and `time_step_limit`'s pair; a malformed value is a ValueError naming config.json
and the field."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object `path` holds; ValueError naming the file when it is not valid JSON or not an object."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def token_ids(value: Any, field: str) -> tuple[int, ...]:
    """An `eos_token_id` as written (null, a token id or a list of them) as a tuple of ids; ValueError naming
    `field` (file and key) for anything else."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"{field} {value!r} must be a token id or a list of token ids")
    return tuple(ids)


def boolean(value: Any, key: str, default: bool) -> bool:
    """A config.json boolean field: true or false, `default` for null or left out; anything else (the string
    "false", 0) is a ValueError naming config.json and the field, as transformers' strict configuration refuses."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config.json {key} {value!r} must be true or false")
    return value


@dataclass(frozen=True)
class Fields:
    """The text model's fields of config.json (`section`) read with transformers' `defaults` for those left out
    or null; a value of the wrong type or range is a ValueError naming config.json and the field."""

    section: Mapping[str, Any]
    defaults: Mapping[str, Any]

    def value(self, key: str) -> Any:
        value = self.section.get(key)
        return self.defaults.get(key) if value is None else value

    def integer(self, key: str, minimum: int = 1) -> int:
        value = self.value(key)
        if value is None:
            raise ValueError(f"config.json has no {key!r}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config.json {key} {value!r} is not an integer")
        if value < minimum:
            raise ValueError(f"config.json {key} {value} must be at least {minimum}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        return boolean(self.section.get(key), key, default)

    def number(self, key: str) -> float:
        value = self.value(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"config.json {key} {value!r} is not a number >= 0")
        return float(value)


def time_step_limit(value: Any) -> tuple[float, float]:
    """config.json's `time_step_limit`: null (no limit), or [low, high] with each bound a number, "Infinity" or
    transformers' {"__float__": "Infinity"}; 0 <= low <= high."""
    if value is None:
        return (0.0, float("inf"))

    def bound(item: Any) -> float:
        if isinstance(item, Mapping) and set(item) == {"__float__"}:
            item = item["__float__"]
        if isinstance(item, str) and item.lower() in ("infinity", "inf"):
            return float("inf")
        if isinstance(item, bool) or not isinstance(item, int | float):
            raise ValueError(f"config.json time_step_limit {value!r} must be a pair of numbers")
        return float(item)

    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"config.json time_step_limit {value!r} must be a pair of numbers")
    low, high = bound(value[0]), bound(value[1])
    if not 0 <= low <= high:
        raise ValueError(f"config.json time_step_limit {value!r} must be 0 <= low <= high")
    return (low, high)
