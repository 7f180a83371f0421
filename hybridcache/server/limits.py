"""What one client may make the server hold: connections, time to send a request, prompts per request, places
in the engine's waiting queue, and a request's run time. Each limit refuses early, before the work it
guards is done, with an error that names the limit.

    connection opens   -> over `limit_concurrency` open connections: the oldest one not running a request (still
                          sending one, or idle) is closed first, else the new one (connections.py)
    request arrives    -> its headers and body must arrive within `request_read_timeout_s` (connections.py)
    body parsed        -> a prompt text over `max_model_len x max_token_bytes` bytes is refused before tokenizing
                          (it cannot fit); `prompts x n` over `max_request_sequences` is refused
    engine admission   -> over `max_queued_requests` waiting sequences: 503 with `Retry-After` (engine_loop.py)
    while it runs      -> past `request_timeout_s` it is aborted: 503 (or a final error event in a stream)
"""

from __future__ import annotations

import argparse
import logging
import resource
from dataclasses import dataclass
from typing import Any

from hybridcache.images import MediaLimits
from hybridcache.server.errors import APIError

logger = logging.getLogger("hybridcache.server")
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
FD_RESERVE = 64  # file descriptors kept for the process itself (model files, logs, worker pipes)


@dataclass(frozen=True)
class ServerLimits:
    """Limits on what outside traffic may make the server hold (see the module docstring).

    limit_concurrency: the most open connections (None: the process's file-descriptor limit less a reserve,
    at most 1024). timeout_keep_alive_s: an idle keep-alive connection is closed after this (uvicorn's).
    request_read_timeout_s: a request's headers and body must arrive within this many seconds (from its first
    byte, or from the connection's opening) or the connection is closed. max_request_sequences: the most
    sequences (prompts x n) one request may hold. max_queued_requests: the most sequences waiting for the
    engine (a request with n choices counts n); a request that would pass it gets 503 with `Retry-After`
    (None: no limit). request_timeout_s: a request still running after this many seconds is aborted (None: no
    limit).
    """

    limit_concurrency: int | None = None
    timeout_keep_alive_s: float = 5.0
    request_read_timeout_s: float = 30.0
    max_request_sequences: int = 256
    max_queued_requests: int | None = None
    request_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("limit_concurrency", "max_queued_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {value}")
        if self.max_request_sequences < 1:
            raise ValueError(f"max_request_sequences must be >= 1, got {self.max_request_sequences}")
        for name in ("timeout_keep_alive_s", "request_read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 (or None), got {self.request_timeout_s}")

    def connection_cap(self) -> int:
        """`limit_concurrency`, or the default: the soft file-descriptor limit less `FD_RESERVE`, at most 1024.
        Warns when a given limit leaves fewer than `FD_RESERVE` descriptors to the process."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        room = 1 << 30 if soft == resource.RLIM_INFINITY else soft - FD_RESERVE
        if self.limit_concurrency is None:
            return max(1, min(1024, room))
        if self.limit_concurrency > room:
            logger.warning("--limit-concurrency %d leaves fewer than %d of the %d file descriptors (ulimit -n) to "
                           "the process: raise ulimit -n, or lower the limit", self.limit_concurrency, FD_RESERVE,
                           soft)
        return self.limit_concurrency


class QueueFull(Exception):
    """The engine's waiting queue is at `max_queued_requests`: nothing was queued (a 503 with Retry-After)."""


class RequestTimeout(Exception):
    """A request ran past `request_timeout_s` (it is aborted: a 503, or a final error event in a stream)."""


def queue_full_error(message: str) -> APIError:
    return APIError(503, f"{message}; retry in {RETRY_AFTER_S} s", code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def max_token_bytes(tokenizer: Any) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token of `tokenizer` stands for: the longest vocabulary
    entry (special tokens included) in UTF-8, or None when the tokenizer does not say. A vocabulary entry is
    never shorter than the text it covers: byte-level BPE writes a byte as one character of one or two bytes,
    SentencePiece writes a space as the 3-byte "▁", byte-fallback tokens are "<0xE4>". So a text of more than
    `max_model_len` times this many bytes has at least `max_model_len` tokens and is refused without
    tokenizing it (unless the tokenizer's normalizer deletes characters: such text is refused by its size).
    """
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        return None
    return max(1, *(len(piece.encode("utf-8")) for piece in backend.get_vocab(with_added_tokens=True)))


def context_length_message(max_model_len: int, prompt_len: int, max_tokens: int | None = None) -> str:
    """vLLM's words for a request that does not fit the context (clients such as litellm match the opening
    "This model's maximum context length is"): the prompt alone (`max_tokens` None), or prompt + max_tokens."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if max_tokens is None:
        return head + f"your request has {prompt_len} input tokens. Please reduce the length of the input messages."
    return head + (f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in "
                   "the completion). Please reduce the length of the messages or completion.")


# The default body limit: room for the images one prompt may carry by default (8 of at most 20 MB each, as
# base64: 213 MiB) and a long agent history with tools. `media_request_bytes` says what a configuration needs.
DEFAULT_MAX_REQUEST_BYTES = 256 << 20


def media_request_bytes(images: MediaLimits) -> int:
    """The body bytes that the most images one prompt may carry take as base64 data URIs (each at its largest)."""
    return images.max_images * (-(-images.max_bytes // 3) * 4 + 1024)


TRUNCATION_MARGIN_TOKENS = 64  # tokens of text kept before a truncated prompt's last ones (`truncation_tail`)


def truncation_tail(text: str, keep: int, limit_bytes: int | None, max_model_len: int) -> str:
    """The end of `text` that holds its last `keep` tokens and `TRUNCATION_MARGIN_TOKENS` more, so that a prompt
    truncated to `keep` tokens (`truncate_prompt_tokens`) is tokenized by its end only, not whole: it passes no size
    check (it may be of any length), and a 32 MB prompt took 21 s and 5 GB to tokenize. A token stands for at most
    `limit_bytes / max_model_len` bytes (`max_token_bytes`), a character is at least one byte, so that many
    characters per token hold the last tokens; the margin's first tokens, which the cut may merge otherwise, are
    dropped by the truncation. `limit_bytes` None (the tokenizer does not say): `text` whole."""
    if limit_bytes is None:
        return text
    window = (keep + TRUNCATION_MARGIN_TOKENS) * max(1, limit_bytes // max_model_len)
    return text if len(text) <= window else text[-window:]


def check_prompt_bytes(prompts: list[str | list[int]], limit_bytes: int | None, max_model_len: int,
                       param: str) -> None:
    """Refuse (400, `context_length_exceeded`) a prompt text that cannot fit `max_model_len` tokens, by its size
    alone (token-id prompts are not looked at). `limit_bytes`: `max_model_len x max_token_bytes` (None: no
    check). The error names `param`, or `param.i` for prompt i of a batch."""
    if limit_bytes is None:
        return
    for i, text in enumerate(prompts):
        # a character is at most 4 UTF-8 bytes: only long texts need encoding to be measured
        if not isinstance(text, str) or len(text) <= limit_bytes // 4:
            continue
        if len(text.encode("utf-8", "replace")) > limit_bytes:
            where = f"{param}.{i}" if len(prompts) > 1 else param
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                           f"request's prompt is too long: its {len(text)} characters cannot fit in {max_model_len} "
                           f"tokens (no token of this model stands for more than {limit_bytes // max_model_len} "
                           "bytes). Please reduce the length of the input messages.", param=where,
                           code="context_length_exceeded")


async def read_body(request: Any, limit_bytes: int) -> bytes:
    """The body of a Starlette `request`, refused (413) as soon as it passes `limit_bytes`: by its declared
    Content-Length before a byte is read, else while it arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {limit_bytes} bytes")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit_bytes:
            raise APIError(413, f"the request body is over the limit of {limit_bytes} bytes")
    return bytes(body)


def check_sequences(num_prompts: int, n: int, limits: ServerLimits) -> None:
    """Refuse (400) a request of more sequences (prompts x n) than `max_request_sequences`, or than
    `max_queued_requests` (it could never be queued)."""
    cap = min(limits.max_request_sequences, limits.max_queued_requests or limits.max_request_sequences)
    if num_prompts * n > cap:
        raise APIError(400, f"the request holds {num_prompts} prompt(s) x n = {n}: {num_prompts * n} sequences; a "
                       f"request may hold at most {cap} (--max-request-sequences, --max-queued-requests)",
                       param="prompt" if num_prompts > 1 else "n")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags of `ServerLimits` (defaults from the dataclass)."""
    d = ServerLimits()
    add_connection_args(parser)
    parser.add_argument("--max-request-sequences", type=int, default=d.max_request_sequences, metavar="N",
                        help="the most sequences (prompts x n) one request may hold")
    parser.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests, metavar="N",
                        help="the most sequences waiting for the engine; a request over it gets 503 with Retry-After "
                             "(default: no limit)")
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout_s, metavar="SECONDS",
                        help="abort a request still running after this long: 503, or an error event in a stream "
                             "(default: no limit)")


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `ServerLimits`' connection limits (`serve` and `router` both take them)."""
    d = ServerLimits()
    parser.add_argument("--limit-concurrency", type=int, default=None, metavar="N",
                        help="the most open connections; over it the oldest connection not running a request (still "
                             "sending one, or idle) is closed, else the new one (default: the file-descriptor limit "
                             "less 64, at most 1024)")
    parser.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive_s, metavar="SECONDS",
                        help="close an idle keep-alive connection after this long")
    parser.add_argument("--request-read-timeout", type=float, default=d.request_read_timeout_s, metavar="SECONDS",
                        help="close a connection whose request headers and body have not all arrived this long after "
                             "its first byte")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """The `ServerLimits` the parsed `add_limit_args` flags describe (only the connection limits when the parser
    had just `add_connection_args`: the others keep their defaults)."""
    d = ServerLimits()
    return ServerLimits(
        limit_concurrency=args.limit_concurrency, timeout_keep_alive_s=args.timeout_keep_alive,
        request_read_timeout_s=args.request_read_timeout,
        max_request_sequences=getattr(args, "max_request_sequences", d.max_request_sequences),
        max_queued_requests=getattr(args, "max_queued_requests", d.max_queued_requests),
        request_timeout_s=getattr(args, "request_timeout", d.request_timeout_s),
    )
