"""The HTTP server (FastAPI): OpenAI-compatible routes, the native /generate, and health / info / cache / metrics /
tokenizer routes. Every failure is answered with OpenAI's error body `{"error": {message, type, param, code}}`.

    app = create_app(manager, tokenizer, server_cfg, model_path=path, handle=scheduler_handle)
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from mlaserve.config import ServerConfig
from mlaserve.core import SamplingParams
from mlaserve.server.engine import native_inputs
from mlaserve.server.manager import EngineDeadError, GenerateInput, RequestError
from mlaserve.server.openai_chat import chat_completion, chat_inputs, chat_stream
from mlaserve.server.openai_common import ServingContext, check_grammars, check_model
from mlaserve.server.openai_completions import completion, completion_inputs, completion_stream
from mlaserve.server.protocol import (
    AbortRequest, APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest, ModelCard,
    ModelList, TokenizeRequest, describe_errors, error_body, field_name,
)
from mlaserve.server.sse import DONE, ClientGone, SSEResponse, collect, sse, unless_disconnected

logger = logging.getLogger(__name__)

DEMO_NAME = "mlaserve-demo"
DEMO_OWNER = "mlaserve-demo (trained on Python source)"
OPEN_PATHS = ("/health", "/metrics")   # reachable without the API key (probes, scrapers)
HEALTH_TIMEOUT_S = 30.0
CLIENT_CLOSED = 499                    # nginx's status for "client closed request"
MAX_BODY_BYTES = 64 << 20              # a request body past this is refused (413) as it arrives, before it is all read

router = APIRouter()


def create_app(manager: Any, tokenizer: Any, server: ServerConfig, *, model_path: str | None = None,
               handle: Any | None = None, metrics: Any | None = None) -> FastAPI:
    """Build the app around a running TokenizerManager (or a stand-in with the same methods).

    Args:
        handle: the scheduler process (`alive()`); None when there is none (tests).
        metrics: a ServerMetrics when --enable-metrics, else None (/metrics answers 404).
    """
    demo = server.load.model_path is None
    name = server.load.served_model_name or (DEMO_NAME if demo else server.load.model_path)
    known = {name, server.load.model_path, model_path, DEMO_NAME if demo else None} - {None}
    ctx = ServingContext(manager, tokenizer, server, name, manager.context_len,
                         getattr(manager, "max_total_tokens", None), frozenset(known))
    app = FastAPI(title="mlaserve", dependencies=[Depends(_check_request)])
    app.state.ctx, app.state.handle, app.state.metrics = ctx, handle, metrics
    app.state.model_path, app.state.demo = model_path, demo
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestError, _api_error)
    app.add_exception_handler(EngineDeadError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    return app


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


async def _check_request(request: Request) -> None:
    """The API key (when --api-key) and --log-requests, for every route."""
    server = _ctx(request).server
    if server.log_requests:
        logger.info("%s %s from %s", request.method, request.url.path, request.client.host if request.client else "?")
    if server.api_key is None or request.url.path in OPEN_PATHS:
        return
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), server.api_key.encode()):
        raise APIError("Incorrect API key provided (send it as 'Authorization: Bearer KEY').", None, 401)


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes ends in 413 as soon as its Content-Length or its bytes read
    so far pass the limit, so an endless or huge upload cannot exhaust the server's memory."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            if declared.isdigit() and int(declared) > self.limit:
                raise HTTPException(413, self._message())
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"The request body is larger than the server's limit of {self.limit >> 20} MiB."


# --- errors ---------------------------------------------------------------------------------------------------

def _error(message: str, param: str | None, status: int, type_: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, status, type_, code), status_code=status)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return _error(f"The request body is not valid JSON ({detail}).", None, 400)
    if field_name(tuple(errors[0]["loc"])) is None:
        if errors[0].get("type") == "value_error":          # a check of the whole body (which fields go together)
            return _error(errors[0]["msg"].removeprefix("Value error, "), None, 400)
        return _error("The request body must be a JSON object (content-type: application/json).", None, 400)
    return _error(*describe_errors(errors), 400)


async def _api_error(request: Request, exc: APIError | RequestError | EngineDeadError) -> JSONResponse:
    return _error(exc.message, exc.param, exc.status_code, getattr(exc, "type", None), getattr(exc, "code", None))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return _error(str(exc.detail), None, exc.status_code)


async def _client_gone(request: Request, exc: ClientGone) -> Response:
    return Response(status_code=CLIENT_CLOSED)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s", request.url.path)
    return _error(f"internal server error: {type(exc).__name__}: {exc}", None, 500)


# --- OpenAI ----------------------------------------------------------------------------------------------------

def _model_card(request: Request) -> ModelCard:
    ctx, state = _ctx(request), request.app.state
    return ModelCard(id=ctx.model_name, owned_by=DEMO_OWNER if state.demo else "mlaserve",
                     root=state.model_path, max_model_len=ctx.context_len)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(ModelList(data=[_model_card(request)]).model_dump())


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    """OpenAI's retrieve-model (`client.models.retrieve(name)`): the card of a name this server answers to."""
    check_model(_ctx(request), model)
    return JSONResponse(_model_card(request).model_dump())


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    check_model(ctx, req.model)
    if req.stream:
        inputs, parse_tools = chat_inputs(req, ctx)
        await check_grammars(ctx, inputs)
        return SSEResponse(chat_stream(req, ctx, inputs, parse_tools))
    return JSONResponse(await unless_disconnected(request, chat_completion(req, ctx)))


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    check_model(ctx, req.model)
    if req.stream:
        inputs, prompts = completion_inputs(req, ctx)
        await check_grammars(ctx, inputs)
        return SSEResponse(completion_stream(req, ctx, inputs, prompts))
    return JSONResponse(await unless_disconnected(request, completion(req, ctx)))


# --- native ----------------------------------------------------------------------------------------------------

@router.post("/generate")
async def generate(req: GenerateRequest, request: Request) -> Response:
    """The Engine's request shape; the answer is the manager's snapshot (a list for a batch)."""
    ctx = _ctx(request)
    objs, batch = native_inputs(req)
    reqs = [ctx.manager.prepare(o) for o in objs]      # every check before anything runs or streams
    await ctx.manager.check_grammars(reqs)
    if req.stream:
        return SSEResponse(_native_stream(ctx, reqs[0]))
    results = await unless_disconnected(request, collect([ctx.manager.generate(r) for r in reqs]))
    for r in results:
        fr = r["meta_info"]["finish_reason"] or {}
        if fr.get("type") == "abort":
            raise APIError(fr.get("message") or "the request was aborted", None, fr.get("status_code", 503))
    return JSONResponse(results if batch else results[0])


async def _native_stream(ctx: ServingContext, req: Any) -> AsyncIterator[str]:
    async for snap in ctx.manager.generate(req):
        yield sse(snap)
    yield DONE


# --- health, info, control -------------------------------------------------------------------------------------

def _dead(request: Request) -> str | None:
    """Why requests cannot be served (the scheduler process or the manager's receive loop is gone), or None."""
    handle = request.app.state.handle
    if handle is not None and not handle.alive():
        return "the scheduler process is not running"
    return getattr(_ctx(request).manager, "dead", None)


def _require_scheduler(request: Request) -> None:
    dead = _dead(request)
    if dead is not None:
        raise APIError(dead, None, 503)


@router.get("/health")
async def health(request: Request) -> Response:
    dead = _dead(request)
    if dead is not None:
        return _error(dead, None, 503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy when a one-token generation completes within HEALTH_TIMEOUT_S."""
    _require_scheduler(request)
    ctx = _ctx(request)
    obj = GenerateInput(input_ids=[ctx.tokenizer.bos_token_id or 0],
                        sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
    try:
        await asyncio.wait_for(collect([ctx.manager.generate(ctx.manager.prepare(obj))]), HEALTH_TIMEOUT_S)
    except asyncio.TimeoutError:
        return _error(f"a one-token generation did not finish in {HEALTH_TIMEOUT_S:.0f} s", None, 503)
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(request: Request) -> JSONResponse:
    ctx, state = _ctx(request), request.app.state
    info = getattr(ctx.manager, "info", {})
    return JSONResponse({
        "model_path": state.model_path, "tokenizer_path": ctx.server.load.tokenizer_path or state.model_path,
        "served_model_name": ctx.model_name, "is_generation": True,
        "random_weights": ctx.server.load.load_format == "dummy",          # (the built-in demo model is trained)
        "architecture": info.get("architecture"), "context_length": ctx.context_len,
        "max_total_tokens": ctx.max_total_tokens, "vocab_size": ctx.tokenizer.vocab_size,
    })


@router.get("/get_server_info")
async def get_server_info(request: Request) -> JSONResponse:
    """Server arguments, then what the scheduler reported at start and now (actual values win over None)."""
    _require_scheduler(request)
    ctx, handle = _ctx(request), request.app.state.handle
    stats = await ctx.manager.get_stats()
    info = {**ctx.server.flat(), **getattr(ctx.manager, "info", {}), **stats}
    info.update(api_key=None if ctx.server.api_key is None else "<set>", model_path=request.app.state.model_path,
                served_model_name=ctx.model_name, server_pid=os.getpid(),
                scheduler_pid=handle.process.pid if handle is not None else None,
                rank_pids=[proc.pid for proc in handle.processes] if handle is not None else [])
    return JSONResponse(info)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> JSONResponse:
    _require_scheduler(request)
    if await _ctx(request).manager.flush_cache():
        return JSONResponse({"success": True, "message": "Cache flushed."})
    return _error("Cache not flushed: requests are running; retry when the server is idle.", None, 400)


@router.post("/abort_request")
async def abort_request(req: AbortRequest, request: Request) -> JSONResponse:
    """End a running request (its caller gets the error "aborted by an /abort_request call"), or all of them;
    answers how many were running. An unknown or finished rid is not an error (it may have just ended)."""
    _require_scheduler(request)
    return JSONResponse({"aborted": await _ctx(request).manager.abort_request(req.rid, req.abort_all)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m = request.app.state.metrics
    if m is None:
        return _error("metrics are off; start the server with --enable-metrics", None, 404)
    _require_scheduler(request)
    m.update(await _ctx(request).manager.get_stats())
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> JSONResponse:
    """A text (BOS added when add_special_tokens) or a chat (messages through the chat template) -> ids."""
    ctx = _ctx(request)
    if isinstance(req.prompt, str):
        ids = ctx.tokenizer.encode(req.prompt, add_bos=req.add_special_tokens)
    else:
        import jinja2

        try:
            ids = ctx.tokenizer.encode_chat([m.to_template() for m in req.prompt])
        except jinja2.TemplateError as e:
            raise APIError(f"the chat template rejected the messages: {e}", "prompt") from None
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.context_len})


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> JSONResponse:
    tok = _ctx(request).tokenizer
    if any(not 0 <= t < tok.vocab_size for t in req.tokens):
        raise APIError(f"token ids must be in [0, {tok.vocab_size})", "tokens")
    return JSONResponse({"text": tok.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)})
