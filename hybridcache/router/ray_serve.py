"""Ray Serve: hybridcache engines as a Serve deployment, routed by where their checkpoints are.

    HTTP  ->  OpenAIIngress (FastAPI)        reads and tokenizes each request as the replicas will render it
                 | engine.options(stream=True).remote(EngineRequest(method, path, body, headers, prompt_ids))
                 |   CheckpointRequestRouter (ray_router.py, in the ingress's process): each candidate's
                 |   predicted hit from CacheIndex, then the router's rule (policy.py)
                 v
              HybridcacheEngine x N          one `hybridcache serve` application each, run in process (no
                 |                           socket: asgi_call.py); Ray places them (one GPU each, or CPU),
                 |                           health-checks them (`check_health`) and restarts them
                 | after each response it served (before its last bytes) and every `poll_interval_s`:
                 | its own GET /v1/cache/events answer
                 v
              CacheIndex (1 replica)         FleetIndex (fleet_index.py): every replica's cache, as hashes

`build_app(serve_args, ...)` makes the application; `app_builder` is the same for `serve run` and Serve config
files (deploy/ray/). `serve_args` are `hybridcache serve` options (the model, engine sizes, --api-key, ...): every
replica runs with them, and the ingress reads the model's tokenizer, chat template and body limit from them.
The model folder must exist on every node that runs a replica or the ingress.

Stored responses (`POST /v1/responses`, router/responses.py) live on the replica that answered them: the ingress
remembers which one (from the answer's first message and the response id it carries) and pins a request with
`previous_response_id`, and `GET /v1/responses/{id}`, to it (`EngineRequest.replica_id`); an id it does not know
(another ingress replica relayed it, or this one restarted) is asked of every replica the index knows, one pinned
`GET /v1/responses/{id}` at a time. Once that replica is gone, the request goes to any replica, which answers 404.

Every engine replica answers with the server's own responses (status, body, errors). A replica that fails
before the first byte of its answer (its actor died) is tried again (Ray's router no longer offers a dead
replica); a stream cut after its first byte ends with an error event and `data: [DONE]`, as behind the HTTP
router (app.py).
"""

# No `from __future__ import annotations`: FastAPI must see the routes' `Request` annotations as classes (Serve's
# ingress wraps the methods, and strings would no longer resolve).
import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig

from hybridcache.router import ray_metrics
from hybridcache.router.app import (
    FORWARDED_HEADERS,
    TOKENIZE_THREADS,
    EventRelay,
    has_key,
    is_anthropic,
    record_usage,
    stream_error,
    stream_usage,
)
from hybridcache.router.asgi_call import asgi_request
from hybridcache.router.fleet_index import FleetIndex
from hybridcache.router.policy import RoutingConfig
from hybridcache.router.prompts import PromptLimits, routed_prompt_ids
from hybridcache.router.ray_router import INDEX_DEPLOYMENT, CheckpointRequestRouter
from hybridcache.router.responses import (
    RESPONSES_PATH,
    ResponseOwners,
    StreamHead,
    continued_id,
    response_id,
    routed_cache_salt,
    stores,
)
from hybridcache.server.anthropic_protocol import COUNT_TOKENS_PATH, MESSAGES_PATH, anthropic_error_body
from hybridcache.server.errors import APIError, error_body
from hybridcache.server.limits import max_token_bytes, read_body

logger = logging.getLogger("hybridcache.router")
ENGINE_DEPLOYMENT = "HybridcacheEngine"
MAX_ATTEMPTS = 3  # replicas a request is sent to at most, when each fails before its first byte
METRICS_TIMEOUT_S = 5.0  # how long /metrics waits for one replica's own metrics (and a stored-response lookup)
PUBLISH_AFTER = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class EngineRequest:
    """One HTTP request for an engine replica: what it is, and the prompts' token ids the router reads."""

    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    prompt_ids: tuple[tuple[int, ...], ...] = ()
    route_key: str = ""  # set: the request router stores its predictions under it (ray_metrics.py)
    replica_id: str = ""  # set: only this replica may take the request while it runs (a scrape, a stored response)
    cache_salt: str = ""  # the body's cache salt, which the prompts' hits are predicted under ("": none)


def parse_serve_args(serve_args: Sequence[str]) -> Any:
    """The parsed `hybridcache serve` options, as the command line parses them (its `serve` subcommand, with
    router/cli.py's additions); argparse exits with a usage message on a bad one."""
    import argparse

    from hybridcache.router import cli as router_cli
    from hybridcache.server import cli as server_cli

    parser = argparse.ArgumentParser(prog="hybridcache", allow_abbrev=False)
    subcommands = parser.add_subparsers(dest="command", required=True)
    server_cli.register(subcommands)
    router_cli.register(subcommands)
    return parser.parse_args(["serve", *serve_args])


class HybridcacheEngine:
    """One engine replica: the `hybridcache serve` application of `serve_args`, driven in process. Calls
    yield `{"status", "headers", "replica"}` first (`replica`: this replica's full id), then the body's
    pieces (bytes)."""

    async def __init__(self, serve_args: Sequence[str], index: Any, poll_interval_s: float = 0.5) -> None:
        from hybridcache.server.cli import build_server

        self.parts = build_server(parse_serve_args(serve_args))
        self._closed = False
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self.parts.app.router.lifespan_context(self.parts.app))
        self.index = index
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        key = self.parts.config.api_key
        self._own_headers = (("authorization", f"Bearer {key}"),) if key else ()
        self._since: int | None = None
        self._publish_lock = asyncio.Lock()
        await self.publish()
        self._poller = asyncio.ensure_future(self._publish_forever(poll_interval_s))

    async def __call__(self, request: EngineRequest) -> AsyncIterator[dict | bytes]:
        async for message in asgi_request(self.parts.app, request.method, request.path, request.headers,
                                          request.body):
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "replica": self.replica_id,
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ())]}
            elif message.get("body"):
                yield message["body"]
        if request.path in PUBLISH_AFTER:  # the next turn is routed with the checkpoint this one saved
            await self.publish()

    async def publish(self) -> None:
        """Push this replica's cache events since the last push to the index (a snapshot when the index asks
        for one). Never raises: a failed push is logged and the next one sends a snapshot."""
        async with self._publish_lock:
            try:
                for _ in range(2):  # an answer the index cannot apply is followed at once by a snapshot
                    query = "" if self._since is None else f"since={self._since}"
                    body = await self._json("GET", "/v1/cache/events", query)
                    asked, self._since = self._since, await self.index.publish.remote(self.replica_id, body)
                    if asked is None or self._since is not None:
                        return
            except Exception as error:  # noqa: BLE001 - the index restarting must not fail requests
                logger.warning("could not publish cache events to the index: %s: %s", type(error).__name__, error)
                self._since = None

    async def check_health(self) -> None:
        """Ray Serve's health check: a dead or inconsistent engine fails it, and Ray replaces the replica."""
        loop = self.parts.engine_loop
        if not (loop.running and loop.healthy):
            raise RuntimeError(f"the engine is not healthy: {loop.last_error}")

    def __del__(self) -> None:
        """Ray Serve's shutdown of the replica (then the garbage collector's: it does nothing twice): stop
        pushing, stop the engine thread (aborting what still runs), close the engine. Synchronous, since the
        garbage collector calls it too."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if getattr(self, "_poller", None) is not None:
            self._poller.cancel()
        self.parts.engine_loop.stop()
        self.parts.engine.close()

    async def _publish_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.publish()

    async def _json(self, method: str, path: str, query: str = "") -> Any:
        head, body = None, b""
        async for message in asgi_request(self.parts.app, method, path, self._own_headers, query=query):
            if message["type"] == "http.response.start":
                head = message["status"]
            else:
                body += message.get("body", b"")
        if head != 200:
            raise RuntimeError(f"{method} {path} answered {head}: {body[:200]!r}")
        return json.loads(body)


class CacheIndex:
    """The index deployment: one `FleetIndex` (its methods run one at a time on the replica's event loop)."""

    def __init__(self) -> None:
        self.fleet = FleetIndex()

    async def publish(self, replica_id: str, body: dict) -> int | None:
        return self.fleet.publish(replica_id, body)

    async def predict(self, prompts: list[list[int]], replica_ids: list[str],
                      cache_salt: str | None = None) -> list[tuple[int, int, int]]:
        """(kv_len, cached_len, chain) per replica: its probe, and its chain (`FleetIndex.chains`), of a request
        with cache salt `cache_salt`."""
        probes = self.fleet.predict(prompts, replica_ids, cache_salt)
        chains = self.fleet.chains(prompts, probes, replica_ids, cache_salt)
        return [(p.kv_len, p.cached_len, c) for p, c in zip(probes, chains, strict=True)]

    async def drop(self, replica_ids: list[str]) -> None:
        self.fleet.drop(replica_ids)

    async def stats(self) -> dict[str, dict]:
        return self.fleet.stats()


async def _relay(stream: Any, done: Callable[[bytes | None], None],
                 head: Callable[[bytes], None] | None = None, anthropic: bool = False) -> AsyncIterator[bytes]:
    """A replica's event stream passed through, whole events at a time (app.py's `EventRelay`); a cut ends it
    with an error event and `[DONE]` after the last whole event (an incomplete one is dropped; a Messages stream,
    `anthropic`, ends with Anthropic's error event instead, app.py's `stream_error`). `done(tail)` once, however it
    ends: the last event that carries a usage object (b"" for none), None when the replica cut it, b"" when the
    client left. `head(piece)`: called with every piece before it is passed on."""
    tail: bytes | None = b""
    events = EventRelay()
    try:
        async for piece in stream:
            if head is not None:
                head(piece)
            if whole := events.feed(piece):
                yield whole
        if rest := events.rest():
            yield rest
        tail = events.usage_event
    except (RayActorError, ActorUnavailableError) as error:
        tail = None
        message = f"the engine replica failed mid-stream: {type(error).__name__}: {error}"
        yield stream_error(error_body(502, message), 502, anthropic)
    except BaseException:  # the client went away (the generator closed, the task cancelled)
        tail = b""
        raise
    finally:
        done(tail)


def _headers(request: Request) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS)


# Serve pickles the ingress class when it is decorated: what its methods use must be defined above it, and the
# state they share with the request router (ray_metrics.PREDICTED_HITS) is reached through its module (pickled by
# reference), not a name bound here (pickled by value: a copy).
ingress_app = FastAPI(title="hybridcache (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None,
                      redirect_slashes=False)


@ingress_app.exception_handler(APIError)
async def _api_error(request: Request, error: APIError) -> JSONResponse:
    if is_anthropic(request.url.path):  # as the replica answers on these routes
        body = anthropic_error_body(error.status, error.message, error.param)
        return JSONResponse(body, status_code=error.status, headers=error.headers)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@serve.ingress(ingress_app)
class OpenAIIngress:
    """The OpenAI routes: completions, chat, Responses and Anthropic's Messages sent to an engine replica by the
    checkpoint router (the replica checks the API key, forwarded as sent: a bearer token or `x-api-key`; errors on
    the Messages routes, the ingress's own included, in Anthropic's shape); /v1/messages/count_tokens, /v1/models,
    /tokenize, /detokenize and /version from any replica; /health, with the index's view of every replica for
    holders of the API key (when one is set); /metrics, open as the standalone router's is: the router's counters
    and every replica's engine metrics (ray_metrics.py)."""

    def __init__(self, engine: Any, index: Any, serve_args: Sequence[str]) -> None:
        from hybridcache.engine_args import model_argument
        from hybridcache.model_path import resolve_model
        from hybridcache.server.cli import api_keys
        from hybridcache.server.vllm_flags import chat_template
        from hybridcache.tokenizer import Tokenizer

        args = parse_serve_args(serve_args)
        self.engine, self.index = engine, index
        self.tokenizer = Tokenizer(resolve_model(model_argument(args), weights=False).path)
        template = chat_template(args)
        if template is not None:
            self.tokenizer.chat_template = template
        self.template_kwargs = args.chat_template_kwargs or {}
        self.max_request_bytes = args.max_request_bytes
        self.api_keys = api_keys(args)  # any one opens /health's details, as the replicas take any one
        self._key = (("authorization", f"Bearer {self.api_keys[0]}"),) if self.api_keys else ()
        self.counters = ray_metrics.IngressCounters()
        self.owners = ResponseOwners()
        self.limits = PromptLimits(None, max_token_bytes(self.tokenizer))  # max_model_len: `_prompt_limits`
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZE_THREADS,
                                                                   thread_name_prefix="ingress-tokenize")

    @ingress_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward(request)

    @ingress_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward(request)

    @ingress_app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await self._forward(request)

    @ingress_app.post(MESSAGES_PATH)
    async def messages(self, request: Request) -> Response:
        return await self._forward(request)

    @ingress_app.post(COUNT_TOKENS_PATH)
    async def count_tokens(self, request: Request) -> Response:
        return await self._pass_through(request)

    @ingress_app.get("/v1/responses/{stored_id}")
    async def stored_response(self, request: Request, stored_id: str) -> Response:
        owner = await self._owner_of(stored_id, _headers(request))
        return await self._send(EngineRequest("GET", f"{RESPONSES_PATH}/{quote(stored_id, safe='')}",
                                              headers=_headers(request), replica_id=owner or ""))

    @ingress_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._send(EngineRequest("GET", "/v1/models", headers=_headers(request)))

    @ingress_app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._pass_through(request)

    @ingress_app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._pass_through(request)

    @ingress_app.get("/version")
    async def version(self, request: Request) -> Response:
        return await self._send(EngineRequest("GET", "/version"))

    async def _pass_through(self, request: Request) -> Response:
        """A request any replica answers alike: sent as it came, routed by load only (no prompt ids)."""
        raw = await read_body(request, self.max_request_bytes)
        return await self._send(EngineRequest("POST", request.url.path, raw, _headers(request)))

    @ingress_app.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        body: dict[str, Any] = {"status": "ok"}
        if has_key(request, self.api_keys):  # what the index holds of each replica: only with the key
            body["replicas"] = await self.index.stats.remote()
        return JSONResponse(body)

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        stats = await self.index.stats.remote()
        texts: dict[str, str] = {}
        for replica_id in sorted(stats):  # one at a time: concurrent calls of one request share its Ray id
            if replica_id not in texts:
                answer = await self._replica_metrics(replica_id)
                if answer is not None:
                    texts.setdefault(*answer)
        engines = ray_metrics.merge_replica_metrics(texts)
        return Response(self.counters.render(stats) + engines, media_type="text/plain; version=0.0.4")

    async def _replica_metrics(self, replica_id: str) -> tuple[str, str] | None:
        """A replica's own GET /metrics, asked of `replica_id` (a call pinned to it), as (the replica that
        answered, its text): labelled by the answer, since a replica gone meanwhile leaves the call to any
        other. None when no answer comes in time."""
        answer = await self._pinned_get(replica_id, "/metrics")
        if answer is None or answer[1] != 200:
            if answer is not None:
                logger.warning("no metrics from replica %s: it answered %d", replica_id, answer[1])
            return None
        return answer[0], answer[2].decode()

    async def _pinned_get(self, replica_id: str, path: str,
                          headers: tuple[tuple[str, str], ...] = ()) -> tuple[str, int, bytes] | None:
        """`GET path` asked of `replica_id` (a call pinned to it) as (the replica that answered, status, body);
        None when no answer comes within `METRICS_TIMEOUT_S` (the call is then cancelled) or the call fails."""
        calls: list[Any] = []

        async def get() -> tuple[str, int, bytes]:
            calls.append(self.engine.options(stream=True).remote(EngineRequest("GET", path, headers=headers,
                                                                               replica_id=replica_id)))
            stream = calls[0]
            head = await stream.__anext__()
            body = b"".join([piece async for piece in stream])
            return head["replica"], head["status"], body

        try:
            return await asyncio.wait_for(get(), METRICS_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - a replica gone or busy must not fail the caller
            logger.warning("no answer from replica %s to GET %s: %s: %s", replica_id, path, type(error).__name__,
                           error)
            for call in calls:
                with contextlib.suppress(Exception):
                    call.cancel()
            return None

    async def _owner_of(self, stored_id: str, headers: tuple[tuple[str, str], ...]) -> str | None:
        """The replica that stored response `stored_id`: the one that answered it through this ingress, else the
        first replica the index knows whose `GET /v1/responses/{id}` finds it (asked with the client's `headers`,
        one at a time: calls made while serving one HTTP request share its Ray request id, and Ray 2.60 fulfils
        pending calls by that id, ray_router.py); None when none has it."""
        known = self.owners.get(stored_id)
        if known is not None:
            return known
        for replica_id in sorted(await self.index.stats.remote()):
            answer = await self._pinned_get(replica_id, f"{RESPONSES_PATH}/{quote(stored_id, safe='')}", headers)
            if answer is not None and answer[1] == 200:
                self.owners.put(stored_id, answer[0])
                return answer[0]
        return None

    async def _forward(self, request: Request) -> Response:
        raw = await read_body(request, self.max_request_bytes)
        try:
            body = json.loads(raw)
        except (RecursionError, ValueError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from None
        path = request.url.path
        work = functools.partial(routed_prompt_ids, path, body, self.tokenizer, self.template_kwargs,
                                 await self._prompt_limits())
        # on the ingress's own tokenizer threads: long prompts hold up only other prompts (as app.py's)
        prompts = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work)
        stored_id = continued_id(path, body)
        owner = await self._owner_of(stored_id, _headers(request)) if stored_id else None
        return await self._send(EngineRequest("POST", path, raw, _headers(request), tuple(tuple(p) for p in prompts),
                                              uuid.uuid4().hex, replica_id=owner or "",
                                              cache_salt=routed_cache_salt(body) or ""),
                                learn=path == RESPONSES_PATH and stores(body))

    async def _prompt_limits(self) -> PromptLimits:
        """The replicas' prompt limits: `max_model_len` from a replica's /v1/models card (asked once, when first
        needed; every replica runs with the same options), so that a prompt text they would refuse by its size is
        not tokenized here (router/prompts.py)."""
        if self.limits.max_model_len is None:
            with contextlib.suppress(Exception):
                answer = await asyncio.wait_for(self._send(EngineRequest("GET", "/v1/models", headers=self._key)),
                                                METRICS_TIMEOUT_S)
                lens = [card.get("max_model_len") for card in json.loads(answer.body)["data"]]
                lens = [n for n in lens if isinstance(n, int) and n > 0]
                if lens:
                    self.limits = PromptLimits(max(lens), self.limits.token_bytes)
        return self.limits

    async def _send(self, request: EngineRequest, learn: bool = False) -> Response:
        """Send `request` to a replica and relay its answer, trying again (at most `MAX_ATTEMPTS` calls) when
        the replica fails before answering. `learn`: the answer is a stored response, whose id is remembered
        with the replica that answered."""
        last_error = "no attempt"
        for attempt in range(MAX_ATTEMPTS):
            if attempt and request.route_key:
                self.counters.num_retries += 1
            stream = self.engine.options(stream=True).remote(request)
            try:
                head = await stream.__anext__()
            except (RayActorError, ActorUnavailableError) as error:
                last_error = f"{type(error).__name__}: {error}"
                logger.warning("an engine replica failed before answering; trying another: %s", last_error)
                continue
            replica, predicted = (head["replica"], None) if request.route_key else (None, None)
            if replica is not None:  # a completion (the others are not counted)
                predicted = ray_metrics.PREDICTED_HITS.take(request.route_key, replica)
                self.counters.of(replica).routed += 1
                self.counters.in_flight[replica] = self.counters.in_flight.get(replica, 0) + 1
            headers = {k: v for k, v in head["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
            learn = learn and head["status"] == 200
            if headers.get("content-type", "").startswith("text/event-stream"):
                done = functools.partial(self._ended, replica, predicted, stream=True)
                return StreamingResponse(_relay(stream, done, self._reader(head["replica"]) if learn else None,
                                                is_anthropic(request.path)),
                                         status_code=head["status"], headers=headers)
            try:
                content = b"".join([piece async for piece in stream])
            except (RayActorError, ActorUnavailableError) as error:
                self._ended(replica, predicted, None)
                raise APIError(502, f"the engine replica failed while answering: {error}") from None
            if learn and (stored := response_id(content)) is not None:
                self.owners.put(stored, head["replica"])
            self._ended(replica, predicted, content if head["status"] == 200 else b"")
            return Response(content, status_code=head["status"], headers=headers)
        self.counters.num_failed += bool(request.route_key)
        raise APIError(503, f"no engine replica could take the request: {last_error}")

    def _reader(self, replica: str) -> Callable[[bytes], None]:
        """A stream's `head` callback (`_relay`) that remembers its response id as stored on `replica`."""
        head = StreamHead()

        def read(piece: bytes) -> None:
            if (stored := head.feed(piece)) is not None:
                self.owners.put(stored, replica)

        return read

    def _ended(self, replica: str | None, predicted: int | None, content: bytes | None,
               stream: bool = False) -> None:
        """Count a completion that ended: `content` its body (a stream's tail; None: cut, a failure). Nothing
        for `replica` None (a request that is not counted)."""
        if replica is None:
            return
        self.counters.in_flight[replica] -= 1
        if content is None:
            self.counters.num_failed += 1
            return
        if predicted is None or not content:
            return
        usage = stream_usage(content) if stream else None
        if not stream:
            with contextlib.suppress(ValueError, AttributeError):
                usage = json.loads(content).get("usage")
        record_usage(replica, self.counters.of(replica), usage, predicted)


def build_app(serve_args: Sequence[str] = (), num_replicas: int = 2, num_cpus: float = 1.0, num_gpus: float = 0.0,
              routing: RoutingConfig | None = None, poll_interval_s: float = 0.5,
              max_ongoing_requests: int = 64) -> Any:
    """The Serve application: `num_replicas` engine replicas of `serve_args`, each with `num_cpus` CPUs and
    `num_gpus` GPUs (1 for one device each), at most `max_ongoing_requests` requests each, routed by `routing`
    (its policy and balance margins; default `RoutingConfig()`), behind the OpenAI ingress."""
    routing = routing or RoutingConfig()
    index = serve.deployment(CacheIndex, name=INDEX_DEPLOYMENT, num_replicas=1, max_ongoing_requests=100_000,
                             ray_actor_options={"num_cpus": 0},
                             logging_config={"enable_access_log": False}).bind()  # a line per push otherwise
    router = RequestRouterConfig(request_router_class=CheckpointRequestRouter,
                                 request_router_kwargs={**asdict(routing), "index_deployment": INDEX_DEPLOYMENT})
    engine = serve.deployment(HybridcacheEngine, name=ENGINE_DEPLOYMENT, num_replicas=num_replicas,
                              max_ongoing_requests=max_ongoing_requests, request_router_config=router,
                              ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
                              ).bind(list(serve_args), index, poll_interval_s)
    return serve.deployment(OpenAIIngress, name="OpenAIIngress", ray_actor_options={"num_cpus": 0}).bind(
        engine, index, list(serve_args))


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run hybridcache.router.ray_serve:app_builder serve_args="..." num_replicas=2 ...` and Serve config
    files: `serve_args` a string of `hybridcache serve` options (split as a shell would), the other keys
    `build_app`'s and `RoutingConfig`'s."""
    import shlex

    known = {"serve_args", "num_replicas", "num_cpus", "num_gpus", "poll_interval_s", "max_ongoing_requests",
             "policy", "abs_margin", "rel_margin", "min_hit_fraction"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown application arguments {unknown}; known: {sorted(known)}")
    routing = RoutingConfig(**{k: type(getattr(RoutingConfig(), k))(args[k])
                               for k in ("policy", "abs_margin", "rel_margin", "min_hit_fraction") if k in args})
    return build_app(shlex.split(str(args.get("serve_args", ""))), int(args.get("num_replicas", 2)),
                     float(args.get("num_cpus", 1.0)), float(args.get("num_gpus", 0.0)), routing,
                     float(args.get("poll_interval_s", 0.5)), int(args.get("max_ongoing_requests", 64)))
