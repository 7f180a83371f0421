"""The FastAPI application: OpenAI-compatible routes over an `EngineLoop`.

    POST /v1/completions        prompt as text or token ids, or a batch of prompts; sampling options,
                                logprobs, echo, structured output (every field: docs/server.md)
    POST /v1/chat/completions   messages and tools through the model folder's chat template; the same
                                options, tool_choice, chat_template_kwargs; the output's tool calls and
                                reasoning parsed out of its text (chat_output.py)
    POST /v1/responses          OpenAI's Responses API over the chat pipeline (responses_api.py)
    POST /v1/messages           Anthropic's Messages API over the chat pipeline, and /v1/messages/count_tokens
                                (anthropic_api.py); the key may come as `x-api-key` too
    GET  /v1/models             the served model
    POST /tokenize, /detokenize vLLM's tokenizer routes; GET /version (tokenize_api.py)
    GET|POST /ping              vLLM's (SageMaker's) liveness route: 200 while the engine is healthy, else 503
    POST /invocations           SageMaker's: a chat completion (`messages`) or completion (`prompt`) request
    GET  /load                  vLLM's `{"server_load": N}`: generation requests in flight (`ServerLoad`)
    GET  /health                200 while the engine thread runs and is consistent, else 503; memory details
                                and the last error only with the API key (when one is set)
    GET  /metrics               Prometheus text format
    GET  /v1/cache/events       POST /v1/cache/match: what the prefix cache holds, for a router (cache_routes.py)
    GET  /debug/engine          only with enable_debug_endpoints: integrity check of an idle engine;
                                `?clear_cache=true` first drops what the prefix cache holds
    POST /reset_prefix_cache    only with enable_debug_endpoints (vLLM's, in its dev mode): the same clear, 200
                                on an idle engine, 409 while requests run

Every error is an OpenAI error object (errors.py), or Anthropic's under /v1/messages (anthropic_protocol.py), never a
500 for a bad request: bodies must be `Content-Type: application/json` (415 otherwise: a browser can POST text/plain
across origins without asking), at most `max_request_bytes`, valid UTF-8 JSON nested at most 128 levels, with no
lone surrogates (body_checks.py); with the opt-in `max_request_tokens`, a request may ask for at most that many
tokens (n x max_tokens). /v1 routes, /invocations and the debug route need the API key when one is configured, as
`Authorization: Bearer` or `x-api-key` (checked before a query parameter is; a bad one is a 400 error object too).
With `allowed_origins` set, CORS headers let those origins call the API from a browser, whatever request headers they
send (the OpenAI JS SDK sends `X-Stainless-*` ones; vLLM's default too). What one request or connection may hold is
limited (limits.py, connections.py); a trailing slash is a 404, never a redirect (whose Location would echo the client's
Host header).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NamedTuple, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridcache.engine.engine import EngineDeadError, freeze_gc_heap
from hybridcache.generation_config import SamplingDefaults
from hybridcache.guided import GrammarCache, GuidedKind
from hybridcache.images import MediaLimits
from hybridcache.mm_processor import split_chat_images
from hybridcache.outputs import RequestOutput, add_delta
from hybridcache.sampling import SamplingParams
from hybridcache.server import log_limits, reasoning
from hybridcache.server.admission import admission_errors, until_final
from hybridcache.server.anthropic_api import add_anthropic_routes
from hybridcache.server.anthropic_protocol import MESSAGES_PATH, anthropic_error_body, sent_keys
from hybridcache.server.cache_routes import CacheRoutes
from hybridcache.server.chat_images import check_media_parts, image_request, image_request_async
from hybridcache.server.chat_output import ChatOutputOptions, ThinkMarkers
from hybridcache.server.chat_prompt import ChatPrompt, checkpoint_steps, render_chat
from hybridcache.server.config import NO_KEY_WARNING, ServerConfig
from hybridcache.server.engine_loop import EngineBusy, EngineFailure, EngineLoop
from hybridcache.server.error_response import ErrorResponse
from hybridcache.server.errors import APIError, error_body
from hybridcache.server.limits import (
    RequestTimeout,
    check_prompt_bytes,
    check_sequences,
    context_length_message,
    max_token_bytes,
    read_body,
)
from hybridcache.server.metrics import ServerMetrics
from hybridcache.server.prompt_ids import body_prompt_ids
from hybridcache.server.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from hybridcache.server.responses import (
    Rendering,
    ResponseMeta,
    full_response,
    shown,
    sse,
)
from hybridcache.server.responses_api import add_responses_routes
from hybridcache.server.shutdown_guard import SHUTDOWN_MESSAGE, ShutdownGuard
from hybridcache.server.special_tokens import special_token_texts, strippable
from hybridcache.server.stream_events import UsageMode, stream_events
from hybridcache.server.streaming import EventStreamResponse
from hybridcache.server.tokenize_api import add_tokenize_routes
from hybridcache.server.tool_formats import tool_format

logger = logging.getLogger("hybridcache.server")
T = TypeVar("T")
TOKENIZER_THREADS = 2  # the threads that run requests' CPU work (`_Routes.in_pool`)
MEDIA_THREADS = 2  # the threads that decode and process requests' images (`_Routes.media_pool`)
GRAMMAR_THREADS = 4  # the threads that compile requests' structured-output grammars (`_Routes.grammar_pool`)
INLINE_BODY_BYTES = 64 * 1024  # a body up to this size is decoded and validated on the event loop (a few ms)


@dataclass(frozen=True)
class ServedModel:
    """What the routes need to know about the model: its tokenizer (the server's own instance, used only on
    the event loop; the engine has another), the prompt + completion limit, and the sampling defaults of fields
    a request leaves unset (from the folder's generation_config.json, see `hybridcache.generation_config`).
    `vocab_size`: the model's vocabulary (token ids in [0, vocab_size) are accepted everywhere; ids past the
    tokenizer's own decode to ""); None: the tokenizer's."""

    tokenizer: Any
    max_model_len: int
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    image_processor: Any = None  # the engine's ImageProcessor; None for a model without a vision tower
    media_limits: MediaLimits = field(default_factory=MediaLimits)
    vocab_size: int | None = None


class PreparedChat(NamedTuple):
    """A chat request ready for the engine: its prompt ids (images expanded), sampling parameters, rendering
    options, image spans, and the prompt steps where the next turn will part from it (`chat_prompt.py`)."""

    prompt_ids: list[int]
    params: SamplingParams
    rendering: Rendering
    mm_inputs: tuple
    checkpoints_at: tuple[int, ...]


def build_app(engine_loop: EngineLoop, model: ServedModel, config: ServerConfig, metrics: ServerMetrics) -> FastAPI:
    """The application; its lifespan starts the engine thread and stops it (aborting leftovers) at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from hybridcache.images import LOOP_EXECUTOR_THREADS, DetachedThreadPool

        # the default executor resolves image URLs' hosts: more threads, and a shutdown that does not join them
        asyncio.get_running_loop().set_default_executor(
            DetachedThreadPool(LOOP_EXECUTOR_THREADS, thread_name_prefix="hybridcache-loop"))
        if config.api_key is None and not config.binds_loopback_only():
            logger.warning(NO_KEY_WARNING, config.host)
        engine_loop.start()
        routes.prepare_grammars()
        freeze_gc_heap()
        yield
        # (on a thread of its own: never queued behind requests' work, nor behind asyncio's default executor)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybridcache-stop") as stopper:
            await asyncio.get_running_loop().run_in_executor(stopper, engine_loop.stop)
        for pool in (routes.tokenizer_pool, routes.media_pool, routes.grammar_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="hybridcache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    routes = _Routes(engine_loop, model, config, metrics)
    app.add_middleware(ShutdownGuard)  # (added first, so innermost: CORS headers go on its 503 too)
    app.add_middleware(LoadCounting, load=routes.load)
    if config.allowed_origins:
        # any request header, as vLLM's default (`--allowed-headers '*'`): the origins decide who gets in, and the
        # OpenAI JS SDK sends X-Stainless-* headers on every request
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return ErrorResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(request: Request, error: RequestValidationError) -> JSONResponse:
        """A bad query parameter (`?limit=abc`): a 400 naming it, as vLLM's, not FastAPI's bare 422. (Routes that
        need the API key check it first: `keyed` below.)"""
        first = error.errors()[0] if error.errors() else {}
        where = [str(part) for part in first.get("loc", ())]
        name = where[-1] if where else None
        kind = f"{where[0]} parameter" if len(where) > 1 else "parameter"
        message = f"invalid {kind} {name!r}: {first.get('msg', 'invalid value')}"
        return ErrorResponse(error_body(400, message, param=name), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, error: ClientDisconnect) -> Response:
        logger.info("%s %s: the client disconnected while sending its request", request.method, request.url.path)
        return Response(status_code=499)

    def shaped(request: Request, status: int, message: str) -> JSONResponse:
        """An error in the shape of the API the path belongs to: Anthropic's under /v1/messages, else OpenAI's."""
        path = get_route_path(request)
        anthropic = path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")
        body = anthropic_error_body(status, message) if anthropic else error_body(status, message)
        return ErrorResponse(body, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return shaped(request, error.status_code, f"{request.method} {request.url.path}: {error.detail}")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, error: Exception) -> JSONResponse:
        """Logged here, with the request, once: Starlette re-raises the error after this handler, and uvicorn's
        record of it is dropped (`log_limits.LoggedOnceFilter`)."""
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        log_limits.mark_logged(error)
        return shaped(request, 500, f"internal error: {type(error).__name__}: {error}")

    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/ping", routes.ping, methods=["GET", "POST"])
    app.add_api_route("/invocations", routes.invocations, methods=["POST"])
    app.add_api_route("/load", routes.server_load, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics_text, methods=["GET"])
    keyed = [Depends(routes.require_key)]  # for routes with query parameters: the key is checked before them
    if config.enable_debug_endpoints:
        app.add_api_route("/debug/engine", routes.debug_engine, methods=["GET"], dependencies=keyed)
        app.add_api_route("/reset_prefix_cache", routes.reset_prefix_cache, methods=["POST"])
    cache = CacheRoutes(engine_loop, routes._authorize, routes._read_json, routes.body_prompt_ids)
    app.add_api_route("/v1/cache/events", cache.events, methods=["GET"], dependencies=keyed)
    app.add_api_route("/v1/cache/match", cache.match, methods=["POST"])
    add_responses_routes(app, routes)
    add_anthropic_routes(app, routes)
    add_tokenize_routes(app, routes)
    return app


@dataclass
class ServerLoad:
    """vLLM's server load (`GET /load`): the generation requests (`GENERATION_ROUTES`) in flight, each counted
    from the moment it reaches the server until its response, a stream included, has been sent, or has failed, or
    its client has gone (`LoadCounting`), as vLLM's `load_aware_call` counts them. Only the event loop touches it."""

    GENERATION_ROUTES: ClassVar[frozenset[str]] = frozenset({"/v1/completions", "/v1/chat/completions",
                                                             "/v1/responses", "/v1/messages", "/invocations"})
    num_requests: int = 0


class LoadCounting:
    """ASGI middleware: counts a POST to a generation route in `load` while the application runs it."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        counted = scope["type"] == "http" and scope["method"] == "POST" \
            and get_route_path(scope) in ServerLoad.GENERATION_ROUTES  # (under --root-path, path has the prefix)
        if not counted:
            await self.app(scope, receive, send)
            return
        self.load.num_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.num_requests -= 1


class _Routes:
    def __init__(self, engine_loop: EngineLoop, model: ServedModel, config: ServerConfig,
                 metrics: ServerMetrics) -> None:
        self.engine_loop = engine_loop
        self.load = ServerLoad()
        # the engine's grammar cache (thread-safe), where a request's constraint compiles off the engine thread
        # (`compile_constraint`); None with a stand-in loop or engine: the engine compiles it
        self.grammars: GrammarCache | None = getattr(getattr(engine_loop, "engine", None), "grammars", None)
        self.model = model
        self.config = config
        self.metrics = metrics
        self.created = int(time.time())
        limit = max_token_bytes(model.tokenizer)
        self.prompt_byte_limit = None if limit is None else model.max_model_len * limit
        # tokenizing a long prompt takes a while: it runs here, off the event loop (the tokenizer releases the
        # GIL); one warm-up call first sets the backend's options, which must not change under concurrent calls
        if model.tokenizer is not None:
            model.tokenizer.encode("warm-up")
        # the think tags' token ids, for the reasoning token count in `usage` (with a reasoning parser)
        self.think_markers = ThinkMarkers.of(model.tokenizer, config.reasoning_parser.call_sections) \
            if config.reasoning_parser is not None and model.tokenizer is not None else None
        # the texts of the tokenizer's special tokens, kept for a tool-call parser whose tags are among them
        self.special_texts = special_token_texts(getattr(model.tokenizer, "hf", None))
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS,
                                                                    thread_name_prefix="hybridcache-tokenize")
        # images are fetched on the event loop (no thread waits on a slow server), then decoded here; grammars
        # compile on their own threads: neither queues behind the other, nor behind asyncio's default executor
        self.media_pool = concurrent.futures.ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="hybridcache-media")
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_THREADS,
                                                                  thread_name_prefix="hybridcache-grammar")

    def prepare_grammars(self) -> None:
        """Start `GrammarCache.prepare` (the structured-output libraries' imports and tokenizers, seconds) on a thread
        of its own, at start-up: neither /health nor the engine waits for it, and a request that compiles a grammar
        meanwhile waits for the build it needs rather than starting its own. Nothing without a grammar cache."""
        if self.grammars is not None:
            threading.Thread(target=self._prepare_grammars, args=(self.grammars,), name="hybridcache-grammar-prepare",
                             daemon=True).start()

    @staticmethod
    def _prepare_grammars(grammars: GrammarCache) -> None:
        try:
            grammars.prepare()
        except Exception:  # noqa: BLE001 - the first constrained request then builds what it needs (and says why not)
            logger.warning("preparing structured output at start-up failed; the first constrained request will try "
                           "again", exc_info=True)

    async def in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer threads, off the event loop: a request's CPU work (decoding and validating
        a large body, rendering the chat template, tokenizing). The pool is bounded (`TOKENIZER_THREADS`, as vLLM
        bounds its renderer's), so many large requests wait for a thread rather than take them all."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    # ------------------------------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        body: CompletionRequest = await self.read_request(request, CompletionRequest)
        self._check_model(body.model)
        body.check_n()
        prompts = body.prompts()
        check_sequences(len(prompts), body.n, self.config.limits)
        defaults = self.model.sampling_defaults
        # vLLM's: the request's max_tokens defaults to 16, which the generation config may lower, never raise
        default_max = min(COMPLETIONS_DEFAULT_MAX_TOKENS, defaults.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
        echo_only = body.echo_only()  # max_tokens 0: the engine samples one token that no choice shows
        requested = 1 if echo_only else body.max_tokens
        cut = body.truncation(self.model.max_model_len, default_max if requested is None else requested)
        if cut is None:
            check_prompt_bytes(prompts, self.prompt_byte_limit, self.model.max_model_len, "prompt")
        else:  # a truncated prompt may be of any length: only the end it keeps is tokenized
            prompts = [cut.text_window(p, self.prompt_byte_limit, self.model.max_model_len)
                       if isinstance(p, str) else p for p in prompts]
        tokenizer = self.model.tokenizer
        encoded = await self._encode(prompts)
        prompt_ids = encoded if cut is None else [cut.apply(ids) for ids in encoded]
        longest = max(prompt_ids, key=len)
        max_tokens = self._max_tokens(requested, len(longest), default_max, "prompt", body.n * len(prompts))
        params = body.sampling_params(max_tokens, body.guided(), defaults)
        await self.compile_constraint(params, body)
        # the echo is the prompt as given, or its (truncated) token ids decoded with special tokens kept, as vLLM
        echo = tuple(p if isinstance(p, str) and len(ids) == len(whole) else
                     tokenizer.decode(ids, skip_special_tokens=False)
                     for p, ids, whole in zip(prompts, prompt_ids, encoded)) if body.echo else None
        rendering = Rendering(logprobs=params.logprobs is not None,
                              num_logprobs=params.logprobs or 0, tokenizer=tokenizer, echo_texts=echo,
                              echo_only=echo_only, prompt_logprobs=body.prompt_logprobs,
                              return_token_ids=body.return_token_ids,
                              tokens_as_ids=body.return_tokens_as_token_ids)
        meta = ResponseMeta.new(f"cmpl-{uuid.uuid4().hex}", self.config.served_model_name, chat=False)
        return await self._respond(request, meta, prompt_ids, params, body, rendering)

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        body: ChatCompletionRequest = await self.read_request(request, ChatCompletionRequest)
        chat = await self.prepare_chat(body)
        meta = ResponseMeta.new(f"chatcmpl-{uuid.uuid4().hex}", self.config.served_model_name, chat=True)
        return await self._respond(request, meta, [chat.prompt_ids], chat.params, body, chat.rendering,
                                   chat.mm_inputs, chat.checkpoints_at)

    async def invocations(self, request: Request) -> Response:
        """SageMaker's route, as vLLM serves it: a chat completion request (a body with `messages`) or a completion
        request (with `prompt`), answered as /v1/chat/completions or /v1/completions would answer it."""
        self._authorize(request)
        raw = await self._read_body(request)
        body = _decode_json(raw) if len(raw) <= INLINE_BODY_BYTES else await self.in_pool(_decode_json, raw)
        route = None
        if isinstance(body, dict):
            route = self.chat_completions if "messages" in body else self.completions if "prompt" in body else None
        if route is None:
            raise APIError(400, "/invocations takes a chat completion request (with 'messages') or a completion "
                           "request (with 'prompt')")
        replayed = False

        async def receive() -> Message:  # the body again for the route, then the client's own messages
            nonlocal replayed
            if replayed:
                return await request.receive()
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        return await route(Request(request.scope, receive))

    async def prepare_chat(self, body: ChatCompletionRequest) -> PreparedChat:
        """A chat request's prompt (the messages and tools through the chat template), sampling parameters,
        rendering options, image spans and checkpoint steps (`PreparedChat`); a bad request is an APIError."""
        self._check_model(body.model)
        body.check_n()
        check_sequences(1, body.n, self.config.limits)
        chat_prompt, images, tools = await self.in_pool(self._render_chat, body)
        text = chat_prompt.text
        defaults = self.model.sampling_defaults
        requested = body.requested_max_tokens()
        cut = body.truncation(self.model.max_model_len, (defaults.max_tokens or 0) if requested is None else requested)
        if cut is None or images:  # (truncation may not cut a prompt with images: it is a 400 below)
            check_prompt_bytes([text], self.prompt_byte_limit, self.model.max_model_len, "messages")
        else:  # a truncated prompt may be of any length: only the end it keeps is tokenized
            text = cut.text_window(text, self.prompt_byte_limit, self.model.max_model_len)
        prompt_ids = (await self._encode([text]))[0]
        mm_inputs: tuple = ()
        if images:  # fetched (URLs), then decoded, processed and placeholders expanded off the event loop
            prompt_ids, mm_inputs = await self.image_request(prompt_ids, images)
        elif self.model.image_processor is not None:  # no images: no stray placeholder either
            prompt_ids, _ = image_request(self.model.image_processor, prompt_ids, (), self.model.media_limits)
        kept = prompt_ids if cut is None else cut.apply(prompt_ids)
        if mm_inputs and len(kept) < len(prompt_ids):
            raise APIError(400, "truncate_prompt_tokens would cut a prompt that holds images; send fewer messages",
                           param="truncate_prompt_tokens")
        # the next turn parts from this prompt in its generation prompt, which a cut from the right drops
        head_only = cut is not None and cut.side == "right" and len(kept) < len(prompt_ids)
        prompt_ids = kept
        max_tokens = self._max_tokens(requested, len(prompt_ids), defaults.max_tokens, "messages", body.n)
        split_reasoning = self.config.reasoning_parser is not None
        in_reasoning = chat_prompt.in_reasoning
        guided = body.guided()
        tool_choice = body.effective_tool_choice()
        parse_tools = bool(tools) and tool_choice != "none"
        calls_format = tool_format(self.config.tool_call_parser)
        if guided is not None and guided.kind is GuidedKind.TOOL_CALLS:  # a forced call, in the model's own format
            guided = replace(guided, tool_format=calls_format.forced)
        if guided is not None and split_reasoning and in_reasoning:  # as vLLM: the answer is constrained, not the
            guided = replace(guided, starts_after=reasoning.THINK_END)  # reasoning before it
        params = body.sampling_params(max_tokens, guided, defaults)
        # the tool parser's tags (or the reasoning parser's section tags) are special tokens: decoded, kept for the
        # parsers, and the other special tokens taken out; section tags the tool parser does not read are kept for
        # the reasoning split only, then taken out of the content (special_tokens.py)
        sections = self.config.reasoning_parser.call_sections if split_reasoning else ()
        parsed_tags = calls_format.tags if parse_tools else ()
        strip_tokens = strippable(self.special_texts, (*parsed_tags, *sections)) \
            if params.skip_special_tokens else None
        if strip_tokens is not None:
            params = replace(params, skip_special_tokens=False)
        split_only = tuple(tag for tag in sections if tag not in parsed_tags) if strip_tokens is not None else ()
        await self.compile_constraint(params, body)
        forced = "named" if isinstance(tool_choice, dict) else "required" if tool_choice == "required" else "auto"
        chat = ChatOutputOptions(
            split_reasoning=split_reasoning,
            in_reasoning=in_reasoning,
            call_sections=sections,
            include_reasoning=body.include_reasoning,
            think_markers=self.think_markers,
            parse_tools=parse_tools,
            tools=tools,
            tool_call_parser=self.config.tool_call_parser,
            strip_tokens=strip_tokens or (),
            split_only_tags=split_only,
            tool_choice=forced,
            parallel_tool_calls=body.parallel_tool_calls,
            echo=body.echo_text(),
        )
        rendering = Rendering(chat=chat, logprobs=params.logprobs is not None and not chat.hides_reasoning,
                              tokenizer=self.model.tokenizer, num_logprobs=params.logprobs or 0,
                              prompt_logprobs=body.prompt_logprobs, return_token_ids=body.return_token_ids,
                              tokens_as_ids=body.return_tokens_as_token_ids)
        checkpoints = () if head_only else await self.in_pool(checkpoint_steps, self.model.tokenizer, prompt_ids,
                                                               chat_prompt)
        return PreparedChat(prompt_ids, params, rendering, mm_inputs, checkpoints)

    async def image_request(self, prompt_ids: list[int], images: list) -> tuple[list[int], tuple]:
        """`chat_images.image_request_async` with the model's processor and limits, decoding on `media_pool`."""
        return await image_request_async(self.model.image_processor, prompt_ids, images, self.model.media_limits,
                                         self.media_pool)

    async def compile_constraint(self, params: SamplingParams, body: CompletionRequest | ChatCompletionRequest) -> None:
        """Compile the request's structured-output grammar, if any, on a worker thread into the engine's grammar
        cache (`self.grammars`), so that the engine thread's `add_request` finds it compiled: a schema
        that takes seconds to compile no longer stalls every other stream meanwhile (vLLM compiles in a thread pool
        too). A bad constraint is a 400 naming its field."""
        if params.guided is None or self.grammars is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(self.grammar_pool, self.grammars.check, params.guided)
        except ValueError as error:
            raise APIError(400, str(error), param=body.engine_error_param(str(error))) from None

    def _render_chat(self, body: ChatCompletionRequest) -> tuple[ChatPrompt, list, list[dict[str, Any]] | None]:
        """The messages and tools through the chat template (on the tokenizer threads: a long conversation takes
        seconds), with the messages' images split out; returns the prompt, the images and the tools."""
        messages = [m.as_template_input() for m in body.messages]
        check_media_parts(messages, takes_images=self.model.image_processor is not None)
        messages, images = split_chat_images(messages)
        tools = body.tool_dicts()
        try:
            chat_prompt = render_chat(self.model.tokenizer, messages, add_generation_prompt=body.add_generation_prompt,
                                      continue_final_message=body.continue_final_message, tools=tools,
                                      template_kwargs=body.template_kwargs(self.config.default_chat_template_kwargs))
        except Exception as error:  # noqa: BLE001 - template errors (bad roles, no template) are the client's
            raise APIError(400, f"the chat template could not render these messages: {error}",
                           param="messages") from None
        return chat_prompt, images, tools

    async def _respond(self, request: Request, meta: ResponseMeta, prompts: list[list[int]], params: SamplingParams,
                       body: CompletionRequest | ChatCompletionRequest, rendering: Rendering,
                       mm_inputs: tuple = (), checkpoints_at: tuple[int, ...] = ()) -> Response:
        """Run one engine request per prompt (ids `<response id>` or `<response id>-<i>` for a batch); `mm_inputs`:
        the image spans of a single prompt, `checkpoints_at` its checkpoint steps (`EngineLoop.add_many`)."""
        loop = self.engine_loop
        request_ids = [meta.response_id] if len(prompts) == 1 else [f"{meta.response_id}-{i}"
                                                                     for i in range(len(prompts))]

        def abort_all() -> None:
            for request_id in request_ids:
                loop.abort(request_id)  # a no-op once it has finished

        with admission_errors(abort_all, body.engine_error_param):
            # all join one step, or none is queued (`mm_inputs`: a chat's images, so of its one prompt)
            sinks = await loop.add_many(request_ids, prompts, params, [mm_inputs] * len(prompts),
                                        [checkpoints_at] * len(prompts), echo_only=rendering.echo_only,
                                        cache_salt=body.cache_salt, final_only=not body.stream)
        timeout = self.config.limits.request_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        outputs = _merged([request_outputs(sink, rendering, deadline) for sink in sinks])
        if body.stream:
            forced = self.config.force_include_usage
            usage_mode = UsageMode(body.include_usage(forced), body.continuous_usage(forced),
                                   [len(p) for p in prompts])
            events = stream_events(meta, outputs, params, prompts, usage_mode, rendering)
            final_events = (sse(error_body(503, SHUTDOWN_MESSAGE)), sse("[DONE]"))
            return EventStreamResponse(events, on_close=abort_all, final_events=final_events)
        finals = await until_final(request, _last(outputs, len(prompts)), abort_all)
        if finals is None:
            return Response(status_code=499)
        return JSONResponse(full_response(meta, finals, rendering))

    def _max_tokens(self, requested: int | None, prompt_len: int, default: int | None, prompt_param: str,
                    n: int) -> int:
        """The new-token limit of each of the `n` choices: `requested` if it fits the context (else 400, in vLLM's
        words, which clients match), or the default (`default`, else all the room the prompt leaves), cut to fit.
        With the opt-in `max_request_tokens` budget, n x max_tokens must also fit it."""
        limit = self.model.max_model_len
        if prompt_len >= limit:
            raise APIError(400, context_length_message(limit, prompt_len), param=prompt_param,
                           code="context_length_exceeded")
        room = limit - prompt_len
        n = max(n, 1)  # n < 1 is refused with the other sampling options
        budget = self.config.max_request_tokens
        if budget is not None and n > budget:
            raise APIError(400, f"n is {n}, but a request may generate at most {budget} tokens in all "
                           "(--max-request-tokens)", param="n")
        if requested is None:
            cap = room if budget is None else min(room, budget // n)
            return min(room if default is None else default, cap)
        if budget is not None and requested >= 1 and n * requested > budget:
            raise APIError(400, f"n x max_tokens is {n} x {requested} = {n * requested} tokens; a request may "
                           f"generate at most {budget} tokens in all (--max-request-tokens)", param="max_tokens")
        if requested > room:
            raise APIError(400, context_length_message(limit, prompt_len, requested), param="max_tokens",
                           code="context_length_exceeded")
        return requested

    # ------------------------------------------------------------------------------------ other routes
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "hybridcache",
                  "max_model_len": self.model.max_model_len} for name in self.config.served_model_names]
        return JSONResponse({"object": "list", "data": cards})

    async def health(self, request: Request) -> JSONResponse:
        """Healthy or not for anyone; the engine's counters and last error only for holders of the API key."""
        loop = self.engine_loop
        ok = loop.running and loop.healthy
        body: dict[str, Any] = {"status": "ok" if ok else "unhealthy"}
        if self._has_key(request):
            body.update(engine=loop.state.as_dict(), last_error=loop.last_error)
        return JSONResponse(body, status_code=200 if ok else 503)

    async def ping(self) -> Response:
        """vLLM's (SageMaker's) liveness route: 200 with an empty body while the engine is healthy, else 503."""
        loop = self.engine_loop
        return Response(status_code=200 if loop.running and loop.healthy else 503)

    async def server_load(self) -> JSONResponse:
        """vLLM's `GET /load`: `{"server_load": N}`, the generation requests in flight (`ServerLoad`)."""
        return JSONResponse({"server_load": self.load.num_requests})

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def debug_engine(self, request: Request, clear_cache: bool = False) -> JSONResponse:
        self._authorize(request)
        try:
            state = await self.engine_loop.check(clear_cache=clear_cache)
        except EngineBusy as error:
            raise APIError(409, str(error)) from None
        except (EngineFailure, EngineDeadError) as error:  # (a failed engine: what /health says too)
            raise APIError(503, str(error)) from None
        except AssertionError as error:
            raise APIError(500, f"integrity check failed: {error}") from None
        return JSONResponse({"integrity": "ok", "engine": state.as_dict()})

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's dev-mode route: drop what the prefix cache holds (`debug_engine`'s clear, integrity checked)."""
        await self.debug_engine(request, clear_cache=True)
        return Response(status_code=200)

    # ------------------------------------------------------------------------------------ checks
    async def require_key(self, request: Request) -> None:
        """`_authorize` as a route dependency: FastAPI runs it before it reads the query parameters."""
        self._authorize(request)

    def _authorize(self, request: Request) -> None:
        if not self._has_key(request):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def _has_key(self, request: Request) -> bool:
        """Whether the request carries one of the API keys, as its bearer token or its `x-api-key` header
        (`sent_keys`; always true when none is configured); every key is compared, in constant time each."""
        keys = self.config.api_keys
        if not keys:
            return True
        matches = [hmac.compare_digest(sent, key.encode()) for sent in sent_keys(request.headers) for key in keys]
        return any(matches)

    async def _encode(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of every prompt (text is tokenized on the tokenizer threads, off the event loop)."""
        if not any(isinstance(p, str) for p in prompts):
            return [list(p) for p in prompts]
        encode = self.model.tokenizer.encode
        return await self.in_pool(lambda: [encode(p) if isinstance(p, str) else list(p) for p in prompts])

    def check_prompt_bytes(self, prompts: list[str | list[int]], param: str) -> None:
        """Refuse a prompt text too long to fit `max_model_len` tokens, by its size (limits.py)."""
        check_prompt_bytes(prompts, self.prompt_byte_limit, self.model.max_model_len, param)

    async def body_prompt_ids(self, body: Any) -> list[list[int]]:
        """A completions or chat body's prompts as token ids (`prompt_ids.body_prompt_ids`), rendered and
        tokenized on the tokenizer threads; a text too long to fit is refused before it is tokenized."""
        kwargs = self.config.default_chat_template_kwargs
        return await self.in_pool(body_prompt_ids, body, self.model.tokenizer, kwargs, self.check_prompt_bytes)

    def _check_model(self, name: str | None) -> None:
        served = self.config.served_model_names
        if name is not None and name not in served:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in served)}",
                           param="model", code="model_not_found")

    async def read_request(self, request: Request, model: type[T]) -> T:
        """A JSON body validated as `model` (`parse_request`); one of over `INLINE_BODY_BYTES` is decoded and
        validated on the tokenizer threads (8 MB of short messages took 2 s of the event loop)."""
        raw = await self._read_body(request)

        def parse() -> T:
            return parse_request(model, _decode_json(raw))

        return parse() if len(raw) <= INLINE_BODY_BYTES else await self.in_pool(parse)

    async def _read_json(self, request: Request) -> Any:
        """A JSON body, decoded (on the tokenizer threads when over `INLINE_BODY_BYTES`)."""
        raw = await self._read_body(request)
        return _decode_json(raw) if len(raw) <= INLINE_BODY_BYTES else await self.in_pool(_decode_json, raw)

    async def _read_body(self, request: Request) -> bytes:
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise APIError(415, f"the request body must be sent as 'Content-Type: application/json', got "
                           f"{media_type or 'no content type'!r}", param="content-type")
        return await read_body(request, self.config.max_request_bytes)


def _decode_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {error}") from None


async def request_outputs(sink: asyncio.Queue, rendering: Rendering,
                          deadline: float | None = None) -> AsyncIterator[RequestOutput]:
    """A request's outputs as its choices show them (`responses.shown`; the engine loop adds up on `sink` what
    its handler has not taken yet). Raises EngineFailure when the engine failed while running the request,
    RequestTimeout when it has not finished by `deadline` (the event loop's clock; None: never; the engine loop
    also aborts it past the server's timeout, when this handler is stuck writing to a client that stopped
    reading). An output already on `sink` is taken whatever the clock says: the deadline bounds only waiting (on
    Python <= 3.11 `wait_for(get(), 0)` dropped a finished answer queued while the handler was writing to a slow
    client). The outputs of a streamed request, DELTA on its queue, are added up here (`add_delta`): each one
    yielded holds everything so far (it is the same object, grown: read it before the next)."""
    total: RequestOutput | None = None
    while True:
        if not sink.empty():
            item = sink.get_nowait()
        elif deadline is None:
            item = await sink.get()
        else:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                item = await asyncio.wait_for(sink.get(), remaining)
            except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
                raise RequestTimeout("the request did not finish within the server's request timeout "
                                     "(--request-timeout); it was aborted") from None
        if isinstance(item, Exception):
            raise item
        total = item if total is None else add_delta(total, item)
        yield shown(total, rendering)
        if total.finished:
            return


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several requests' outputs, as they come."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()


async def _last(outputs: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    last: list[RequestOutput | None] = [None] * count
    async for i, output in outputs:
        last[i] = output
    return last
