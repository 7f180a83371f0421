"""`AsyncLLM`: requests as async generators, in the shape of vLLM's `AsyncLLM.generate`, for asyncio programs.

    llm = AsyncLLM()                                   # LLM's arguments: a model, engine options
    async for output in llm.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(output.outputs[0].text)                  # everything so far (CUMULATIVE, the default)
    llm.shutdown()

The engine runs on a thread of its own, the server's (`server/engine_loop.EngineLoop`, started on the first
`generate` in the running event loop), so requests from many tasks join the same steps. What each yielded output
holds follows `sampling_params.output_kind` (`RequestOutputKind`): CUMULATIVE everything so far (a copy: earlier
outputs stay as they were), DELTA what is new since the output before (the steps a slow consumer missed added up
into one), FINAL_ONLY one output, when the request ends. A consumer that stops iterating (a `break`, a cancelled
task) aborts its request. Needs the `serve` extra (prometheus-client, which the engine thread imports).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import replace

from hybridcache.llm import LLM, Prompt, _cache_salt
from hybridcache.outputs import RequestOutput, add_delta
from hybridcache.sampling import RequestOutputKind, SamplingParams
from hybridcache.server.engine_loop import EngineLoop


class AsyncLLM:
    """See the module docstring. `model` and `options`: `LLM`'s (a model folder, hub id or None for the built-in
    model; engine options). One event loop drives it: the loop of its first `generate`."""

    def __init__(self, model: str | None = None, **options) -> None:
        self._llm = LLM(model, **options)
        self.tokenizer = self._llm.tokenizer
        self._engine_loop = EngineLoop(self._llm.engine)
        self._started_in: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling params (`LLM.get_default_sampling_params`)."""
        return self._llm.get_default_sampling_params()

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Run one request: a prompt as `LLM.generate` takes one (text, token ids, or vLLM's dict with "prompt" or
        "prompt_token_ids", "multi_modal_data" and "cache_salt"); yields its outputs as
        `sampling_params.output_kind` says (module docstring), the last with `finished` set. A bad prompt or
        parameters raise ValueError or TypeError before anything is queued; an engine failure while it runs raises
        `EngineFailure`."""
        engine_loop = self._running()
        params = sampling_params or self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        valid, mm_inputs = self._llm._validate(prompt)  # (tokenized here, as LLM.generate does)
        kind = params.output_kind
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        sink = await engine_loop.add(request_id, valid, params, mm_inputs, cache_salt=_cache_salt(prompt),
                                     final_only=kind is RequestOutputKind.FINAL_ONLY)
        total: RequestOutput | None = None
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                if kind is RequestOutputKind.CUMULATIVE:
                    total = item if total is None else add_delta(total, item)
                    yield _snapshot(total)
                else:
                    yield item
        finally:
            if not finished:
                engine_loop.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds (a no-op for an unknown or finished one)."""
        self._running().abort(request_id)

    def shutdown(self) -> None:
        """Abort what runs, end the engine thread and free the engine (`LLM.close`); idempotent."""
        self._engine_loop.stop()
        self._llm.close()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _running(self) -> EngineLoop:
        """The engine loop, started on the running event loop at the first call (a call from another loop is a
        RuntimeError: the engine thread hands its outputs to one loop)."""
        loop = asyncio.get_running_loop()
        if self._started_in is None:
            self._engine_loop.start()
            self._started_in = loop
        elif self._started_in is not loop:
            raise RuntimeError("an AsyncLLM serves the event loop of its first generate; this is another one")
        return self._engine_loop


def _snapshot(output: RequestOutput) -> RequestOutput:
    """A copy of `output` that later additions do not change (its completions' lists copied)."""
    return replace(output, outputs=[replace(c, token_ids=list(c.token_ids),
                                            logprobs=None if c.logprobs is None else list(c.logprobs))
                                    for c in output.outputs])
