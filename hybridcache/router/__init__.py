"""Routing requests over many replicas by where their checkpoints live (docs/server.md, "Several replicas").

index.py        what one replica's prefix cache holds, rebuilt from its cache events (pure Python)
policy.py       which replica a request goes to: round-robin, session, kv-prefix, checkpoint (pure Python)
replicas.py     the HTTP router's view of each replica: its index from polled events, up or down, counters
app.py          the router's OpenAI-compatible HTTP front (FastAPI + httpx)
fleet_index.py  every replica's index from events the replicas push (the Ray Serve deployment's)
asgi_call.py    one HTTP request through an ASGI app in process, streamed back
ray_router.py   the checkpoint policy as a Ray Serve custom request router (the `ray` extra)
ray_metrics.py  the Ray Serve ingress's /metrics: router counters, every replica's engine metrics merged
ray_serve.py    the Ray Serve application: engine replicas, the index, the OpenAI ingress (the `ray` extra)
"""
