"""Argparse types for the command lines' counts and sizes: a bad value is refused while the flags are parsed,
with argparse's usage line and the flag's name (`argument --block-size: must be an integer >= 1, got '0'`),
instead of a traceback or a silently empty run later.

    parser.add_argument("--block-size", type=positive_int, default=64)
    parser.add_argument("--memory-gib", type=positive_float, default=1.0)
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable


def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count, a size in tokens)."""
    return _integer(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a seed)."""
    return _integer(text, 0)


_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG])")
_SCALE = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_readable_int(text: str) -> int:
    """An integer >= 1, also written as vLLM writes token counts: 32k = 32,000, 32K = 32,768, 25.6k = 25,600 (a
    decimal only with a lower-case suffix, as vLLM's `human_readable_int`)."""
    found = _HUMAN.fullmatch(text.strip())
    if found is None:
        return positive_int(text)
    number, suffix = found.groups()
    if "." in number and suffix.isupper():
        raise argparse.ArgumentTypeError(f"a binary suffix ({suffix}) takes a whole number, got {text!r}")
    value = float(number) * _SCALE[suffix]
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of tokens >= 1, got {text!r}")
    return int(value)


def model_len(text: str) -> int | None:
    """`--max-model-len`: `human_readable_int`, or "auto" / -1 (vLLM's "as much as fits"; here None: the model's
    own length, the default)."""
    return None if text.strip().lower() in ("auto", "-1") else human_readable_int(text)


def _number(text: str, what: str, ok: Callable[[float], bool]) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a memory size, a bandwidth, a rate)."""
    return _number(text, "a finite number > 0", lambda value: value > 0)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a size that may be 0, a timeout)."""
    return _number(text, "a finite number >= 0", lambda value: value >= 0)


def unit_fraction(text: str) -> float:
    """A number in [0, 1] (a fraction of a prompt)."""
    return _number(text, "a number in [0, 1]", lambda value: 0 <= value <= 1)


def ratio_at_least_one(text: str) -> float:
    """A finite number >= 1 (how many times as much)."""
    return _number(text, "a finite number >= 1", lambda value: value >= 1)


def http_url(text: str) -> str:
    """An http:// or https:// URL with a host (a replica's base URL), kept as written."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL, got {text!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL such as http://127.0.0.1:8001, "
                                         f"got {text!r}")
    return text


def port_number(text: str) -> int:
    """A TCP port to bind: 0 (any free one) to 65535."""
    value = _integer(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {text!r}")
    return value


def positive_floats(text: str) -> tuple[float, ...]:
    """A comma-separated list of finite numbers > 0 (`"0.5,1,2"`: memory points of a sweep)."""
    try:
        return tuple(positive_float(part) for part in text.split(","))
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{error} (in the list {text!r})") from None


def gib_or_multiple(text: str) -> str:
    """A size in GiB >= 0 (`"64"`) or a multiple >= 0 of another size (`"4x"`), checked and kept as written."""
    number = text.strip().lower().removesuffix("x")
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be GiB or a multiple such as 4x, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be GiB or a multiple such as 4x, >= 0, got {text!r}")
    return text


def json_object(text: str) -> dict:
    """A JSON object (`--chat-template-kwargs '{"enable_thinking": false}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value
