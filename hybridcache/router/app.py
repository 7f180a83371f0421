"""The router's HTTP front: OpenAI routes forwarded to the replica with the longest usable hit.

    POST /v1/completions, /v1/chat/completions   tokenized here (server/prompt_ids.py) to predict each
                                                 replica's hit, forwarded unchanged to the chosen one;
                                                 streams pass through chunk by chunk
    POST /v1/responses                           the same, rendered as the chat request it runs as; one with
                                                 `previous_response_id` goes to the replica that stored that
                                                 response, alone (router/responses.py)
    GET  /v1/responses/{id}                      from the replica that stored it
    POST /v1/messages                            Anthropic's Messages API: the same, rendered as the chat request
                                                 it runs as (server/anthropic_protocol.py); its errors, the
                                                 router's own included, in Anthropic's shape
    POST /v1/messages/count_tokens               from the first up replica (of the body's `model`) that answers
    POST /invocations                            SageMaker's: predicted as the chat or completion request its body
                                                 is (`messages` or `prompt`), sent on as /invocations
    GET  /v1/models                              every up replica's cards, merged
    POST /tokenize, /detokenize; GET /version    from the first up replica (of the body's `model`) that answers
    POST /v1/cache/match                         from the replica the body would be routed to
    GET|POST /ping; GET /load                    200 while a replica is up; the requests in flight here
    GET  /health                                 200 while a replica is up; each one's state with the API key
    GET  /metrics                                Prometheus text (docs/server.md, "Several replicas"); open,
                                                 as a replica's (and vLLM's) /metrics is; under serve
                                                 --data-parallel-size with every replica's own (`engine_metrics`)

What a client may make the router hold is bounded as for a replica (server/limits.py, connections.py): bodies
of at most `max_request_bytes`, read with a deadline, a capped number of connections (`run_router` runs uvicorn
with the server's guarded protocol), and prompts rendered and tokenized on the router's own threads, off the
event loop (router/prompts.py): a prompt text the replicas would refuse by its size is not tokenized at all.

Faults: a replica that cannot be reached, or answers 502/503/504, before the first byte of its response is
marked down (router/replicas.py) and the request goes to the next-best replica, each replica at most once. A
stream cut after its first byte ends with an error event and `data: [DONE]` after its last whole event
(`EventRelay`). A replica that took the request
but sends nothing for `request_timeout_s` (a read or write timeout) is slow, not down: the request is closed
(the replica aborts it) and answered 504, or its stream ends with a 504 error event; it is not sent again. A
client that disconnects before its response, streamed or not, closes the request to the replica, which aborts
it (the router logs a 499, as a replica does); one gone while sending its body is logged in one INFO line (a 499),
not uvicorn's traceback. After each response the router
polls that replica's events before returning the last bytes, so the next turn of a conversation is routed
with the checkpoint this one saved; a background task per replica polls it every `poll_interval_s`.

Shutdown (`--shutdown-timeout`), as serve's: what still runs when the grace period ends is cancelled; a stream
ends with the final error event ("the server shut down before this request finished") and `data: [DONE]`, any
other request not yet answered gets 503 with that message (`ShutdownGuard`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hybridcache.router.policy import Chooser, RoutingConfig
from hybridcache.router.prompts import PromptLimits, routed_prompt_ids
from hybridcache.router.replicas import Replica, ReplicaCounters
from hybridcache.router.responses import (
    RESPONSES_PATH,
    ResponseOwners,
    StreamHead,
    continued_id,
    response_id,
    routed_cache_salt,
    stores,
)
from hybridcache.server.anthropic_protocol import COUNT_TOKENS_PATH, MESSAGES_PATH, anthropic_error_body, sent_keys
from hybridcache.server.errors import NO_RETRY, APIError, error_body
from hybridcache.server.limits import DEFAULT_MAX_REQUEST_BYTES, max_token_bytes, read_body
from hybridcache.server.responses import sse
from hybridcache.server.shutdown_guard import SHUTDOWN_MESSAGE, ShutdownGuard
from hybridcache.server.streaming import ClientGone, run_until_disconnect

logger = logging.getLogger("hybridcache.router")
RETRY_STATUSES = (502, 503, 504)
FORWARDED_HEADERS = ("authorization", "x-api-key", "content-type")
TOKENIZE_THREADS = 2  # the router's own threads that render and tokenize prompts (as a replica's TOKENIZER_THREADS)
MAX_HELD_EVENT_BYTES = 16 << 20  # an unfinished event held back longer than this is passed on as it is
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")  # the blank line that ends a server-sent event
_USAGE = re.compile(rb'"usage":\s*\{')  # an event that carries a usage object (not `"usage": null`)
# Past `request_timeout_s`, a replica that took the request is slow, not down: the request is not sent again
_ACCEPTED_TIMEOUTS = (httpx.ReadTimeout, httpx.WriteTimeout)


def replica_verdict(status: int, headers: Mapping[str, str], content: bytes) -> str:
    """What a replica's 502 / 503 / 504 means for the request: "answer" (its own outcome, passed to the client as it
    is: a 503 marked `x-should-retry: false` (`errors.NO_RETRY`), or with code `request_timeout`: the request ran
    past the replica's `--request-timeout` and was aborted; Anthropic's error object has no code, hence the header),
    "busy" (a 503 with `Retry-After`: the replica is up and its queue is full; another replica is tried and this
    one stays up, its index kept) or "down" (anything else: a dead or stopping engine, a gateway error; the replica
    is marked down and another tried)."""
    if status == 503:
        if {key.lower(): value for key, value in headers.items()}.get("x-should-retry", "").lower() == "false":
            return "answer"
        with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
            if json.loads(content)["error"]["code"] == "request_timeout":
                return "answer"
        if "retry-after" in {key.lower() for key in headers}:
            return "busy"
    return "down"


def _shut_down(content: bytes) -> bool:
    """Whether a replica's error answer is its shutdown's: the request ran when the replica shut down."""
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        return json.loads(content)["error"]["message"] == SHUTDOWN_MESSAGE
    return False


def _relayed(upstream: httpx.Response, content: bytes) -> Response:
    """A replica's error answer as the router sends it on: its status, body, content type, `Retry-After` and
    `x-should-retry` (`errors.NO_RETRY`)."""
    headers = {name: upstream.headers[name] for name in ("retry-after", "x-should-retry") if name in upstream.headers}
    return Response(content, status_code=upstream.status_code, headers=headers,
                    media_type=upstream.headers.get("content-type", "application/json"))


def display_url(url: str) -> str:
    """`url` without its userinfo (`http://user:secret@host:8001` -> `http://host:8001`): the name a replica is
    shown by in errors, logs, /health and /metrics labels; the credentials go to the HTTP client only
    (`ReplicaCredentials`)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class ReplicaCredentials(httpx.Auth):
    """HTTP basic auth for the replicas whose URL carries userinfo, as httpx applies a URL's own (the router's
    requests go to the URL without it, `display_url`): a request gets the credentials of the replica whose base URL
    it is under, the longest when several are (replicas behind one proxy under path prefixes, each with its own
    user, shared the last one's when they were keyed by origin)::

        http://alice:a@proxy:8080/replica-a   <-  GET http://proxy:8080/replica-a/v1/cache/events   (alice)
        http://bob:b@proxy:8080/replica-b     <-  GET http://proxy:8080/replica-b/v1/cache/events   (bob)
    """

    def __init__(self, urls: tuple[str, ...]) -> None:
        self._bases: list[tuple[tuple[str, str, int | None], str, httpx.BasicAuth | None]] = []
        for url in urls:
            parts, base = urlsplit(url), httpx.URL(display_url(url))
            auth = None
            if parts.username is not None or parts.password is not None:
                auth = httpx.BasicAuth(unquote(parts.username or ""), unquote(parts.password or ""))
            self._bases.append(((base.scheme, base.host, base.port), base.path.rstrip("/"), auth))

    def auth_flow(self, request: httpx.Request):
        origin, path = (request.url.scheme, request.url.host, request.url.port), request.url.path
        under = [(len(base), auth) for base_origin, base, auth in self._bases
                 if base_origin == origin and (path == base or path.startswith(base + "/"))]
        auth = max(under, key=lambda match: match[0])[1] if under else None
        if auth is None:
            yield request
        else:
            yield from auth.auth_flow(request)


@dataclass(frozen=True)
class RouterConfig:
    """replica_urls: base URLs (no /v1) of `hybridcache serve` replicas (userinfo in one is sent as basic auth,
    and never shown: `display_url`). poll_interval_s: background events
    polls. request_timeout_s: how long a forwarded request may wait for the replica's next bytes (and take to
    send), None for no limit (the default, as a replica's `--request-timeout`); past it the router answers 504
    (or ends a stream with a 504 error event), closing the request, which the replica then aborts; the replica
    stays up and the request is not sent to another one. routing: the policy and balance margins.
    api_key: the replicas' API key, sent with the router's own calls (events polls) and needed (it or one of
    `other_api_keys`, the replicas' further keys) for /health's details; clients' requests are forwarded with
    their own `Authorization` header, which the replicas check; the router refuses one without any of the keys
    (401) before it reads the body.
    max_request_bytes: a larger request body is refused (413) while it arrives, before it is read whole (default
    the replicas' own, `limits.DEFAULT_MAX_REQUEST_BYTES`). chat_template_kwargs: the replicas' default
    `chat_template_kwargs` (their `--chat-template-kwargs`), so that a chat renders here as there.
    allowed_origins: origins whose browser pages may call the router (CORS, as `hybridcache serve
    --allowed-origins`; empty: no CORS headers). engine_metrics: /metrics also carries every up replica's own
    metrics, each series labelled `engine` with the replica's index, as vLLM's data-parallel server has every
    engine's on its one /metrics (`serve --data-parallel-size`, whose replicas listen on loopback only)."""

    replica_urls: tuple[str, ...]
    routing: RoutingConfig = RoutingConfig()
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 2.0
    request_timeout_s: float | None = None
    api_key: str | None = None
    other_api_keys: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    allowed_origins: tuple[str, ...] = ()
    engine_metrics: bool = False

    def __post_init__(self) -> None:
        if not self.replica_urls:
            raise ValueError("the router needs at least one --replica URL")
        object.__setattr__(self, "replica_urls", tuple(u.rstrip("/") for u in self.replica_urls))
        shown = tuple(display_url(u) for u in self.replica_urls)
        if len(set(shown)) != len(shown):
            raise ValueError(f"replica URLs repeat: {shown}")
        for name in ("poll_interval_s", "poll_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if not (value is None and name == "request_timeout_s" or value is not None and value > 0):
                raise ValueError(f"{name} must be > 0, got {value}")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        object.__setattr__(self, "other_api_keys", tuple(self.other_api_keys))
        if self.other_api_keys and self.api_key is None:
            raise ValueError("other_api_keys need an api_key")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every key a client may send, `api_key` (the one the router polls with) first; empty: none needed."""
        return () if self.api_key is None else (self.api_key, *self.other_api_keys)


class RouterState:
    """Replicas, the chooser and the HTTP client (made in the lifespan)."""

    def __init__(self, config: RouterConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.replicas = [Replica(display_url(url)) for url in config.replica_urls]  # credentials: `client`'s
        self.chooser = Chooser(config.routing)
        self.client: httpx.AsyncClient | None = None
        self.poll_headers: dict[str, str] = {}
        self.num_retries = 0
        self.num_failed = 0
        self.owners = ResponseOwners()
        self.token_bytes = max_token_bytes(tokenizer)
        self.models: dict[str, list[dict]] = {}  # each up replica's /v1/models cards, learned once it is up
        # prompts are rendered and tokenized on these threads, not asyncio's default pool (which httpx and the
        # event loop's other work share): a few long prompts cannot hold up anything but other prompts
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZE_THREADS,
                                                                   thread_name_prefix="router-tokenize")

    async def poll_forever(self, replica: Replica, first_done: asyncio.Event) -> None:
        """`replica`'s background polls, every `poll_interval_s`, and its models once it is up: a loop of its own,
        so that a large snapshot of one replica holds up no other's polls (nor the router's start, which waits for
        `first_done` at most the poll timeout). An error is logged and the loop goes on."""
        while True:
            try:
                await replica.poll(self.client, self.config.poll_timeout_s, self.poll_headers)
                await self.learn_models([replica])
            except Exception:  # noqa: BLE001 - one failed poll must not end a replica's polls for good
                logger.exception("the background poll of replica %s failed", replica.url)
            first_done.set()
            await asyncio.sleep(self.config.poll_interval_s)

    async def learn_models(self, replicas: list[Replica] | None = None) -> None:
        """Ask each up replica (of `replicas`, default all) whose model cards are not known for its
        `GET /v1/models` (within the poll timeout); forget a down replica's (it may come back with another model)."""
        replicas = self.replicas if replicas is None else replicas
        for replica in replicas:
            if not replica.up:
                self.models.pop(replica.url, None)
        await asyncio.gather(*(self._learn_models(r) for r in replicas if r.up and r.url not in self.models))

    async def _learn_models(self, replica: Replica) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            answer = await self.client.get(f"{replica.url}/v1/models", headers=self.poll_headers,
                                           timeout=self.config.poll_timeout_s)
            if answer.status_code == 200:
                self.models[replica.url] = [card for card in answer.json()["data"] if isinstance(card, dict)]
                others = {url: self.model_ids(url) for url in self.models if url != replica.url}
                if any(ids != self.model_ids(replica.url) for ids in others.values()):
                    logger.warning("the replicas serve different models (%s): a request goes to a replica that "
                                   "serves its `model`, and a prompt is predicted with the router's tokenizer "
                                   "(--model), right for one model only",
                                   "; ".join(f"{url}: {', '.join(sorted(self.model_ids(url)))}"
                                             for url in sorted(self.models)))

    def model_ids(self, url: str) -> set[str]:
        """The model names the replica at `url` serves (its cards' ids; empty while not known)."""
        return {card["id"] for card in self.models.get(url, ()) if isinstance(card.get("id"), str)}

    def prompt_limits(self) -> PromptLimits:
        """The replicas' prompt limits as far as known: the largest `max_model_len` of their cards (a prompt that
        one replica takes is predicted), the tokenizer's bytes per token."""
        lens = [card["max_model_len"] for cards in self.models.values() for card in cards
                if isinstance(card.get("max_model_len"), int) and card["max_model_len"] > 0]
        return PromptLimits(max(lens) if lens else None, self.token_bytes)

    async def prompt_ids(self, path: str, body: Any) -> list[list[int]]:
        """The prompts `body` is predicted by (router/prompts.py), rendered and tokenized on the router's own
        tokenizer threads; a replica up whose limits are not known yet is asked for them first."""
        if not self.models and any(r.up for r in self.replicas):
            await self.learn_models()
        work = functools.partial(routed_prompt_ids, path, body, self.tokenizer, dict(self.config.chat_template_kwargs),
                                 self.prompt_limits())
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work)

    def serving(self, replicas: list[Replica], model: str | None) -> list[Replica]:
        """Those of `replicas` that serve `model` (or whose cards are not known yet) when some replica's cards name
        it; all of them when none does, or `model` is None (the replica answers for itself)."""
        if model is None or not any(model in self.model_ids(url) for url in self.models):
            return replicas
        return [r for r in replicas if r.url not in self.models or model in self.model_ids(r.url)]

    def ranked(self, prompts: list[list[int]], exclude: set[str], salt: str | None = None,
               model: str | None = None) -> list[tuple[Replica, int]]:
        """Up replicas not yet tried, the chosen one first, then by predicted hit; with each one's prediction.
        `salt`: the request's cache salt (its prompts hit only what that salt stored). `model`: the request's
        model; when a replica's cards name it, only replicas that serve it (or whose cards are not known yet)."""
        candidates = self.serving([r for r in self.replicas if r.up and r.url not in exclude], model)
        if not candidates:
            return []
        probes = [r.predict(prompts, salt) for r in candidates]
        first = self.chooser.choose(probes, [r.in_flight for r in candidates], sum(len(p) for p in prompts),
                                    lambda i, limit: candidates[i].chain(prompts, limit, salt),
                                    [len(r.index.blocks) if r.index else 0 for r in candidates])
        order = [first] + sorted((i for i in range(len(candidates)) if i != first),
                                 key=lambda i: (-probes[i].cached_len, candidates[i].in_flight))
        return [(candidates[i], probes[i].cached_len) for i in order]

    async def owner_of(self, stored_id: str, headers: dict[str, str]) -> Replica | None:
        """The replica that stored response `stored_id`, up or not: the one that answered it through this router,
        else the first up replica whose `GET /v1/responses/{id}` finds it (asked with the client's `headers`);
        None when no replica has it."""
        known = self.owners.get(stored_id)
        for replica in self.replicas:
            if replica.url == known:
                return replica
        for replica in self.replicas:
            if not replica.up:
                continue
            with contextlib.suppress(httpx.HTTPError):
                answer = await self.client.get(f"{replica.url}{RESPONSES_PATH}/{quote(stored_id, safe='')}",
                                               headers=headers, timeout=self.config.poll_timeout_s)
                if answer.status_code == 200:
                    self.owners.put(stored_id, replica.url)
                    return replica
        return None


def build_router_app(config: RouterConfig, tokenizer: Any) -> FastAPI:
    state = RouterState(config, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        state.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s, connect=5.0),
                                         limits=limits, auth=ReplicaCredentials(config.replica_urls))
        state.poll_headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        first_done = [asyncio.Event() for _ in state.replicas]
        pollers = [asyncio.create_task(state.poll_forever(r, done)) for r, done in zip(state.replicas, first_done)]
        # start once every replica's first poll has ended, or after the poll timeout: a snapshot of many pages
        # is read on after the start (it held the start up for as long as it took)
        with contextlib.suppress(asyncio.TimeoutError):  # (on 3.10 not the builtin TimeoutError)
            await asyncio.wait_for(asyncio.gather(*(done.wait() for done in first_done)), config.poll_timeout_s)
        yield
        for poller in pollers:
            poller.cancel()
        await asyncio.gather(*pollers, return_exceptions=True)
        await state.client.aclose()
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="hybridcache router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = state
    app.add_middleware(ShutdownGuard)  # a request cut by the shutdown before its response: 503, as serve's
    if config.allowed_origins:  # as a replica's (server/app.py)
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])  # as vLLM's --allowed-headers: the OpenAI JS SDK's X-Stainless-*

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        if is_anthropic(_route_path(request)):  # as the replica answers on these routes
            body = anthropic_error_body(error.status, error.message, error.param)
            return JSONResponse(body, status_code=error.status, headers=error.headers)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)  # an unknown route or method: OpenAI's error shape, as a replica's
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(error_body(error.status_code, message), status_code=error.status_code)

    @app.exception_handler(ClientDisconnect)  # a client gone while sending its body: one line, as a replica's
    async def _client_gone(request: Request, error: ClientDisconnect) -> Response:
        logger.info("%s %s: the client disconnected while sending its request", request.method, request.url.path)
        return Response(status_code=499)

    def authorize(request: Request) -> None:
        """A request without the API key is refused here, as a replica refuses it, before its body is read,
        rendered and tokenized: keyless clients' large chats held up keyed ones on the tokenizer threads."""
        if not has_key(request, config.api_keys):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           code="invalid_api_key")

    async def forward(request: Request) -> Response:
        authorize(request)
        raw = await read_body(request, config.max_request_bytes)
        try:
            body = json.loads(raw)
        except RecursionError:
            raise APIError(400, "the request body is not valid JSON: it is nested too deeply") from None
        except ValueError as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from None
        path = _route_path(request)
        prompts = await state.prompt_ids(_invoked_path(body) if path == INVOCATIONS_PATH else path, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:  # a client gone before its response closes the upstream request: the replica aborts it
            return await run_until_disconnect(request.receive, route(path, raw, body, headers, prompts))
        except ClientGone:
            logger.info("%s: the client disconnected before its response; its request was aborted", path)
            return Response(status_code=499)

    async def route(path: str, raw: bytes, body: Any, headers: dict[str, str], prompts: list[list[int]]) -> Response:
        """Send the request to the best replica, and on to the next while one fails before its first byte."""
        stored_id = continued_id(path, body)
        owner = await state.owner_of(stored_id, headers) if stored_id else None
        learn = path == RESPONSES_PATH and stores(body)
        tried: set[str] = set()
        last_error = "no replica is up"
        busy: Response | None = None
        cut: Response | None = None  # a replica's 503 for a request its shutdown cut
        while True:
            if owner is not None:  # only the replica holding the conversation can continue it
                ranked = [(owner, None)] if owner.up and owner.url not in tried else []
                if not ranked:
                    state.num_failed += 1
                    if busy is not None or cut is not None:  # its queue is full (its Retry-After) or it shut down
                        return busy or cut
                    raise APIError(503, f"the replica that stored response {stored_id!r} ({owner.url}) cannot take "
                                        f"the request: {last_error if tried else 'it is down'}")
            else:
                ranked = state.ranked(prompts, tried, routed_cache_salt(body), _model(body))
            if not ranked:
                state.num_failed += 1
                if busy is not None:  # every replica left was busy: the last one's 503 and its Retry-After
                    return busy
                if cut is not None:  # (the fleet shuts down: the replica's own "the server shut down ...")
                    return cut
                raise APIError(503, f"no replica could take the request: {last_error}")
            replica, predicted = ranked[0]
            tried.add(replica.url)
            if len(tried) > 1:
                state.num_retries += 1
            replica.in_flight += 1
            relayed = False  # a relayed stream drops the in-flight count itself, once it ends
            try:
                try:
                    upstream = await state.client.send(
                        state.client.build_request("POST", f"{replica.url}{path}", content=raw, headers=headers),
                        stream=True)
                except _ACCEPTED_TIMEOUTS as error:  # the replica took the request: it is slow, not down
                    return _timed_out(state, replica, error)
                except httpx.HTTPError as error:
                    replica.counters.retried_away += 1
                    last_error = f"{replica.url}: {type(error).__name__}: {error}"
                    replica.mark_down(last_error)
                    continue
                if upstream.status_code in RETRY_STATUSES:
                    try:
                        content = await upstream.aread()
                    except httpx.HTTPError:
                        content = b""
                    finally:
                        await upstream.aclose()
                    verdict = replica_verdict(upstream.status_code, upstream.headers, content)
                    if verdict == "answer":  # the request's own outcome: another replica would only run it again
                        replica.counters.routed += 1
                        return _relayed(upstream, content)
                    replica.counters.retried_away += 1
                    last_error = f"{replica.url} answered {upstream.status_code}"
                    if verdict == "busy":  # up, with a full queue: try another, keep it (and its index)
                        busy = _relayed(upstream, content)
                    else:
                        replica.mark_down(last_error)
                        if _shut_down(content):  # another replica may take it; if none can, this is the answer
                            cut = _relayed(upstream, content)
                    continue
                replica.counters.routed += 1
                # a stream by what the replica answered, not by the body's `stream` (whose "false", a string,
                # the replica's parser reads as false)
                if upstream.status_code == 200 and _is_event_stream(upstream):
                    relayed = True
                    return _RelayResponse(state, replica, upstream, predicted, learn, is_anthropic(path))
                try:
                    content = await upstream.aread()
                except _ACCEPTED_TIMEOUTS as error:
                    return _timed_out(state, replica, error)
                except httpx.HTTPError as error:
                    replica.mark_down(f"{type(error).__name__}: {error}")
                    state.num_failed += 1
                    raise APIError(502, f"replica {replica.url} failed while answering: {error}") from None
                finally:
                    await upstream.aclose()
            finally:
                if not relayed:
                    replica.in_flight -= 1
            if upstream.status_code == 200:
                if learn and (stored := response_id(content)) is not None:
                    state.owners.put(stored, replica.url)
                with contextlib.suppress(ValueError, AttributeError):
                    _record_usage(replica, json.loads(content).get("usage"), predicted)
                await replica.poll(state.client, config.poll_timeout_s, state.poll_headers)
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type", "application/json"))

    async def stored_response(request: Request, stored_id: str) -> Response:
        """A stored response, from the replica that holds it (any up replica answers an unknown id: 404)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        owner = await state.owner_of(stored_id, headers)
        replicas = [owner] if owner is not None else [r for r in state.replicas if r.up][:1]
        if not replicas or not replicas[0].up:
            where = f" ({owner.url}) is down" if owner is not None else ": no replica is up"
            raise APIError(503, f"the replica that stored response {stored_id!r}{where}")
        try:  # a lookup in the replica's memory: within the poll timeout, as the router's other own calls
            answer = await state.client.get(f"{replicas[0].url}{RESPONSES_PATH}/{quote(stored_id, safe='')}",
                                            headers=headers, timeout=config.poll_timeout_s)
        except httpx.TimeoutException as error:
            raise APIError(504, f"replica {replicas[0].url} did not answer within {config.poll_timeout_s} s "
                                f"({type(error).__name__})") from None
        except httpx.HTTPError as error:
            raise APIError(502, f"replica {replicas[0].url} failed while answering: {error}") from None
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type", "application/json"))

    async def models(request: Request) -> Response:
        """Every up replica's cards, asked with the client's headers (each within the poll timeout), merged by
        id in the replicas' order; the first replica's own answer when none answers 200 (a 401, say)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}

        async def ask(replica: Replica) -> httpx.Response | None:
            with contextlib.suppress(httpx.HTTPError):  # a replica slower than the poll timeout: left out
                return await state.client.get(f"{replica.url}/v1/models", headers=headers,
                                              timeout=config.poll_timeout_s)
            return None

        answers = [a for a in await asyncio.gather(*(ask(r) for r in state.replicas if r.up)) if a is not None]
        cards: dict[str, dict] = {}
        for answer in answers:
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                if answer.status_code == 200:
                    for card in answer.json()["data"]:
                        cards.setdefault(card["id"], card)
        if cards:
            return JSONResponse({"object": "list", "data": list(cards.values())})
        if answers:
            return Response(answers[0].content, status_code=answers[0].status_code, media_type="application/json")
        raise APIError(503, "no replica is up")

    async def pass_through(request: Request) -> Response:
        """A request any replica of its model answers alike (/tokenize, /detokenize, /version,
        /v1/messages/count_tokens): sent as it came to the first up replica that serves the JSON body's `model`
        (`RouterState.serving`) and takes it (one that cannot be reached, or answers 502/503/504, passes it to the
        next)."""
        if request.method == "POST":  # the POST routes need the key (/version does not)
            authorize(request)
        raw = await read_body(request, config.max_request_bytes) if request.method == "POST" else b""
        model = None
        with contextlib.suppress(ValueError, RecursionError):  # not JSON: the replica answers its 400
            model = _model(json.loads(raw)) if raw else None
        return await send_first(request, raw, state.serving([r for r in state.replicas if r.up], model))

    async def cache_match(request: Request) -> Response:
        """`POST /v1/cache/match` (a dry run of a completions or chat body): answered by the replica the request
        would be routed to (then the next-best, as `pass_through`)."""
        authorize(request)
        raw = await read_body(request, config.max_request_bytes)
        try:
            body = json.loads(raw)
        except (RecursionError, ValueError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from None
        prompts = await state.prompt_ids(_route_path(request), body)
        ranked = state.ranked(prompts, set(), routed_cache_salt(body), _model(body))
        return await send_first(request, raw, [r for r, _ in ranked])

    async def send_first(request: Request, raw: bytes, replicas: list[Replica]) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        last_error = "no replica is up"
        for replica in replicas:
            try:
                answer = await state.client.request(request.method, f"{replica.url}{_route_path(request)}",
                                                    content=raw, headers=headers, params=request.query_params)
            except httpx.HTTPError as error:
                last_error = f"{replica.url}: {type(error).__name__}: {error}"
                continue
            if answer.status_code in RETRY_STATUSES and replica is not replicas[-1]:
                last_error = f"{replica.url} answered {answer.status_code}"
                continue
            return _relayed(answer, answer.content)
        raise APIError(503, f"no replica could take the request: {last_error}")

    async def ping(request: Request) -> Response:
        """vLLM's liveness route, as a replica's: 200 with an empty body while a replica is up, else 503."""
        return Response(status_code=200 if any(r.up for r in state.replicas) else 503)

    async def server_load() -> JSONResponse:
        """vLLM's `GET /load`, as a replica's: `{"server_load": N}`, the requests in flight through the router."""
        return JSONResponse({"server_load": sum(r.in_flight for r in state.replicas)})

    async def health(request: Request) -> JSONResponse:
        ok = any(r.up for r in state.replicas)
        body: dict[str, Any] = {"status": "ok" if ok else "unhealthy"}
        if has_key(request, config.api_keys):  # the replicas' addresses and loads: only with the key
            body["replicas"] = [{"url": r.url, "up": r.up, "in_flight": r.in_flight, "routed": r.counters.routed,
                                 "indexed_blocks": len(r.index.blocks) if r.index else 0,
                                 "indexed_checkpoints": r.index.num_checkpoints if r.index else 0}
                                for r in state.replicas]
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics() -> Response:
        text = render_metrics(state)
        if config.engine_metrics:
            text += await engine_metrics(state)
        return Response(text, media_type="text/plain; version=0.0.4")

    app.add_api_route("/v1/completions", forward, methods=["POST"])
    app.add_api_route("/v1/chat/completions", forward, methods=["POST"])
    app.add_api_route(RESPONSES_PATH, forward, methods=["POST"])
    app.add_api_route(RESPONSES_PATH + "/{stored_id}", stored_response, methods=["GET"])
    app.add_api_route(MESSAGES_PATH, forward, methods=["POST"])
    app.add_api_route(INVOCATIONS_PATH, forward, methods=["POST"])
    app.add_api_route(COUNT_TOKENS_PATH, pass_through, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/cache/match", cache_match, methods=["POST"])
    app.add_api_route("/tokenize", pass_through, methods=["POST"])
    app.add_api_route("/detokenize", pass_through, methods=["POST"])
    app.add_api_route("/version", pass_through, methods=["GET"])
    app.add_api_route("/ping", ping, methods=["GET", "POST"])
    app.add_api_route("/load", server_load, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app


def _route_path(request: Request) -> str:
    """The request's path as the replicas serve it: without the `--root-path` prefix uvicorn puts before it."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


INVOCATIONS_PATH = "/invocations"  # SageMaker's: a chat or completion request, by its body (server/app.py)


def _invoked_path(body: Any) -> str:
    """The route an /invocations body runs as on a replica (predicted as that route's request), or a 400 as the
    replica's."""
    if isinstance(body, dict) and "messages" in body:
        return "/v1/chat/completions"
    if isinstance(body, dict) and "prompt" in body:
        return "/v1/completions"
    raise APIError(400, "/invocations takes a chat completion request (with 'messages') or a completion request "
                   "(with 'prompt')")


def is_anthropic(path: str) -> bool:
    """Whether `path` is one of Anthropic's routes, whose errors are Anthropic's error objects."""
    return path in (MESSAGES_PATH, COUNT_TOKENS_PATH)


def _model(body: Any) -> str | None:
    """The model a request names (None: none, or not a string, which the replica refuses)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def _is_event_stream(upstream: httpx.Response) -> bool:
    return upstream.headers.get("content-type", "").split(";")[0].strip().lower() == "text/event-stream"


def _timed_out(state: RouterState, replica: Replica, error: httpx.TimeoutException) -> JSONResponse:
    """The 504 of a request that `replica` took and did not answer within the router's `request_timeout_s`. The
    replica is not marked down and the request is not sent again: another replica would only run it again."""
    state.num_failed += 1
    return JSONResponse(_timeout_body(state, replica, error), status_code=504, headers=NO_RETRY)


def _timeout_body(state: RouterState, replica: Replica, error: httpx.TimeoutException) -> dict[str, Any]:
    message = (f"replica {replica.url} did not answer within the router's request timeout of "
               f"{state.config.request_timeout_s} s ({type(error).__name__}); the request was aborted, not retried")
    body = error_body(504, message, code="replica_timeout")
    body["error"]["type"] = "gateway_timeout"
    return body


def has_key(request: Request, key: str | Sequence[str] | None) -> bool:
    """Whether the request carries `key`, or one of the keys, as its bearer token or its `x-api-key` header
    (`sent_keys`, as a replica reads them; always true when there is none); every key is compared, in constant time
    each."""
    keys = () if key is None else (key,) if isinstance(key, str) else tuple(key)
    if not keys:
        return True
    matches = [hmac.compare_digest(sent, one.encode()) for sent in sent_keys(request.headers) for one in keys]
    return any(matches)


class _RelayResponse(StreamingResponse):
    """A replica's stream passed through (`_relay`). However the response ends (finished, cut, the client gone,
    even before its first chunk), the replica's in-flight count drops once and the upstream stream is closed."""

    def __init__(self, state: RouterState, replica: Replica, upstream: httpx.Response, predicted: int | None,
                 learn: bool = False, anthropic: bool = False) -> None:
        self._replica, self._upstream, self._open = replica, upstream, True
        self._anthropic = anthropic
        super().__init__(_relay(state, replica, upstream, predicted, self.release, learn, anthropic),
                         media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def release(self) -> None:
        if self._open:
            self._open = False
            self._replica.in_flight -= 1
            await self._upstream.aclose()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = False

        async def watched_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await super().__call__(scope, receive, watched_send)
        except asyncio.CancelledError:
            # the router's shutdown grace period ended while the stream ran: end it as serve's
            # `EventStreamResponse` does, with the final error event and `[DONE]`, so that the client sees a
            # complete stream (it used to be cut with neither)
            with contextlib.suppress(Exception):
                await self.release()
                await self._finish(send, started)
        finally:
            await self.release()

    async def _finish(self, send: Any, started: bool) -> None:
        if not started:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = error_body(503, SHUTDOWN_MESSAGE)
        events = (stream_error(body, 503, anthropic=True),) if self._anthropic else (sse(body), sse("[DONE]"))
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _relay(state: RouterState, replica: Replica, upstream: httpx.Response, predicted: int | None,
                 release: Any, learn: bool = False, anthropic: bool = False) -> AsyncIterator[bytes]:
    """Pass a stream through, whole events at a time (`EventRelay`); a cut after the first byte ends it with an
    error event and `[DONE]`, after the last whole event (an incomplete one is dropped). `release()` once the
    upstream has ended, before the replica's events are polled. `learn`: a Responses stream whose id (its first
    event's) is remembered as stored on `replica`. `anthropic`: a Messages stream, whose error event is Anthropic's
    (`stream_error`)."""
    events = EventRelay()
    head = StreamHead() if learn else None
    try:
        async for chunk in upstream.aiter_raw():
            if head is not None and (stored := head.feed(chunk)) is not None:
                state.owners.put(stored, replica.url)
            if whole := events.feed(chunk):
                yield whole
        if rest := events.rest():
            yield rest
    except _ACCEPTED_TIMEOUTS as error:  # slow, not down
        state.num_failed += 1
        yield stream_error(_timeout_body(state, replica, error), 504, anthropic)
        return
    except httpx.HTTPError as error:
        replica.mark_down(f"stream cut: {type(error).__name__}: {error}")
        state.num_failed += 1
        message = f"replica {replica.url} failed mid-stream: {type(error).__name__}: {error}"
        yield stream_error(error_body(502, message), 502, anthropic)
        return
    finally:
        await release()
    _record_usage(replica, stream_usage(events.usage_event), predicted)
    await replica.poll(state.client, state.config.poll_timeout_s, state.poll_headers)


def stream_error(body: dict[str, Any], status: int, anthropic: bool) -> bytes:
    """The events that end a relayed stream the router cuts: the OpenAI error `body` and `data: [DONE]`, or on a
    Messages stream (`anthropic`) Anthropic's `event: error` with the same message (as the replica ends its own)."""
    if not anthropic:
        return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
    error = anthropic_error_body(status, body["error"]["message"])
    return f"event: error\ndata: {json.dumps(error)}\n\n".encode()


class EventRelay:
    """A replica's event stream cut at event boundaries, as a relay passes it on: `feed(chunk)` returns the
    events the chunk completes (up to the blank line that ends the last of them; b"" while none) and holds back
    the start of the next one, so that an error event the relay adds when the stream is cut follows a whole event,
    never half of one (it was glued onto it: `data: {"choices": [{"index": 0, "tedata: {"error": ...`, which no
    client parses). An event held back past `MAX_HELD_EVENT_BYTES` is passed on as it is. `rest()`: what is held
    when the stream ends (a last event without its blank line). `usage_event`: the last whole event that carries a
    usage object (a chunk of `stream_options.include_usage`, a Responses stream's `response.completed`, of any
    size), for `stream_usage`.

        feed(b'data: {"a": 1}\n\ndata: {"b"')   ->  b'data: {"a": 1}\n\n'    (b'data: {"b"' held)
        feed(b': 2}\n\n')                      ->  b'data: {"b": 2}\n\n'
    """

    def __init__(self) -> None:
        self._held = b""
        self.usage_event = b""

    def feed(self, chunk: bytes) -> bytes:
        start = max(0, len(self._held) - 3)  # a boundary may begin in the held bytes' last 3
        self._held += chunk
        end = None
        for match in _EVENT_END.finditer(self._held, start):
            end = match.end()
        if end is None:
            if len(self._held) <= MAX_HELD_EVENT_BYTES:
                return b""
            end = len(self._held)
        whole, self._held = self._held[:end], self._held[end:]
        self._note_usage(whole)
        return whole

    def rest(self) -> bytes:
        rest, self._held = self._held, b""
        self._note_usage(rest)
        return rest

    def _note_usage(self, events: bytes) -> None:
        for match in reversed(list(_USAGE.finditer(events))):
            starts = [m.end() for m in _EVENT_END.finditer(events, 0, match.start())]
            ends = _EVENT_END.search(events, match.end())
            event = events[starts[-1] if starts else 0:ends.end() if ends else len(events)]
            if stream_usage(event) is not None:
                self.usage_event = event
                return


def stream_usage(tail: bytes) -> dict | None:
    """The `usage` of the last event in `tail` that has one (sent with stream_options.include_usage; a
    Responses stream's `response.completed` holds it in its `response`), if any."""
    for line in reversed(tail.decode(errors="replace").splitlines()):
        if line.startswith("data: {") and '"usage"' in line:
            with contextlib.suppress(ValueError, AttributeError):
                data = json.loads(line[6:])
                usage = data.get("usage") or (data.get("response") or {}).get("usage")
                if usage:
                    return usage
    return None


def _record_usage(replica: Replica, usage: dict | None, predicted: int | None) -> None:
    record_usage(replica.url, replica.counters, usage, predicted)


def record_usage(name: str, counters: ReplicaCounters, usage: dict | None, predicted: int | None) -> None:
    """Add a response's `usage` (if it has one: completions' and chat's `prompt_tokens`, the Responses API's
    `input_tokens`, the Messages API's `input_tokens` + `cache_read_input_tokens` + `cache_creation_input_tokens`)
    and the router's prediction for it to a replica's counters; nothing without a prediction (a request continuing
    a stored response)."""
    if not usage or predicted is None:
        return
    if "cache_read_input_tokens" in usage:  # Anthropic's: input_tokens are the uncached ones
        cached = int(usage.get("cache_read_input_tokens") or 0)
        details = {"cached_tokens": cached}
        prompt_tokens = int(usage.get("input_tokens") or 0) + cached + \
            int(usage.get("cache_creation_input_tokens") or 0)
    else:
        responses = "input_tokens" in usage
        details = usage.get("input_tokens_details" if responses else "prompt_tokens_details") or {}
        prompt_tokens = usage.get("input_tokens" if responses else "prompt_tokens")
    logger.debug("%s: predicted %d hit tokens, reported %s of %s", name, predicted, details.get("cached_tokens"),
                 prompt_tokens)
    counters.reported_hit_tokens += int(details.get("cached_tokens") or 0)
    counters.predicted_hit_tokens += predicted
    counters.prompt_tokens += int(prompt_tokens or 0)


@dataclass(frozen=True)
class ReplicaView:
    """One replica's row of the router's /metrics: its name (label `replica`), counters and state. Under Ray
    Serve (ray_metrics.py) `retried_away` is None: Ray does not say which replica failed before answering."""

    name: str
    counters: ReplicaCounters
    in_flight: int
    up: bool
    indexed_checkpoints: int
    retried_away: int | None = 0


def render_metrics(state: RouterState) -> str:
    """Prometheus text of the router: per replica (label `replica`) and totals."""
    views = [ReplicaView(r.url, r.counters, r.in_flight, r.up, r.index.num_checkpoints if r.index else 0,
                         r.counters.retried_away) for r in state.replicas]
    return render_router_metrics(views, state.num_retries, state.num_failed)


async def engine_metrics(state: RouterState) -> str:
    """Every up replica's own /metrics, asked of all at once (each within `poll_timeout_s`), as one Prometheus
    text whose every series is labelled `engine` with the replica's index (replacing a replica's own `engine="0"`),
    as vLLM's data-parallel server labels each engine's. A replica that does not answer 200 in time is left out of
    this scrape."""
    from hybridcache.router.ray_metrics import merge_replica_metrics  # (it imports this module)

    async def fetch(replica: Replica) -> str | None:
        try:
            answer = await state.client.get(f"{replica.url}/metrics", timeout=state.config.poll_timeout_s)
        except httpx.HTTPError as error:
            logger.warning("no metrics from replica %s: %s: %s", replica.url, type(error).__name__, error)
            return None
        if answer.status_code != 200:
            logger.warning("no metrics from replica %s: it answered %d", replica.url, answer.status_code)
            return None
        return answer.text

    up = [(str(i), replica) for i, replica in enumerate(state.replicas) if replica.up]
    texts = await asyncio.gather(*(fetch(replica) for _, replica in up))
    return merge_replica_metrics({engine: text for (engine, _), text in zip(up, texts) if text is not None},
                                 label="engine")


def render_router_metrics(views: list[ReplicaView], num_retries: int, num_failed: int) -> str:
    """Prometheus text of a router's counters (the standalone router's and the Ray Serve ingress's): per
    replica (label `replica`) and totals. A series whose every value is None is left out."""
    series = [
        ("hybridcache_router_requests_routed_total", "counter", "requests sent to the replica (that answered)",
         lambda v: v.counters.routed),
        ("hybridcache_router_requests_retried_away_total", "counter",
         "requests the replica could not take before its first byte (sent to another one)",
         lambda v: v.retried_away),
        ("hybridcache_router_predicted_hit_tokens_total", "counter",
         "prompt tokens the router predicted would hit, over requests whose response reported usage",
         lambda v: v.counters.predicted_hit_tokens),
        ("hybridcache_router_reported_hit_tokens_total", "counter",
         "cached_tokens the replica reported in usage", lambda v: v.counters.reported_hit_tokens),
        ("hybridcache_router_prompt_tokens_total", "counter", "prompt_tokens the replica reported in usage",
         lambda v: v.counters.prompt_tokens),
        ("hybridcache_router_in_flight", "gauge", "requests in flight through the router", lambda v: v.in_flight),
        ("hybridcache_router_replica_up", "gauge", "1 while the replica's cache events reach the index",
         lambda v: int(v.up)),
        ("hybridcache_router_indexed_checkpoints", "gauge", "checkpoints in the router's index of the replica",
         lambda v: v.indexed_checkpoints),
    ]
    lines = []
    for name, kind, help_text, value in series:
        values = [(v.name, value(v)) for v in views]
        if views and all(x is None for _, x in values):
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{replica="{_label(n)}"}} {x}' for n, x in values]
    for name, help_text, value in (
            ("hybridcache_router_retries_total", "requests sent again to another replica", num_retries),
            ("hybridcache_router_failed_total", "requests that no replica completed (503, 502 or a cut stream)",
             num_failed)):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
