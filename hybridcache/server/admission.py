"""What a generation route does around the engine, the same for every API (completions and chat in app.py, the
Responses API, Anthropic's Messages API): the errors of queueing a request, and the wait for its final output.

    with admission_errors(abort, param):        # ValueError / TypeError / OverflowError -> 400 (abort, `param`)
        sink = await loop.add(...)              # QueueFull -> 503 + Retry-After; EngineFailure -> 503;
                                                # cancelled -> abort, re-raised
    final = await until_final(request, work, abort)   # None: the client went (answer 499); a timeout -> 503 that
                                                      # clients must not retry; EngineFailure -> 500; abort always
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from starlette.requests import Request

from hybridcache.server.engine_loop import EngineFailure
from hybridcache.server.errors import NO_RETRY, APIError
from hybridcache.server.limits import QueueFull, RequestTimeout, queue_full_error
from hybridcache.server.streaming import ClientGone, run_until_disconnect

T = TypeVar("T")


@contextlib.contextmanager
def admission_errors(abort: Callable[[], None], param: Callable[[str], str | None]) -> Iterator[None]:
    """Errors of queueing a request (`EngineLoop.add` / `add_many`) as the API's: an input the engine refuses is a
    400 naming `param(message)`, a full queue a 503 with Retry-After, a stopped engine a 503; `abort` (a no-op for
    what was never queued) runs when the input is refused or the handler is cancelled."""
    try:
        yield
    except (ValueError, TypeError, OverflowError) as error:
        abort()
        raise APIError(400, str(error), param=param(str(error))) from None
    except QueueFull as error:
        raise queue_full_error(str(error)) from None
    except EngineFailure as error:
        raise APIError(503, str(error)) from None
    except asyncio.CancelledError:
        abort()
        raise


async def until_final(request: Request, work: Awaitable[T], abort: Callable[[], None]) -> T | None:
    """`work` (the final output of a request that is not streamed) awaited while the client stays; None when it
    goes first (the route answers 499). A request timeout is a 503 marked not to be retried, an engine failure a
    500. `abort` runs in every case (also when cancelled at the end of the shutdown grace period: a 503 from
    `ShutdownGuard`)."""
    try:
        return await run_until_disconnect(request.receive, work)
    except ClientGone:
        return None
    except RequestTimeout as error:
        raise APIError(503, str(error), code="request_timeout", headers=NO_RETRY) from None
    except EngineFailure as error:
        raise APIError(500, str(error)) from None
    finally:
        abort()
