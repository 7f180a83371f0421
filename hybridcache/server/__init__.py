"""The OpenAI-compatible HTTP server: `hybridcache serve` (see docs/server.md).

    app.py           FastAPI routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    responses_api.py /v1/responses (OpenAI's Responses API over the chat pipeline)
    anthropic_api.py /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API over the chat pipeline);
                     anthropic_protocol.py: its request shapes and their translation to a chat request
    tokenize_api.py  vLLM's /tokenize, /detokenize and /version
    engine_loop.py   the one thread that owns the engine; handlers reach it only through its command queue
    admission.py     around the engine, for every generation route: queueing errors, the wait for the final output
    engine_state.py  the one adapter that reads the engine's memory and cache counters
    protocol.py      request bodies (pydantic) and their translation into SamplingParams
    responses.py     response bodies and server-sent-event chunks
    text_stream.py   which part of a growing completion text is safe to send
    metrics.py       Prometheus metrics; vllm_metrics.py: vLLM's names for vLLM's dashboards
    errors.py        OpenAI-style error objects
    limits.py        what one request may hold: sequences, prompt size, queue places, run time (and their flags)
    connections.py   uvicorn's HTTP protocol with a request read deadline and a connection cap
    log_limits.py    warnings rate-limited per kind, so a flood of events is a few log lines
    cli.py           the `serve` subcommand; vllm_flags.py: the `vllm serve` flags it takes too
"""
