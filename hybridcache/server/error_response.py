"""The HTTP response of an OpenAI-style error (`errors.error_body`), apart from `errors.py`, which the command line
imports without the `serve` extra (starlette)."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse


class ErrorResponse(JSONResponse):
    """An error body rendered as ASCII JSON, so that whatever text it quotes can always be encoded."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")
