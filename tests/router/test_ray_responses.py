"""`/v1/responses` through the Ray Serve ingress outside Ray: two real engine replicas in process behind a fake
handle that sends unpinned calls to each replica in turn (what a choice blind to stored responses may do) and
pinned ones as `CheckpointRequestRouter` does (to their replica while it runs, else to any). A turn with
`previous_response_id` goes to the replica that stored the response, streamed or not; an ingress that never saw
the id finds it by asking each replica; once that replica is gone, another answers 404. Skipped without the `ray`
extra."""

from __future__ import annotations

import asyncio
import functools
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from hybridcache.models.builtin import builtin_model_dir, ensure_builtin_model  # noqa: E402
from hybridcache.router import ray_serve  # noqa: E402
from hybridcache.router.ray_metrics import IngressCounters  # noqa: E402
from hybridcache.router.ray_serve import EngineRequest, HybridcacheEngine, OpenAIIngress  # noqa: E402
from hybridcache.router.responses import ResponseOwners  # noqa: E402
from hybridcache.tokenizer import Tokenizer  # noqa: E402
from tests.router.test_ray_engine_replica import SERVE_ARGS, _Index  # noqa: E402
from tests.server.conftest import MODEL  # noqa: E402

NAMES = ("replica-1", "replica-2")


class _Handle:
    """The engine deployment's handle: unpinned calls go to each running replica in turn; a pinned call to its
    replica while that one runs, else to the next running one."""

    def __init__(self, engines: dict[str, HybridcacheEngine]) -> None:
        self.engines, self.running, self.turn, self.calls = engines, list(engines), 0, []

    def options(self, stream: bool) -> _Handle:
        return self

    def remote(self, request: EngineRequest):
        name = request.replica_id if request.replica_id in self.running else None
        if name is None:
            name = self.running[self.turn % len(self.running)]
            self.turn += 1
        self.calls.append((request.method, request.path, request.replica_id, name))
        return self.engines[name](request)


class _Request:
    """What the ingress reads of a Starlette request."""

    def __init__(self, path: str, body: dict | None = None) -> None:
        self.url = SimpleNamespace(path=path)
        self.headers = {"content-type": "application/json"}
        self._body = json.dumps(body).encode() if body is not None else b""

    async def stream(self):
        yield self._body


def _ingress(handle: _Handle, index: _Index, tokenizer: Tokenizer) -> SimpleNamespace:
    ingress = SimpleNamespace(engine=handle, index=index, counters=IngressCounters(), max_request_bytes=1 << 20,
                              tokenizer=tokenizer, template_kwargs={}, owners=ResponseOwners())
    for name in ("_send", "_ended", "_forward", "_owner_of", "_pinned_get", "_reader"):
        setattr(ingress, name, functools.partial(getattr(OpenAIIngress, name), ingress))
    return ingress


async def _turn(ingress, text: str, previous: str | None = None, stream: bool = False) -> tuple[int, dict]:
    body = {"model": MODEL, "input": text, "instructions": "Answer in one short line. " * 4, "max_output_tokens": 3,
            "temperature": 0, "stream": stream}
    if previous is not None:
        body["previous_response_id"] = previous
    answer = await ingress._forward(_Request("/v1/responses", body))
    if not stream:
        return answer.status_code, json.loads(answer.body)
    events = b"".join([piece async for piece in answer.body_iterator]).decode()
    data = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
    return answer.status_code, next(e["response"] for e in data if e.get("type") == "response.completed")


def test_a_continued_response_goes_to_the_replica_that_stored_it(monkeypatch):
    ensure_builtin_model()
    tokenizer = Tokenizer(builtin_model_dir())
    index = _Index()
    index.stats = SimpleNamespace(remote=lambda: _async(index.fleet.stats()))

    async def run() -> None:
        engines = {}
        for name in NAMES:
            context = SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda name=name: name))
            monkeypatch.setattr(ray_serve.serve, "get_replica_context", lambda context=context: context)
            engine = HybridcacheEngine.__new__(HybridcacheEngine)
            await engine.__init__(SERVE_ARGS, index, poll_interval_s=30.0)
            engines[name] = engine
        try:
            handle = _Handle(engines)
            ingress = _ingress(handle, index, tokenizer)
            status, first = await _turn(ingress, "What is a recurrent state?")
            assert status == 200
            owner = handle.calls[-1][3]
            ids = [first["id"]]
            status, second = await _turn(ingress, "And a checkpoint of it?", ids[-1])
            assert status == 200 and second["usage"]["input_tokens_details"]["cached_tokens"] > 0
            ids.append(second["id"])
            status, third = await _turn(ingress, "Why exact?", ids[-1], stream=True)  # its id read from the stream
            assert status == 200
            ids.append(third["id"])
            assert [c[2:] for c in handle.calls] == [("", owner), (owner, owner), (owner, owner)]

            fresh = _ingress(handle, index, tokenizer)  # never saw the ids: asks the replicas, one at a time
            status, fourth = await _turn(fresh, "Thanks.", ids[-1])
            assert status == 200 and handle.calls[-1][2:] == (owner, owner)
            lookups = [c for c in handle.calls if c[0] == "GET"]
            assert lookups and all(c[1] == f"/v1/responses/{ids[-1]}" and c[2] == c[3] for c in lookups)
            got = await OpenAIIngress.stored_response(fresh, _Request(f"/v1/responses/{fourth['id']}"), fourth["id"])
            assert got.status_code == 200 and json.loads(got.body)["id"] == fourth["id"]

            handle.running.remove(owner)  # its replica is gone, and the conversation with it
            status, gone = await _turn(fresh, "Still there?", fourth["id"])
            assert status == 404 and fourth["id"] in gone["error"]["message"]
            assert handle.calls[-1][2:] == (owner, next(n for n in NAMES if n != owner))
        finally:
            for engine in engines.values():
                engine.__del__()

    asyncio.run(run())


async def _async(value):
    return value
