"""Routing requests over many replicas by where their checkpoints live (docs/server.md, "Several replicas").

index.py    what one replica's prefix cache holds, rebuilt from its cache events (pure Python)
policy.py   which replica a request goes to: round-robin, session, kv-prefix, checkpoint (pure Python)
app.py      the router's OpenAI-compatible HTTP front (FastAPI + httpx)
"""
