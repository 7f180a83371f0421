"""The server-sent events of one streaming completions or chat response (app.py runs the requests): a chunk per
choice as its text grows (for chat: the role first, then vLLM's `echo` text, then the message's deltas), the finish
reason and vLLM's `stop_reason` on its last chunk, usage as the client asked (`UsageMode`), and `data: [DONE]`; an
engine failure or timeout mid-stream is a final error event, and so is any other error raised while the stream runs
(logged; a 500 event, as the non-streamed answer would be), so the client never sees a connection cut without
`[DONE]`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

from hybridcache.outputs import RequestOutput
from hybridcache.sampling import SamplingParams
from hybridcache.server.chat_output import ChoiceStream, finish_reason
from hybridcache.server.engine_loop import EngineFailure
from hybridcache.server.errors import error_body
from hybridcache.server.limits import RequestTimeout
from hybridcache.server.responses import Rendering, ResponseMeta, chunk, logprobs_of, sse, usage_chunk
from hybridcache.server.text_stream import TextStream

logger = logging.getLogger("hybridcache.server")


class UsageMode(NamedTuple):
    """A stream's usage reporting: `final`: a last chunk with the response's usage (every chunk then carries
    `usage`, null but for it); `continuous`: every chunk carries its choice's running usage (vLLM's
    `continuous_usage_stats`), counted from `prompt_lens[prompt_index]`."""

    final: bool
    continuous: bool = False
    prompt_lens: Sequence[int] = ()

    def running(self, prompt_index: int, num_generated: int) -> dict[str, int] | None:
        """The running usage of a choice of prompt `prompt_index` that generated `num_generated` tokens so far
        (None: not reported)."""
        if not self.continuous:
            return None
        prompt_len = self.prompt_lens[prompt_index]
        return {"prompt_tokens": prompt_len, "completion_tokens": num_generated,
                "total_tokens": prompt_len + num_generated}


async def stream_events(meta: ResponseMeta, outputs: AsyncIterator[tuple[int, RequestOutput]],
                        params: SamplingParams, prompts: Sequence[Sequence[int]], usage_mode: UsageMode,
                        rendering: Rendering) -> AsyncIterator[bytes]:
    """The server-sent events of one streaming response, ending with `data: [DONE]`. Choice
    `prompt_index * n + i` is completion i of prompt `prompt_index` (whose ids are `prompts[prompt_index]`: a
    choice's first chunk carries them with `return_token_ids`, as vLLM's)."""
    n = params.n
    num_prompts = len(prompts)
    include_usage = usage_mode.final
    count = n * num_prompts
    chats = [ChoiceStream(rendering.chat, params.stop) for _ in range(count)]
    texts = [TextStream(params.stop) for _ in range(count)]
    done = [False] * count
    sent = [0] * count  # the tokens of each choice whose logprobs and ids a chunk carried
    echo_pending = [bool(rendering.echo_texts)] * count
    prompt_ids_pending = [rendering.return_token_ids] * count
    echo_logprobs_pending = [rendering.echoes_logprobs] * count
    # completions: where the next token's text starts in the choice's text (after an echoed prompt)
    next_offset = [len(rendering.echo_texts[i // n]) if rendering.echo_texts else 0 for i in range(count)]
    if meta.chat:
        for index in range(count):
            prompt_ids = list(prompts[index // n]) if prompt_ids_pending[index] else None
            prompt_ids_pending[index] = False
            yield sse(chunk(meta, index, role=True, with_usage_field=include_usage,
                            usage=usage_mode.running(index // n, 0), prompt_token_ids=prompt_ids))
        if rendering.chat.echo:  # vLLM's chat echo: a chunk of the echoed text per choice, after the role chunks
            for index in range(count):
                yield sse(chunk(meta, index, text=rendering.chat.echo, with_usage_field=include_usage,
                                usage=usage_mode.running(index // n, 0)))
    finals: list[RequestOutput | None] = [None] * num_prompts
    try:
        async for prompt_index, output in outputs:
            finals[prompt_index] = output
            for c in output.outputs:
                index = prompt_index * n + c.index
                if done[index]:
                    continue
                finished = c.finish_reason is not None
                if meta.chat:
                    delta = chats[index].update(c.text, finished)
                    text = None
                    has_news = bool(delta)
                else:
                    delta = None
                    text = texts[index].update(c.text, finished)
                    if echo_pending[index]:
                        text = rendering.echo_texts[prompt_index] + text
                        echo_pending[index] = False
                    has_news = bool(text)
                if not (has_news or finished):
                    continue
                done[index] = finished
                echoed = output if echo_logprobs_pending[index] else None
                echo_logprobs_pending[index] = False
                logprobs = logprobs_of(rendering, meta.chat, c, sent[index], echoed=echoed,
                                       text_offset=next_offset[index])
                new_ids, sent[index] = c.token_ids[sent[index]:], len(c.token_ids)
                if logprobs is not None and not meta.chat and logprobs["tokens"]:
                    next_offset[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                reason = (finish_reason(c.finish_reason, chats[index].has_tool_calls, rendering.chat) if meta.chat
                          else c.finish_reason)
                shows_ids = rendering.return_token_ids and not rendering.chat.hides_reasoning
                token_ids = list(new_ids) if shows_ids else None  # as vLLM's: each chunk's new ids
                prompt_ids = list(prompts[prompt_index]) if prompt_ids_pending[index] else None
                prompt_ids_pending[index] = False
                yield sse(chunk(meta, index, text=text, delta=delta, finish_reason=reason, logprobs=logprobs,
                                with_usage_field=include_usage, token_ids=token_ids,
                                usage=usage_mode.running(prompt_index, len(c.token_ids)),
                                stop_reason=c.stop_reason if finished else None,
                                prompt_token_ids=prompt_ids))
    except RequestTimeout as error:
        yield sse(error_body(503, str(error), code="request_timeout"))
        yield sse("[DONE]")
        return
    except EngineFailure as error:
        yield sse(error_body(500, str(error)))
        yield sse("[DONE]")
        return
    except Exception as error:  # a bug while rendering a chunk: the client still gets a complete stream
        logger.exception("streaming %s failed", meta.response_id)
        yield sse(error_body(500, f"internal error: {type(error).__name__}: {error}"))
        yield sse("[DONE]")
        return
    if include_usage and all(f is not None for f in finals):
        yield sse(usage_chunk(meta, finals, rendering))
    yield sse("[DONE]")
