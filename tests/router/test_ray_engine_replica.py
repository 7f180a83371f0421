"""The Ray Serve engine replica (`HybridcacheEngine`) outside Ray: it serves the `serve` app in process (the
server's own responses, streamed), and pushes its cache events to the index after each completion, so the index
predicts the next request's hit exactly as the engine then reports it; an index that lost its state gets a
snapshot within the same push. Skipped without the `ray` extra."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from hybridcache.models.builtin import ensure_builtin_model  # noqa: E402
from hybridcache.router import ray_serve  # noqa: E402
from hybridcache.router.fleet_index import FleetIndex  # noqa: E402
from hybridcache.router.ray_serve import EngineRequest, HybridcacheEngine  # noqa: E402

SERVE_ARGS = ["--block-size", "16", "--max-model-len", "512", "--num-blocks", "1024", "--disable-log-stats"]
FIRST = [(7 * i) % 250 for i in range(70)]
SECOND = FIRST + [(11 * i) % 250 for i in range(30)]


class _Index:
    """The CacheIndex handle, in process: `publish.remote(...)` is awaited as Ray's response would be."""

    def __init__(self) -> None:
        self.fleet = FleetIndex()
        self.publish = SimpleNamespace(remote=self._publish)

    async def _publish(self, replica_id: str, body: dict) -> int | None:
        return self.fleet.publish(replica_id, body)


async def _complete(engine: HybridcacheEngine, prompt: list[int], stream: bool = False) -> tuple[dict, bytes]:
    body = json.dumps({"prompt": prompt, "max_tokens": 2, "stream": stream,
                       "stream_options": {"include_usage": True} if stream else None}).encode()
    pieces = [p async for p in engine(EngineRequest("POST", "/v1/completions", body,
                                                    (("content-type", "application/json"),), (tuple(prompt),)))]
    return pieces[0], b"".join(pieces[1:])


def test_the_replica_serves_in_process_and_the_index_predicts_its_hits(monkeypatch):
    ensure_builtin_model()
    context = SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: "replica-1"))
    monkeypatch.setattr(ray_serve.serve, "get_replica_context", lambda: context)
    index = _Index()

    async def run() -> None:
        engine = HybridcacheEngine.__new__(HybridcacheEngine)  # Ray awaits the async __init__ itself
        await engine.__init__(SERVE_ARGS, index, poll_interval_s=30.0)
        try:
            assert index.fleet.stats()["replica-1"]["up"]  # the snapshot pushed at start
            head, body = await _complete(engine, FIRST)
            assert head["status"] == 200 and json.loads(body)["usage"]["prompt_tokens"] == len(FIRST)
            predicted = index.fleet.predict([SECOND], ["replica-1"])[0]
            assert predicted.cached_len >= len(FIRST) - 1  # pushed before the answer ended
            head, body = await _complete(engine, SECOND, stream=True)
            assert head["status"] == 200 and dict(head["headers"])["content-type"].startswith("text/event-stream")
            events = [json.loads(line[6:]) for line in body.decode().splitlines()
                      if line.startswith("data: {")]
            assert body.rstrip().endswith(b"data: [DONE]")
            assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted.cached_len
            bad_head, bad_body = await _complete(engine, [])
            assert bad_head["status"] == 400 and b"prompt" in bad_body  # the server's own error
            index.fleet = FleetIndex()  # the index restarted: the next push is refused, then a snapshot
            await engine.publish()
            assert index.fleet.predict([SECOND], ["replica-1"])[0].cached_len >= len(SECOND) - 1
            await engine.check_health()
        finally:
            engine.__del__()

    asyncio.run(run())
