"""vLLM's tokenizer routes and version route.

    POST /tokenize     {"prompt": text} or {"messages": [...], "tools", "add_generation_prompt", ...} (rendered by
                       the chat template, images expanded into their tokens, as a chat request's prompt) ->
                       {"count", "max_model_len", "tokens", "token_strs"}; `return_token_strs`
                       adds the tokens' vocabulary strings (`convert_ids_to_tokens`, as vLLM's: "Ġa" for " a").
                       `add_special_tokens` is accepted (the tokenizer adds none).
    POST /detokenize   {"tokens": [...]} -> {"prompt": text} (special tokens kept, as vLLM's)
    GET  /version      {"version": the package version}

The tokenizer routes need the API key when one is set, as the /v1 routes do; /version does not. A prompt is
tokenized off the event loop, and a text too long to fit `max_model_len` tokens is refused by its size first, as
for a completion (limits.py).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from hybridcache.server.errors import APIError
from hybridcache.server.protocol import ChatCompletionRequest, TokenId, parse_request

if TYPE_CHECKING:
    from hybridcache.server.app import _Routes


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None


class TokenizeRequest(_Request):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    tokens: list[TokenId]  # required, as vLLM's (an empty list is an empty prompt)


def package_version() -> str:
    try:
        return version("hybridcache-llm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def add_tokenize_routes(app: FastAPI, routes: _Routes) -> None:
    """Register /tokenize, /detokenize and /version on `app`."""

    async def tokenize(request: Request) -> JSONResponse:
        routes._authorize(request)
        data = await routes._read_json(request)
        body: TokenizeRequest = parse_request(TokenizeRequest, data)
        routes._check_model(body.model)
        tokenizer = routes.model.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either 'prompt' or 'messages'", param="prompt")
        if body.prompt is not None:
            routes.check_prompt_bytes([body.prompt], "prompt")
            tokens = (await routes._encode([body.prompt]))[0]
        else:
            # rendered and its images expanded as a chat request's prompt is (vLLM's /tokenize runs the image
            # processor too), so the count is what /v1/chat/completions bills
            chat: ChatCompletionRequest = parse_request(ChatCompletionRequest, {**data, "stream": False})
            chat_prompt, images, _ = await routes.in_pool(routes._render_chat, chat)
            routes.check_prompt_bytes([chat_prompt.text], "messages")
            tokens = (await routes._encode([chat_prompt.text]))[0]
            if images:  # (URLs fetched on the event loop, the images decoded on the media threads)
                tokens, _ = await routes.image_request(tokens, images)
        # vLLM's: the vocabulary's token strings (byte-level pieces such as "Ġa", not decoded text)
        strs = tokenizer.hf.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return JSONResponse({"count": len(tokens), "max_model_len": routes.model.max_model_len, "tokens": tokens,
                             "token_strs": strs})

    async def detokenize(request: Request) -> JSONResponse:
        routes._authorize(request)
        body: DetokenizeRequest = parse_request(DetokenizeRequest, await routes._read_json(request))
        routes._check_model(body.model)
        vocab = routes.model.vocab_size or routes.model.tokenizer.vocab_size  # the range completions accepts
        bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {body.tokens[bad]} is outside the vocabulary [0, {vocab})",
                           param=f"tokens.{bad}")
        # special tokens kept, as vLLM's (a /tokenize -> /detokenize round trip of a chat prompt keeps its markers)
        return JSONResponse({"prompt": routes.model.tokenizer.decode(body.tokens, skip_special_tokens=False)})

    async def version_route() -> JSONResponse:
        return JSONResponse({"version": package_version()})

    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/version", version_route, methods=["GET"])
