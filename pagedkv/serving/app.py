"""The HTTP side of ``pagedkv serve``: a Starlette app over an ``EngineThread``.

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (JSON, or SSE with
``"stream": true``), ``GET /v1/models``, ``/health``, ``/metrics`` (Prometheus text).

Handlers never touch MLX arrays: they validate and tokenize the request (the
tokenizer is plain Rust/Python), check that it can ever fit (``EngineLimits``, a 400
before any prefill), submit it to the engine thread, and read the request's ``Delta``s
from an asyncio queue that the engine thread fills through ``call_soon_threadsafe``.
A client that disconnects (a closed stream, or a dropped connection while waiting
for a non-streamed answer) aborts its request, which gives its pages back before the
engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pagedkv.errors import InvalidValueError
from pagedkv.loaded_model import LoadedModel
from pagedkv.serving.engine import GenerationRequest
from pagedkv.serving.engine_thread import EngineThread
from pagedkv.serving.openai_api import (
    ApiError,
    ApiRequest,
    chunk_json,
    new_id,
    parse_chat,
    parse_completion,
    response_json,
)

_DISCONNECT_POLL_S = 0.25
MAX_BODY_BYTES = 32 << 20  # a request body larger than this gets a 413 before it is parsed


def create_app(engine: EngineThread, lm: LoadedModel, *, default_max_tokens: int | None = None,
               on_shutdown: Callable[[], None] | None = None) -> Starlette:
    """The app for ``engine`` (started: its ``engine`` attribute is set) serving ``lm``
    under the name ``lm.name``. ``default_max_tokens``: a request without max_tokens may
    generate up to this many (default: as many as its context and the pool allow).
    ``on_shutdown`` runs when the server shuts down (after the last response)."""
    limits = engine.engine.limits
    metrics = engine.engine.metrics
    served = lm.name

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(request: Request) -> object:
        declared = request.headers.get("content-length", "0")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        raw = bytearray()
        async for chunk in request.stream():  # (a body without a length is counted as it comes)
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:  # (arrays or objects nested thousands deep)
            raise ApiError(400, "the request body nests too deeply") from None

    def prompt_of(req: ApiRequest) -> list[int]:
        if req.kind == "chat":
            from jinja2 import TemplateError

            try:
                return lm.chat_tokens(list(req.messages))
            except (InvalidValueError, TemplateError) as e:  # (no template, or one that refuses these messages)
                raise ApiError(400, str(e), param="messages") from None
        if isinstance(req.prompt, str):
            return lm.encode(req.prompt)
        try:
            limits.check_tokens(req.prompt)
        except InvalidValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        return list(req.prompt)

    async def generate(request: Request, parse) -> Response:
        try:
            req = parse(await body_of(request), served)
            prompt = await run_in_threadpool(prompt_of, req)
            if not prompt:
                raise ApiError(400, "the prompt is empty after tokenization", param="prompt")
            room = limits.max_request_tokens - len(prompt)
            max_tokens = req.max_tokens
            if max_tokens is None:
                max_tokens = max(1, min(room, default_max_tokens or room))
            try:
                limits.check(len(prompt), max_tokens)
            except InvalidValueError as e:
                raise ApiError(400, str(e), param="max_tokens" if req.max_tokens else "messages",
                               code="context_length_exceeded") from None
        except ApiError as e:
            return error(e)
        if not engine.alive:
            return error(ApiError(503, "the engine is not running", type="server_error"))
        rid = new_id(req.kind)
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        work = GenerationRequest(rid, prompt, req.params(max_tokens),
                                 lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d))
        engine.submit(work)
        if req.stream:
            return StreamingResponse(_stream(req, rid, deltas), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(request, req, rid, deltas)

    async def _collect(request: Request, req: ApiRequest, rid: str, deltas: asyncio.Queue) -> Response:
        text = []
        finished = False
        try:
            while True:
                try:
                    d = await asyncio.wait_for(deltas.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                text.append(d.text)
                if d.finish_reason is not None:
                    finished = True
                    if d.finish_reason == "error":
                        return error(ApiError(500, f"generation failed: {d.error}", type="server_error"))
                    return JSONResponse(response_json(req, rid, "".join(text), d.finish_reason, d.usage))
        finally:
            if not finished:
                engine.abort(rid)

    async def _stream(req: ApiRequest, rid: str, deltas: asyncio.Queue):
        created = int(time.time())
        first = True
        finished = False
        try:
            if req.kind == "chat":  # the role first, as OpenAI does
                yield _sse(chunk_json(req, rid, created, "", None, first=True))
                first = False
            while True:
                d = await deltas.get()
                if d.finish_reason == "error":
                    finished = True
                    yield _sse(ApiError(500, f"generation failed: {d.error}", type="server_error").body())
                    return
                if d.text or d.finish_reason is not None:
                    yield _sse(chunk_json(req, rid, created, d.text, d.finish_reason, first=first))
                    first = False
                if d.finish_reason is not None:
                    finished = True
                    if req.include_usage:
                        yield _sse(chunk_json(req, rid, created, None, None, usage=d.usage))
                    yield "data: [DONE]\n\n"
                    return
        finally:  # the client went away (the generator is closed or cancelled)
            if not finished:
                engine.abort(rid)

    async def chat(request: Request) -> Response:
        return await generate(request, parse_chat)

    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": served, "object": "model", "created": 0, "owned_by": "pagedkv",
             "max_model_len": limits.max_model_len}]})

    async def health(request: Request) -> Response:
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def not_found(request: Request, exc) -> Response:
        return error(ApiError(404, f"no route {request.method} {request.url.path}", type="not_found_error"))

    async def bad_method(request: Request, exc) -> Response:
        return error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: bad_method},
        lifespan=lifespan,
    )


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
