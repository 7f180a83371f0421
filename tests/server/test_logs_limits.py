"""The server's logging (hunt 195): fetched image URLs are not logged by httpx, a data-parallel replica's lines
name it, a rate-limited warning's drop count is reported once its window ends (even with no later warning of
the kind), an unexpected 500 is one record, and vLLM's request-logging flags are accepted as no-ops."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from hybridcache.server import log_limits
from hybridcache.server.log_limits import REPLICA_INDEX_ENV, RateLimitFilter, configure_logging, log_format
from hybridcache.server.stats_log import StatsCounters, StatsLogger
from hybridcache.server.vllm_flags import check_vllm_args
from tests.server.test_app_query_and_cors import client
from tests.server.test_stats_and_metrics import STATE, _run_on_engine_loop, _until_finished
from tests.server.test_vllm_command_lines import serve


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def quiet_http_loggers():
    """Restores httpx's and httpcore's levels (configure_logging sets them process-wide)."""
    saved = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


# ---- 1. image URLs (credentials, signed queries) are not logged through httpx ---------------------------------------


@pytest.mark.parametrize("level, expected", [("info", logging.WARNING), ("warning", logging.WARNING),
                                             ("debug", logging.DEBUG)])
def test_configure_logging_keeps_httpx_quiet_but_at_debug(quiet_http_loggers, level, expected):
    configure_logging(level)
    for name in ("httpx", "httpcore"):
        assert logging.getLogger(name).level == expected, name


def test_serve_sets_up_logging_with_httpx_muted(quiet_http_loggers, monkeypatch):
    """`serve` logged every image URL it fetched at INFO (`HTTP Request: GET http://alice:hunter2@host/...`), even
    with --disable-log-requests: its basicConfig left httpx at the root's INFO."""
    from hybridcache.server import cli

    class Stop(Exception):
        pass

    def stop(args):
        raise Stop

    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.NOTSET)
    root = logging.getLogger()
    saved = root.level
    root.setLevel(logging.INFO)  # --log-level info (basicConfig is a no-op under pytest: the root has handlers)
    monkeypatch.setattr(cli, "api_keys", stop)  # the first step after the logging set-up
    try:
        with pytest.raises(Stop):
            cli.cmd_serve(serve("--disable-log-requests"))
        assert root.isEnabledFor(logging.INFO)
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert not logging.getLogger("httpcore").isEnabledFor(logging.INFO)
    finally:
        root.setLevel(saved)


# ---- 2. a data-parallel replica's lines name it ---------------------------------------------------------------------


def test_a_replicas_log_format_and_index():
    assert log_limits.replica_index({REPLICA_INDEX_ENV: "2"}) == 2
    assert log_limits.replica_index({}) is None
    assert log_limits.replica_index({REPLICA_INDEX_ENV: ""}) is None
    record = logging.LogRecord("hybridcache.server", logging.INFO, __file__, 1, "listening", (), None)
    assert "INFO [replica 2] hybridcache.server: listening" in logging.Formatter(log_format(2)).format(record)
    assert "INFO hybridcache.server: listening" in logging.Formatter(log_format(None)).format(record)


def test_a_replicas_uvicorn_lines_are_tagged_too():
    logger = logging.getLogger("logs_test.uvicorn")
    handler = Collect()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))  # uvicorn's default, in short
    logger.addHandler(handler)
    record = logging.LogRecord(logger.name, logging.INFO, __file__, 1, "Uvicorn running", (), None)
    try:
        log_limits.tag_replica_lines((logger.name,), environ={})
        assert handler.format(record) == "INFO:     Uvicorn running"
        for _ in range(2):  # once
            log_limits.tag_replica_lines((logger.name,), environ={REPLICA_INDEX_ENV: "1"})
        assert handler.format(record) == "[replica 1] INFO:     Uvicorn running"
    finally:
        logger.removeHandler(handler)


def test_a_replicas_stats_line_starts_with_its_engine_index():
    busy = StatsCounters(prompt_tokens=10, generation_tokens=2, query_tokens=10, hit_tokens=0)
    assert StatsLogger(1.0, 0.0, engine_index=1).line(5.0, busy, STATE).startswith(
        "Engine 001: Avg prompt throughput: 2.0 tokens/s")
    assert StatsLogger(1.0, 0.0).line(5.0, busy, STATE).startswith("Avg prompt throughput")


def test_the_engine_loop_reads_the_replica_index(monkeypatch, caplog):
    """The replicas' stats lines were indistinguishable in `serve --data-parallel-size 2`'s one stream."""
    from hybridcache.sampling import SamplingParams

    monkeypatch.setenv(REPLICA_INDEX_ENV, "3")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def scenario(loop) -> None:
        await _until_finished(await loop.add("r", list(range(3, 40)), params))
        await asyncio.sleep(0.3)

    with caplog.at_level(logging.INFO, logger="hybridcache.server"):
        _run_on_engine_loop(2, scenario, stats_interval_s=0.1)
    lines = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    assert lines and all(line.startswith("Engine 003: Avg prompt throughput") for line in lines), lines


# ---- 3. a window's drop count is reported when it ends ---------------------------------------------------------------


def _warning(name: str, msg: str, *args: object, created: float | None = None) -> logging.LogRecord:
    record = logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)
    if created is not None:
        record.created = created
    return record


@pytest.fixture
def collected():
    """A handler on the logger "logs_test" (not propagating) that collects what it is given."""
    logger = logging.getLogger("logs_test")
    handler, propagate = Collect(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    yield handler
    logger.removeHandler(handler)
    logger.propagate = propagate


def test_the_dropped_count_is_reported_when_the_window_ends_without_a_later_warning(collected):
    """It was added to the next warning of the kind only: with none, the count was never logged."""
    now, timers = [0.0], []
    limiter = RateLimitFilter(interval_s=10, burst=3, clock=lambda: now[0],
                              schedule=lambda delay, callback: timers.append((delay, callback)))
    start = time.mktime((2026, 12, 5, 9, 53, 10, 0, 0, -1))
    for i in range(50):
        now[0] = i * 0.1
        limiter.filter(_warning("logs_test", "closed connection %d", i, created=start + now[0]))
    assert len(timers) == 1 and timers[0][0] == pytest.approx(10 - 0.3)  # one timer, at the window's end
    assert collected.records == []
    timers[0][1]()
    (report,) = collected.records
    assert report.levelno == logging.WARNING
    assert report.getMessage() == "47 more warnings like 'closed connection %d' not logged since 09:53:10"
    timers[0][1]()  # reported once
    assert len(collected.records) == 1


def test_a_warning_after_the_window_reports_the_count_before_it_once(collected):
    """It said "in the last 10 s" when the next warning came 30 s later; now the report names the window's start,
    and comes before the warning, which is logged as it is."""
    now, timers = [0.0], []
    limiter = RateLimitFilter(interval_s=10, burst=1, clock=lambda: now[0],
                              schedule=lambda delay, callback: timers.append(callback))
    start = time.mktime((2026, 12, 5, 9, 0, 0, 0, 0, -1))
    assert limiter.filter(_warning("logs_test", "refused %s", "a", created=start))
    assert not limiter.filter(_warning("logs_test", "refused %s", "b", created=start + 1))
    now[0] = 30.0
    late = _warning("logs_test", "refused %s", "c", created=start + 30)
    assert limiter.filter(late)
    assert late.getMessage() == "refused c"
    reports = [r.getMessage() for r in collected.records]
    assert reports == ["1 more warnings like 'refused %s' not logged since 09:00:00"]
    timers[0]()  # the timer, late: nothing more
    assert len(collected.records) == 1


def test_the_default_timer_reports_on_its_own(collected):
    limiter = RateLimitFilter(interval_s=0.2, burst=1)
    for i in range(3):
        limiter.filter(_warning("logs_test", "flood %d", i))
    deadline = time.monotonic() + 5
    while not collected.records and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [r.getMessage().split(" since ")[0] for r in collected.records] == [
        "2 more warnings like 'flood %d' not logged"]


# ---- 4. an unexpected 500 is one record ------------------------------------------------------------------------------


def test_an_unexpected_error_is_logged_once():
    """The app's handler logged it (with the request), and uvicorn again ("Exception in ASGI application"), since
    Starlette re-raises after the handler: two tracebacks per failure."""
    test_client = client()

    async def boom() -> None:
        raise RuntimeError("boom")

    test_client.app.add_api_route("/boom", boom, methods=["GET"])
    handler = Collect()
    names = ("hybridcache.server", "uvicorn.error")
    for name in names:
        logging.getLogger(name).addHandler(handler)
    try:
        log_limits.install(logger_names=names)  # what serve installs on the root's and uvicorn's handlers
        with pytest.raises(RuntimeError) as raised:
            test_client.get("/boom")
        # what uvicorn's protocol does with the error the app re-raises (uvicorn/protocols/http/*_impl.py)
        logging.getLogger("uvicorn.error").error("Exception in ASGI application\n", exc_info=raised.value)
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(handler)
    logged = [r for r in handler.records if r.exc_info]
    assert [r.getMessage() for r in logged] == ["unhandled error in GET /boom"]


# ---- 5. vLLM's request-logging flags ---------------------------------------------------------------------------------


def test_vllms_request_logging_flags_are_logged_no_ops(caplog):
    """--max-log-len N and --enable-log-outputs stopped serve from starting (unrecognized arguments)."""
    args = serve("--disable-log-requests", "--max-log-len", "100", "--enable-log-outputs", "--enable-log-requests")
    with caplog.at_level(logging.INFO, logger="hybridcache.server"):
        check_vllm_args(args)
    logged = " ".join(r.getMessage() for r in caplog.records)
    for flag in ("--max-log-len", "--enable-log-outputs", "--enable-log-requests"):
        assert f"{flag} has no effect" in logged, flag
