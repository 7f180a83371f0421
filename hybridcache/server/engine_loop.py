"""The one thread that owns the engine. HTTP handlers reach it only through its command queue.

    event loop (HTTP handlers)                       engine thread
    ------------------------------                   ----------------------------------------------
    await add_many(ids, prompts)   --- _Add ----->   engine.add_request for each (errors go back to the caller)
    abort(id)                      --- _Abort --->   engine.abort, metrics
    await check(clear_cache)       --- _Check --->   engine.check_integrity (idle only)
    await call(fn)                 --- _Call ---->   fn(engine) between steps (reads of the prefix cache)
                                                     while requests are unfinished: engine.step()
    per-request asyncio.Queue      <-- outputs ---   loop.call_soon_threadsafe(_put_each, [(queue, output), ...])

Commands are drained before every step, so every request that arrived meanwhile joins the next step's batch,
and a batch of prompts (one `_Add`) is queued whole: all its prompts join the same step, or none is queued (a
bad prompt, or `max_queued_requests` waiting sequences: `QueueFull`).
A step's outputs go over in one call (each call wakes the event loop, which then takes the GIL from this thread).
Each item on a request's queue is a `RequestOutput` (the last one has `finished` set), an `EngineFailure` (the
engine raised; the request was aborted) or a `RequestTimeout` (it ran past `request_timeout_s`; aborted). A streamed
request runs as `RequestOutputKind.DELTA` (each output holds what is new, so a long completion costs the engine
thread the same at every step), one that is not as FINAL_ONLY. An output is added to the one its handler has not
taken yet (`outputs.add_delta`, as vLLM's `RequestOutputCollector` merges them), so a handler that stopped reading
(a stream whose client stopped reading blocks in its write) holds one output, not one per step; and the thread
itself aborts a request past its deadline, whether or not its handler is listening. After every step the thread
publishes an `EngineState` snapshot that any thread may read (`state`), and, every `stats_interval_s` seconds while
something changes, logs the stats line (`server.stats_log`); an idle thread waits on its queue only as long as a
pending line allows, and when its wait ends the next line's interval starts there (a line covers at most one
interval of activity).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from hybridcache.engine.engine import EngineDeadError, ValidPrompt
from hybridcache.outputs import RequestOutput, RequestProgress, add_delta
from hybridcache.sampling import RequestOutputKind, SamplingParams
from hybridcache.server import log_limits
from hybridcache.server.engine_state import EngineState, check_engine, read_engine_state
from hybridcache.server.limits import QueueFull, RequestTimeout
from hybridcache.server.metrics import RequestPhases, ServerMetrics
from hybridcache.server.stats_log import StatsCounters, StatsLogger

logger = logging.getLogger("hybridcache.server")
RUNNING_BLOCKS_INTERVAL_S = 0.25


class EngineFailure(Exception):
    """The engine raised while running a request; the request was aborted and the server goes on."""


class EngineBusy(Exception):
    """An idle-only operation was asked for while requests are running."""


@dataclass
class _Add:
    """Requests with the same params, queued together: `prompts[i]` is request `request_ids[i]`."""

    request_ids: list[str]
    prompts: list[str | list[int] | ValidPrompt]
    params: SamplingParams
    sinks: list[asyncio.Queue]
    done: asyncio.Future
    mm_inputs: list[tuple]  # per prompt: its image spans (encoded on the engine thread), () for none
    checkpoints_at: list[tuple[int, ...]]  # per prompt: `LLMEngine.add_request`'s checkpoints_at, () for none
    arrival: float  # perf_counter() when the event loop queued them (TTFT, e2e and the deadline count from here)
    echo_only: bool = False  # `max_tokens: 0` with echo: the one token each asks for is no generated token
    cache_salt: str | None = None  # every prompt's `LLMEngine.add_request` cache_salt (the request body's)
    final_only: bool = False  # not streamed: the engine's FINAL_ONLY (its queue gets the final output only)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Check:
    clear_cache: bool
    done: asyncio.Future


@dataclass
class _Call:
    fn: Any
    done: asyncio.Future


@dataclass
class _Stop:
    pass


@dataclass
class _Completion:
    """Engine-thread bookkeeping of one of a request's n completions (vLLM runs each as a child request of its
    own, observed on its own in the latency histograms)."""

    num_tokens: int = 0  # timed (TTFT, ITL)
    received: int = 0  # held by the request's outputs so far
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class _Stream:
    """Engine-thread bookkeeping of one request. `arrival`: when the event loop queued it (vLLM's
    `arrival_time`: TTFT, e2e and `request_timeout_s` count from here); `queued`: when this thread added it to
    the engine (the queue time counts from here, as vLLM's QUEUED -> SCHEDULED)."""

    sink: asyncio.Queue
    arrival: float
    queued: float
    echo_only: bool = False
    started: float | None = None  # the start of the first step that computed it
    prompt_counted: bool = False  # its prompt and cached tokens are in the counters (`_count_prompt`)
    completions: list[_Completion] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.completions)


class EngineLoop:
    """Runs `engine` (an `LLMEngine`) in a dedicated thread; see the module docstring."""

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None,
                 stats_interval_s: float | None = None, max_queued_requests: int | None = None,
                 request_timeout_s: float | None = None) -> None:
        self._engine = engine
        self._max_queued = max_queued_requests  # waiting sequences (None: no limit); see `add_many`
        self._timeout_s = request_timeout_s  # a request still running this long after its add is aborted
        self._metrics = metrics
        self._stats = (StatsLogger(stats_interval_s, time.monotonic(), log_limits.replica_index())
                       if stats_interval_s else None)  # a data-parallel replica's lines name it: Engine 00N
        self._generated = self._queried = self._hit = 0  # engine thread only: totals for the stats line
        self._gaps: collections.Counter[float] = collections.Counter()  # a step's ITLs: previous token time -> count
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.state: EngineState = read_engine_state(engine)
        self._running_blocks_at = time.monotonic()  # engine thread only: when num_blocks_running was counted
        self.healthy = True
        self.last_error: str | None = None
        self._ended = False  # the thread is ending on an error (`_end`): `running` is False from here on

    # ---------------------------------------------------------------------------- event-loop side
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await `add` and `check`."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="hybridcache-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort whatever still runs and end the thread (blocks until it has)."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._ended

    async def add(self, request_id: str, prompt: str | list[int] | ValidPrompt, params: SamplingParams,
                  mm_inputs: tuple = (), checkpoints_at: tuple[int, ...] = (),
                  echo_only: bool = False, *, cache_salt: str | None = None,
                  final_only: bool = False) -> asyncio.Queue:
        """Queue one request (`mm_inputs`: its image spans; `checkpoints_at`, `echo_only`, `cache_salt`,
        `final_only`: see `add_many`); returns its output queue (see `add_many`)."""
        return (await self.add_many([request_id], [prompt], params, [mm_inputs], [checkpoints_at], echo_only,
                                    cache_salt=cache_salt, final_only=final_only))[0]

    async def add_many(self, request_ids: list[str], prompts: list[str | list[int] | ValidPrompt],
                       params: SamplingParams, mm_inputs: list[tuple] | None = None,
                       checkpoints_at: list[tuple[int, ...]] | None = None,
                       echo_only: bool = False, *, cache_salt: str | None = None,
                       final_only: bool = False) -> list[asyncio.Queue]:
        """Queue one request per prompt (`mm_inputs[i]`: prompt i's image spans, encoded on the engine thread;
        `checkpoints_at[i]`: prompt i's steps where later prompts will part from it, `LLMEngine.add_request`'s
        `checkpoints_at`), all in the same command drain (so they join the same step); returns their output
        queues. `echo_only`: completions' `max_tokens: 0` with echo, whose one sampled token no choice shows: the
        generation counters count 0 tokens for them, as `usage` does. `cache_salt`: the request body's (vLLM's
        field), given to every prompt's `LLMEngine.add_request` (a bad one is its ValueError). `final_only`: the
        requests are not streamed: each queue gets its request's final output only (the engine's FINAL_ONLY: no
        output is built at the steps before; their tokens are still timed, from `LLMEngine.step_progress`); else
        they run as DELTA, and a queue's outputs add up to the request's (`outputs.add_delta`).
        Their arrival (TTFT, e2e, the request timeout) is now, even when the engine thread is busy with a step.
        All or nothing: raises the engine's ValueError/TypeError for a bad one, QueueFull when the waiting
        sequences would pass `max_queued_requests`, EngineFailure when the engine is dead."""
        arrival = time.perf_counter()
        if not self.running:
            raise EngineFailure("the engine is not running")
        sinks: list[asyncio.Queue] = [asyncio.Queue() for _ in request_ids]
        done = self._loop.create_future()
        spans = list(mm_inputs) if mm_inputs is not None else [() for _ in request_ids]
        hints = list(checkpoints_at) if checkpoints_at is not None else [() for _ in request_ids]
        self._commands.put(_Add(list(request_ids), list(prompts), params, sinks, done, spans, hints, arrival,
                                echo_only, cache_salt, final_only))
        await done
        return sinks

    def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds (a no-op for an unknown or finished one)."""
        self._commands.put(_Abort(request_id))

    async def check(self, clear_cache: bool = False) -> EngineState:
        """Debug: recompute the engine's counts from scratch (raises on a mismatch; EngineBusy while requests
        run), optionally drop the prefix cache's contents, and return a fresh snapshot."""
        if not self.running:
            raise EngineFailure("the engine is not running")
        done = self._loop.create_future()
        self._commands.put(_Check(clear_cache, done))
        return await done

    async def call(self, fn: Any) -> Any:
        """`fn(engine)` on the engine thread between two steps (nothing else touches the engine meanwhile); its
        result, or its exception raised here."""
        if not self.running:
            raise EngineFailure("the engine is not running")
        done = self._loop.create_future()
        self._commands.put(_Call(fn, done))
        return await done

    @property
    def engine(self) -> Any:
        """The engine; only for setup before `start` (afterwards, reach it through `call`)."""
        return self._engine

    # ---------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        commands: list = []  # the drain being handled
        try:
            self._serve(commands)
        except BaseException as error:  # (an Exception from a step is handled in `_serve`: the server goes on)
            self._end(error, commands)
            raise

    def _end(self, error: BaseException, commands: list) -> None:
        """The thread ends on `error` (a SystemExit, an error outside a step): report unhealthy with it, fail every
        request with an EngineFailure, and every command waiting for an answer (those of the drain being handled,
        those still queued, and, from the event loop, those queued until `running` turned False)."""
        logger.critical("the engine thread ended: %s: %s", type(error).__name__, error, exc_info=error)
        self._ended = True
        self.healthy = False
        self.last_error = f"{type(error).__name__}: {error}"
        failure = EngineFailure(f"the engine thread ended: {self.last_error}")
        try:
            self._abort_all(error)
        finally:
            self._refuse_commands(commands, failure)
            self._call_soon(self._refuse_commands, [], failure)

    def _refuse_commands(self, commands: list, failure: EngineFailure) -> None:
        """Resolve the futures of `commands` and of every command still queued with `failure`."""
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if isinstance(command, (_Add, _Check, _Call)):
                self._resolve(command.done, error=failure)

    def _serve(self, commands: list) -> None:
        """The thread's loop (see the module docstring); `commands` holds each drain while it is handled."""
        engine = self._engine
        while True:
            commands.clear()
            if not engine.has_unfinished_requests():
                with contextlib.suppress(queue.Empty):  # on a timeout, a stats line is due
                    commands.append(self._commands.get(timeout=self._stats_due_in()))
                if self._stats is not None:  # an idle spell ends: the next line covers what comes from now on
                    self._stats.rebase(time.monotonic(), self._stats_counters())
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            self._encode_images(commands)
            for command in commands:
                if isinstance(command, _Stop):
                    self._abort_all(None)
                    return
                self._handle(command)
            if engine.has_unfinished_requests():
                step_start = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as error:  # noqa: BLE001 - a failing request must not end the server
                    logger.exception("engine step failed; aborting the running requests")
                    self._abort_all(error)
                else:
                    self._mark_started(step_start, outputs)
                    # the state the step left, published before its outputs go out: a client holding its answer
                    # reads gauges that count its end (vllm:kv_cache_usage_perc 0 once nothing runs)
                    self._publish_state()
                    self._dispatch(outputs, engine.step_progress())
                    self._expire()
                    self._log_stats()
                    continue
            self._publish_state()
            self._log_stats()

    def _encode_images(self, commands: list) -> None:
        """The images of every request added in this drain through the vision tower together (batched tower
        calls); on an error, each request's `add_request` encodes its own and reports what is wrong with it."""
        adds = [c for c in commands if isinstance(c, _Add) and any(c.mm_inputs)]
        vision = self._engine.vision if adds else None
        if vision is None:
            return
        try:
            encoded = iter(vision.encode([span for c in adds for spans in c.mm_inputs for span in spans]))
        except Exception:  # noqa: BLE001 - left to each request's own add_request
            return
        for command in adds:
            command.mm_inputs = [tuple(next(encoded) for _ in spans) for spans in command.mm_inputs]

    def _handle(self, command: _Add | _Abort | _Check | _Call) -> None:
        engine = self._engine
        if isinstance(command, _Call):
            try:
                result = command.fn(engine)
            except Exception as error:  # noqa: BLE001 - handed to the caller
                self._resolve(command.done, error=error)
            else:
                self._resolve(command.done, result)
            return
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            stream, output = self._abort(command.request_id)
            if stream is not None and output is not None:
                self._send(stream, output)
        elif isinstance(command, _Check):
            if engine.has_unfinished_requests():
                self._resolve(command.done, error=EngineBusy("requests are running; the check needs an idle engine"))
                return
            try:
                state = check_engine(engine, clear_cache=command.clear_cache)
            except Exception as error:  # noqa: BLE001
                self._resolve(command.done, error=error)
                return
            self.state = state
            self._resolve(command.done, state)

    def _add(self, command: _Add) -> None:
        engine = self._engine
        if self._max_queued is not None:
            waiting = engine.stats()["num_waiting"]
            incoming = len(command.request_ids) * command.params.n
            if waiting + incoming > self._max_queued:
                self._resolve(command.done, error=QueueFull(
                    f"the server is busy: {waiting} sequences wait for the engine, and this request would add "
                    f"{incoming} to the {self._max_queued} allowed (--max-queued-requests)"))
                return
        added: list[str] = []
        params = replace(command.params, output_kind=RequestOutputKind.FINAL_ONLY if command.final_only
                         else RequestOutputKind.DELTA)
        try:
            for request_id, prompt, spans, hints in zip(command.request_ids, command.prompts, command.mm_inputs,
                                                        command.checkpoints_at):
                engine.add_request(request_id, prompt, params, spans, checkpoints_at=hints,
                                   cache_salt=command.cache_salt)
                added.append(request_id)
        except Exception as error:  # noqa: BLE001 - handed to the caller
            for request_id in added:
                engine.abort(request_id)
            # a dead engine is a 503 for the caller, as for a request the failure aborted
            self._resolve(command.done, error=EngineFailure(str(error)) if isinstance(error, EngineDeadError)
                          else error)
            return
        now = time.perf_counter()
        for request_id, sink in zip(command.request_ids, command.sinks):
            self._streams[request_id] = _Stream(sink, command.arrival, now, command.echo_only)
        self._resolve(command.done, None)

    def _mark_started(self, step_start: float, outputs: list[RequestOutput]) -> None:
        """Note the step that first computed each request (its queue time ends where that step began): those the
        engine says have started, and those with an output from this step (one that finished in its first step
        is no longer known to the engine, so `has_started` says False)."""
        has_started = getattr(self._engine, "has_started", None)
        with_output = {output.request_id for output in outputs}
        for request_id, stream in self._streams.items():
            if stream.started is None and (request_id in with_output
                                           or (has_started is not None and has_started(request_id))):
                stream.started = step_start

    def _dispatch(self, outputs: list[RequestOutput], progress: list[RequestProgress]) -> None:
        """Count a step's tokens (`outputs`, and the `progress` of requests that are not streamed) and hand each
        output to its request's handler, all in one call into the event loop (each call wakes the loop, which then
        takes the GIL from this thread: one a step, not one a request). The generation counters take the step's
        tokens in one increment, and the ITL histograms one weighted observation per distinct gap (one for every
        completion the step before also gave a token)."""
        now = time.perf_counter()
        generated = self._generated
        for step in progress:
            stream = self._streams.get(step.request_id)
            if stream is not None:
                self._count_step(stream, zip(step.num_output_tokens, step.finished), step.num_prompt_tokens,
                                 step.num_cached_tokens, now)
        sent: list[tuple[asyncio.Queue, RequestOutput]] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            self._count_step(stream, self._received(stream, output), len(output.prompt_token_ids),
                             output.num_cached_tokens, now)
            if output.finished:
                del self._streams[output.request_id]
                self._record_finish(stream, output)
            sent.append((stream.sink, output))
        if self._metrics is not None and self._generated > generated:
            self._metrics.generation_tokens.inc(self._generated - generated)
        if self._gaps:  # every completion the step before also gave a token has the same gap: one observe for all
            for last, count in self._gaps.items():
                self._metrics.itl.observe(now - last, count)
            self._gaps.clear()
        if sent:
            self._call_soon(_put_each, sent)

    @staticmethod
    def _received(stream: _Stream, output: RequestOutput) -> list[tuple[int, bool]]:
        """Each completion's (output tokens the request's outputs have held, whether it has ended), `output` counted
        in (a DELTA output holds the new tokens, a FINAL_ONLY one all of them)."""
        counts = []
        for c in output.outputs:
            stream.completions.extend(_Completion() for _ in range(c.index + 1 - len(stream.completions)))
            completion = stream.completions[c.index]
            completion.received += len(c.token_ids)
            counts.append((completion.received, c.finish_reason is not None))
        return counts

    def _count_step(self, stream: _Stream, completions: Iterable[tuple[int, bool]], num_prompt_tokens: int,
                    num_cached_tokens: int, now: float) -> None:
        """A request's tokens after a step: each completion's (output tokens so far, whether it has ended), and
        its prompt's and cached tokens (counted once every completion has its first token)."""
        for i, (num_tokens, ended) in enumerate(completions):
            if i == len(stream.completions):
                stream.completions.append(_Completion())
            completion = stream.completions[i]
            self._count_tokens(stream, completion, num_tokens, now)
            if ended and completion.finish_time is None:
                completion.finish_time = now
        if not stream.prompt_counted and all(c.num_tokens for c in stream.completions):
            self._count_prompt(stream, num_prompt_tokens, num_cached_tokens)

    def _count_tokens(self, stream: _Stream, completion: _Completion, num_tokens: int, now: float) -> None:
        """A completion's tokens after a step: its first token (TTFT from the request's arrival) or the time since
        its previous token step (ITL: counted in `_gaps`), and the new tokens in `_generated` (none for echo-only;
        `_dispatch` adds the step's to the generation counters and observes its gaps)."""
        num_new = num_tokens - completion.num_tokens
        if num_new <= 0:
            return
        if self._metrics is not None:
            if completion.last_token_time is None:
                self._metrics.ttft.observe(now - stream.arrival)
            else:
                self._gaps[completion.last_token_time] += 1  # observed by `_dispatch`, one call a distinct gap
        if not stream.echo_only:
            self._generated += num_new
        completion.num_tokens = num_tokens
        completion.last_token_time = now
        if completion.first_token_time is None:
            completion.first_token_time = now

    def _count_prompt(self, stream: _Stream, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count the request's prompt and cached tokens (as `usage` reports them) in the metrics, as vLLM does at
        its first token: here once every completion has its first token (each of `n` was admitted, so the cached
        tokens, the least of theirs, are final), or at the end of a request that ended before. (The stats line's
        hit rate still counts requests that ended.)"""
        stream.prompt_counted = True
        if self._metrics is not None:
            self._metrics.prompt_computed(num_prompt_tokens, num_cached_tokens)

    def _abort(self, request_id: str) -> tuple[_Stream | None, RequestOutput | None]:
        """Abort one request in the engine, forget its stream and count its end; its stream and the engine's
        final output (None for an unknown or finished request)."""
        stream = self._streams.pop(request_id, None)
        computed = stream is not None and self._computed(request_id, stream)
        output = self._engine.abort(request_id)
        if stream is not None and output is not None:
            self._received(stream, output)
            self._record_finish(stream, output, computed=computed)
        return stream, output

    def _expire(self) -> None:
        """Abort the requests still running `request_timeout_s` after their arrival (`add_many`); each handler gets
        a RequestTimeout."""
        if self._timeout_s is None:
            return
        due = time.perf_counter() - self._timeout_s
        expired = [self._abort(r)[0] for r in [r for r, stream in self._streams.items() if stream.arrival < due]]
        if expired:
            self._publish_state()  # (before the handlers hear of it, as after a step)
        for stream in expired:
            self._send(stream, RequestTimeout("the request did not finish within the server's request timeout "
                                              "(--request-timeout); it was aborted"))

    def _abort_all(self, error: BaseException | None) -> None:
        """Abort every request (engine failure, or shutdown when `error` is None) and tell its handler."""
        for request_id, stream in list(self._streams.items()):
            computed = self._computed(request_id, stream)
            try:
                output = self._engine.abort(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", request_id)
                output = None
            if output is not None:
                self._received(stream, output)
                self._record_finish(stream, output, reason_override="error" if error is not None else None,
                                    computed=computed)
            if error is not None:
                self._send(stream, EngineFailure(f"the engine failed while running this request: {error}"))
            elif output is not None:
                self._send(stream, output)
        self._streams.clear()
        if error is not None:
            self.last_error = f"{type(error).__name__}: {error}"
            try:
                self._engine.check_integrity()
            except EngineDeadError:  # (the failure killed it: already said, no second traceback)
                self.healthy = False
            except Exception:  # noqa: BLE001
                logger.exception("the engine is inconsistent after a failure; reporting unhealthy")
                self.healthy = False

    def _computed(self, request_id: str, stream: _Stream) -> bool:
        """Whether the engine began computing the request (asked before an abort releases it): one that never
        left the queue queried nothing of the cache."""
        if stream.started is not None or stream.num_tokens:
            return True
        has_started = getattr(self._engine, "has_started", None)
        return has_started is None or has_started(request_id)

    def _record_finish(self, stream: _Stream, output: RequestOutput, reason_override: str | None = None,
                       computed: bool = True) -> None:
        """Count an ended request (its last `output`, `_received` already): its prompt and cached tokens (as
        `usage` reports them), its choices' finish reasons and tokens; `computed` False (aborted before its prompt
        was computed): only the choices, as aborted."""
        if not computed:  # it queried nothing
            if self._metrics is not None:
                self._metrics.completions_ended([reason_override or "abort"] * len(output.outputs))
            return
        self._queried += len(output.prompt_token_ids)
        self._hit += output.num_cached_tokens
        if not stream.prompt_counted:  # it ended before its first token
            self._count_prompt(stream, len(output.prompt_token_ids), output.num_cached_tokens)
        if self._metrics is None:
            return
        now = time.perf_counter()
        reasons = [reason_override or c.finish_reason or "abort" for c in output.outputs]
        completions = [stream.completions[i] if i < len(stream.completions) else _Completion()
                       for i in range(len(output.outputs))]
        self._metrics.request_finished(len(output.prompt_token_ids), reasons,
                                       [(c.finish_time or now) - stream.arrival for c in completions],
                                       [(c.num_draft_tokens, c.num_accepted_tokens) for c in output.outputs],
                                       [_phases(stream, c) for c in completions],
                                       [0 if stream.echo_only else c.received for c in completions])

    def _publish_state(self) -> None:
        # The blocks running sequences hold (vllm:kv_cache_usage_perc) are recounted at most every
        # RUNNING_BLOCKS_INTERVAL_S while sequences run (a walk over every running sequence's blocks), and at once
        # when none ran at the last count (so an idle server reports 0, and a busy one at once more).
        now = time.monotonic()
        reuse = None
        if (self._engine.has_unfinished_requests() and self.state.num_running > 0
                and now - self._running_blocks_at < RUNNING_BLOCKS_INTERVAL_S):
            reuse = self.state.num_blocks_running
        else:
            self._running_blocks_at = now
        try:
            self.state = read_engine_state(self._engine, reuse)
        except Exception:  # noqa: BLE001 - metrics must not end the loop
            logger.exception("reading the engine state failed")

    def _stats_counters(self) -> StatsCounters:
        return StatsCounters(self.state.num_prefill_tokens, self._generated, self._queried, self._hit)

    def _stats_due_in(self) -> float | None:
        """How long an idle engine thread may block on its queue (None: until a command comes)."""
        return None if self._stats is None else self._stats.due_in(time.monotonic(), self._stats_counters())

    def _log_stats(self) -> None:
        if self._stats is not None:
            line = self._stats.line(time.monotonic(), self._stats_counters(), self.state)
            if line is not None:
                logger.info(line)

    def _send(self, stream: _Stream, item: RequestOutput | Exception) -> None:
        self._call_soon(_put_latest, stream.sink, item)

    def _call_soon(self, callback: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self._loop.call_soon_threadsafe(callback, *args)

    def _resolve(self, future: asyncio.Future, value: Any = None, *, error: Exception | None = None) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

        self._call_soon(settle)


def _put_latest(sink: asyncio.Queue, item: RequestOutput | Exception) -> None:
    """Put `item` on a request's queue, added to the output its handler has not taken yet (`add_delta`: DELTA
    outputs add up); an exception is the last item and is kept (an output still queued then goes unread)."""
    while not sink.empty():
        held = sink.get_nowait()
        if isinstance(held, Exception):
            item = held
        elif isinstance(item, RequestOutput):
            item = add_delta(held, item)
    sink.put_nowait(item)


def _put_each(sent: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """`_put_latest` of each (queue, output) in order."""
    for sink, item in sent:
        _put_latest(sink, item)


def _phases(stream: _Stream, completion: _Completion) -> RequestPhases:
    """A finished completion's queue, prefill and decode times (None for a phase it did not reach)."""
    first, last, started = completion.first_token_time, completion.last_token_time, stream.started
    return RequestPhases(
        queue_s=None if started is None else max(started - stream.queued, 0.0),
        prefill_s=None if started is None or first is None else max(first - started, 0.0),
        decode_s=None if first is None or last is None else last - first,
    )
