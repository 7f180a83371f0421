"""`AsyncLLM` (vLLM's `AsyncLLM.generate` shape): each output kind, concurrent requests, aborts, bad input."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

pytest.importorskip("prometheus_client")  # the `serve` extra: the engine thread's module imports it

from hybridcache import LLM, AsyncLLM, RequestOutputKind, SamplingParams  # noqa: E402

PARAMS = SamplingParams(temperature=0.8, seed=5, max_tokens=40, n=2, logprobs=1, ignore_eos=True)
PROMPT = "An async request, streamed three ways"


@pytest.fixture(scope="module")
def expected():
    """The request's final output from `LLM.generate` (FINAL_ONLY), on a fresh engine."""
    with LLM() as llm:
        return llm.generate(PROMPT, PARAMS, use_tqdm=False)[0]


def _same(got, want) -> None:
    for a, b in zip(got.outputs, want.outputs, strict=True):
        assert (a.text, a.token_ids, a.logprobs, a.finish_reason) == (b.text, b.token_ids, b.logprobs, b.finish_reason)


def test_each_output_kind_ends_with_what_generate_returns(expected):
    """CUMULATIVE: snapshots that only grow (an earlier one is not changed by later steps); DELTA: pieces that add
    up to the whole; FINAL_ONLY: one output. All three end with `LLM.generate`'s output (each run on an empty
    cache, so the logprobs are equal to the bit)."""
    async def run(llm: AsyncLLM, kind: RequestOutputKind) -> list:
        llm._llm.engine.clear_cache()  # (idle between requests: nothing runs)
        return [out async for out in llm.generate(PROMPT, replace(PARAMS, output_kind=kind))]

    async def main() -> dict:
        with AsyncLLM() as llm:
            return {kind: await run(llm, kind) for kind in RequestOutputKind}

    runs = asyncio.run(main())
    cumulative, deltas, final = (runs[k] for k in RequestOutputKind)
    assert len(final) == 1 and final[0].finished
    _same(final[0], expected)
    assert len(cumulative) >= 20 and cumulative[-1].finished and not any(o.finished for o in cumulative[:-1])
    _same(cumulative[-1], expected)
    lengths = [[len(c.token_ids) for c in o.outputs] for o in cumulative]
    assert lengths == sorted(lengths) and lengths[0] != lengths[-1]  # snapshots: each kept its own length
    assert [c.text for c in deltas[-1].outputs] != [c.text for c in expected.outputs]  # pieces, not the whole
    for i in range(2):
        pieces = [o.outputs[i] for o in deltas]
        assert "".join(p.text for p in pieces) == expected.outputs[i].text
        assert [t for p in pieces for t in p.token_ids] == expected.outputs[i].token_ids


def test_concurrent_requests_share_steps_and_a_consumer_that_stops_aborts_its_request():
    async def main() -> tuple:
        with AsyncLLM() as llm:
            params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

            async def whole(prompt: str):
                return [out async for out in llm.generate(prompt, params)][-1]

            outs = await asyncio.gather(*(whole(f"prompt number {i}") for i in range(4)))
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            async for out in llm.generate("stopped early", long, request_id="early"):
                if len(out.outputs[0].token_ids) >= 3:
                    break
            for _ in range(200):  # the generator's close (its finalizer) aborts the request
                await asyncio.sleep(0.01)
                if not await llm._engine_loop.call(lambda engine: engine.has_unfinished_requests()):
                    break
            state = await llm._engine_loop.check()
            return outs, state

    outs, state = asyncio.run(main())
    assert all(o.finished and len(o.outputs[0].token_ids) == 30 for o in outs)
    with LLM() as llm:  # each equals its request run alone
        alone = llm.generate([f"prompt number {i}" for i in range(4)],
                             SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert state.num_running == 0


def test_bad_input_raises_and_leaves_the_engine_intact():
    async def main() -> None:
        with AsyncLLM() as llm:
            with pytest.raises(ValueError, match="prompt token 1"):
                async for _ in llm.generate([5, 10**7], SamplingParams(max_tokens=2)):
                    pass
            with pytest.raises(ValueError, match="empty"):
                async for _ in llm.generate("", SamplingParams(max_tokens=2)):
                    pass
            with pytest.raises(TypeError, match="SamplingParams"):
                async for _ in llm.generate("hi", {"max_tokens": 2}):
                    pass
            with pytest.raises(ValueError, match="prompt_token_ids"):
                async for _ in llm.generate({"prompt_ids": [5, 6]}, SamplingParams(max_tokens=2)):
                    pass
            ids = [o async for o in llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))]
            assert ids[-1].prompt_token_ids == [5, 6, 7] and ids[-1].finished
            outs = [o async for o in llm.generate("still fine", SamplingParams(temperature=0, max_tokens=3))]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
            await llm._engine_loop.check()  # check_integrity on the idle engine

    asyncio.run(main())
