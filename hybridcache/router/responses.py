"""Stored responses behind a router: which replica holds each one, and the prompt a Responses request predicts.

`POST /v1/responses` stores its answer (`store`, the default) on the replica that served it, and only there
(server/responses_api.py keeps it in that process's memory). A request that continues it (`previous_response_id`)
or reads it (`GET /v1/responses/{id}`) must go to that replica: any other one answers 404. Both routers (app.py
and the Ray Serve ingress, ray_serve.py) therefore

    learn     the id of every response they relay, from the JSON body (`response_id`) or from the first event of a
              stream (`StreamHead`, `response.created`), into a bounded map id -> replica (`ResponseOwners`);
    route     a request that names a stored response to that replica alone, with no retry elsewhere (no other
              replica has the conversation); an id they do not know (the router restarted, another ingress
              replica relayed it, the map dropped it) is looked up by asking each replica `GET /v1/responses/{id}`
              (no side effects); an id no replica has goes to any replica, which answers 404 itself.

A Responses request that continues nothing is routed as a chat request: its prompt is the chat body the replica
will run (`chat_request`), rendered and predicted as any chat prompt (router/prompts.py). One that continues a
stored response has no prompt here (the conversation is on its replica) and no prediction.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

RESPONSES_PATH = "/v1/responses"
MAX_OWNERS = 65536  # ids remembered (each replica keeps its newest 1,024: responses_api.MAX_STORED)
MAX_STREAM_HEAD = 1 << 16  # bytes of a stream read for its first event's response id


def continued_id(path: str, body: Any) -> str | None:
    """The stored response a request continues: a Responses body's `previous_response_id`, else None."""
    if path != RESPONSES_PATH or not isinstance(body, dict):
        return None
    previous = body.get("previous_response_id")
    return previous if isinstance(previous, str) and previous else None


def routed_cache_salt(body: Any) -> str | None:
    """The cache salt a request's hits are predicted under (vLLM's `cache_salt`: part of the replica's cache root,
    cache.md "Cache salts"): the body's, when a non-empty string (anything else the replica refuses), else None."""
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    return salt if isinstance(salt, str) and salt else None


def stores(body: Any) -> bool:
    """Whether the replica stores the answer to this Responses body (`store` defaults to true)."""
    return not (isinstance(body, dict) and body.get("store") is False)


def response_id(content: bytes) -> str | None:
    """The id of a Responses JSON answer (`{"object": "response", "id": ...}`), None for anything else."""
    try:
        answer = json.loads(content)
    except (RecursionError, ValueError, UnicodeDecodeError):
        return None
    if isinstance(answer, dict) and answer.get("object") == "response" and isinstance(answer.get("id"), str):
        return answer["id"]
    return None


class StreamHead:
    """Reads a Responses event stream's head for the response id: `feed(chunk)` returns the id once the first
    event that carries one (`response.created`, whose `response.id` it is) has arrived whole, then None ever
    after; gives up after `MAX_STREAM_HEAD` bytes."""

    def __init__(self) -> None:
        self._head = b""
        self._done = False

    def feed(self, chunk: bytes) -> str | None:
        if self._done:
            return None
        self._head += chunk
        events = self._head.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events[:-1]:  # whole events only
            for line in event.split(b"\n"):
                if not line.startswith(b"data: {"):
                    continue
                try:
                    data = json.loads(line[6:])
                except (RecursionError, ValueError, UnicodeDecodeError):
                    continue
                response = data.get("response") if isinstance(data, dict) else None
                if isinstance(response, dict) and isinstance(response.get("id"), str):
                    self._done, self._head = True, b""
                    return response["id"]
        if len(self._head) > MAX_STREAM_HEAD:
            self._done, self._head = True, b""
        return None


class ResponseOwners:
    """The replica (a URL, a Ray replica id) that answered each stored response, the newest `capacity` ids."""

    def __init__(self, capacity: int = MAX_OWNERS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def put(self, response_id: str, owner: str) -> None:
        self._owners[response_id] = owner
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def get(self, response_id: str) -> str | None:
        return self._owners.get(response_id)

    def __len__(self) -> int:
        return len(self._owners)
