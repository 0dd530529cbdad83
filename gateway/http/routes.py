"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health,
vLLM's /tokenize and /detokenize, and ``GET /v1/streams/{id}``, which resumes a streaming
response on any gateway.

Request ids: a completion's response id is the client's ``X-Request-Id`` when it sends one (else
``cmpl-<hex>`` / ``chatcmpl-<hex>``), and every completion response (errors included, once the
id is known) carries it back in an ``X-Request-Id`` header. What makes ids that clients chose
safe to share is in `gateway.engine.client`: the engine id gets a random suffix, and a stream's
id must be free (no journal under it), else 409.

Completions, of one choice or several, whole or streamed, take one path
(`gateway.http.completions`). Resumable streams: every SSE event carries an ``id:``
(`gateway.output.streaming.ChoiceCursor`). A streaming response is journaled in Redis
(``journal:<response id>``: one `JournalHeader` per prompt, the `Route` of each attempt of each
choice, then every engine output, written before the client sees what it produces), so the
events are a pure function of the journal. Another gateway replays it, skips what the client has
(``Last-Event-ID``), adopts the requests in their engines (`SyncRequest`) and continues live.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.generation_config import apply_sampling_defaults
from common.protocol import EngineStatus, Names
from common.redis_errors import REDIS_FAILURES
from gateway.engine.client import EngineClient
from gateway.engine.journal import read_journal, stream_not_found
from gateway.http.completions import ServeContext, resume, serve
from gateway.http.config import GatewayConfig
from gateway.http.errors import ApiError
from gateway.http.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from gateway.http.request_ids import header_request_id, request_id_of
from gateway.http.responses_api import ResponsesDeps, add_responses_routes
from gateway.http.tenants import ANONYMOUS, ApiKeys, Tenant, request_tenant
from gateway.openai.input_workers import InputWorkers
from gateway.openai.json_input import LARGE_INPUT_BYTES, read_json
from gateway.openai.request_docs import publish_request_schemas
from gateway.openai.schema import (
    BYTES_PER_TOKEN_ID,
    GenerationSpec,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from gateway.openai.tokenization import (
    Tokenizers,
    detokenize,
    tokenize_only,
)
from gateway.openai.vllm_fields import check_priority
from gateway.output.responses import EventStreamResponse
from gateway.responses.store import ResponseStore

logger = logging.getLogger("conveyor.gateway")
TOKENIZER_RETRY_S = 5.0  # between attempts to load a tokenizer that failed to load
SHUTDOWN_TIMEOUT_S = 5.0  # the most the lifespan's clean-up may take (aborts, key deletes, close)


def create_app(config: GatewayConfig) -> FastAPI:
    """Build the gateway app; its lifespan connects to Redis and starts the engine client."""
    gateway_id = config.gateway_id or uuid.uuid4().hex[:12]
    client = EngineClient(
        config.redis_url,
        Names(config.namespace),
        gateway_id,
        heartbeat_ttl_ms=config.heartbeat_ttl_ms,
        migration_limit=config.migration_limit,
        recovery_timeout_s=config.recovery_timeout_s,
        resume_window_s=config.resume_window_s,
        stall_timeout_s=config.stall_timeout_s,
        stream_interval_ms=config.stream_interval_ms,
        routing=config.routing,
        routing_overlap_weight=config.routing_overlap_weight,
    )
    tokenizers = Tokenizers(config.model, config.generation_config)
    workers = InputWorkers()

    def served_name(info: EngineStatus) -> str:
        return config.served_model_name or info.model_name

    metrics = GatewayMetrics(client, served_name, config.served_model_name or "")  # per app: tests run several
    api_keys = ApiKeys(config.api_keys, config.tenant_secret or config.namespace)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()

        async def warm() -> None:  # load the tokenizer before the first request needs it
            while client.model_info is None:
                await asyncio.sleep(0.5)
            metrics.series(served_name(client.model_info))  # the request series show (at 0) before any request
            while tokenizers.tokenizer is None:  # new work waits for it (`ready_info`): keep trying
                try:
                    await tokenizers.get(client.model_info)
                except Exception as exc:
                    logger.error("could not load the tokenizer (%s); trying again in %.0f s", exc, TOKENIZER_RETRY_S)
                    await asyncio.sleep(TOKENIZER_RETRY_S)

        warm_task = asyncio.create_task(warm())
        logger.info("gateway %s serving on %s:%d (namespace %r)", gateway_id, config.host, config.port, config.namespace)
        yield
        warm_task.cancel()
        try:  # bounded: a stop that hangs on Redis or a thread must not keep the process alive
            await asyncio.wait_for(client.stop(), SHUTDOWN_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("the engine client did not stop within %.0f s; exiting anyway", SHUTDOWN_TIMEOUT_S)
        workers.close()

    app = FastAPI(title="Conveyor", lifespan=lifespan)
    publish_request_schemas(app)  # the bodies, for /openapi.json only (`gateway.openai.request_docs`)
    app.state.client = client
    app.state.config = config
    app.state.metrics = metrics
    app.state.api_keys = api_keys  # `gateway.http.tenants`: the tenant of a request

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else {}
        response_id = getattr(request.state, "response_id", None)
        if response_id is not None:  # set once a completion request's id is known (`response_ids`)
            headers["X-Request-Id"] = response_id
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            ApiError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code, headers=exc.headers
        )  # e.g. a 405's Allow

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, REDIS_FAILURES):  # e.g. reading a journal to resume a stream: Redis's fault, not ours
            logger.warning("Redis failed: %s", exc, exc_info=exc)
            body = ApiError(503, f"the engine's Redis failed ({type(exc).__name__}); retry shortly", "server_error").body()
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        logger.error("unhandled error", exc_info=exc)
        # Not the exception's text: it is for the log, not for clients.
        return JSONResponse(
            ApiError(500, f"internal error ({type(exc).__name__}); see the gateway log", "server_error").body(), status_code=500
        )

    def answer_unhandled(inner: ASGIApp) -> ASGIApp:
        """Answer an unexpected exception with the JSON 500 here, and let it go no further:
        Starlette's outermost handler answers and then re-raises, and uvicorn closes the
        connection of a request that raised. A 500 need not cost the client its connection."""

        async def call(scope: Scope, receive: Receive, send: Send) -> None:
            started = False

            async def watch(message: Message) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            try:
                await inner(scope, receive, watch)
            except Exception as exc:
                if started or scope["type"] != "http":
                    raise  # a response is half sent: closing the connection is all that is left
                await (await internal_error(Request(scope), exc))(scope, receive, send)

        return call

    app.add_middleware(answer_unhandled)

    check_key = api_keys.tenant_of  # a 401 unless the request carries a key; its tenant otherwise

    def ready_info() -> EngineStatus:
        """The engine's model, for new work: a 503 (with Retry-After) while no engine serves or this
        gateway is still loading the tokenizer, as /health says, so that a load balancer's retry
        lands on a ready replica instead of holding the request here until it is."""
        info = client.model_info
        if info is None or client.down_reason is not None:
            raise ApiError(503, f"engine unavailable: {client.down_reason}", "server_error", code="engine_unavailable")
        if tokenizers.tokenizer is None:
            why = tokenizers.error or "loading the tokenizer"
            raise ApiError(503, f"gateway not ready: {why}", "server_error", code="not_ready")
        return info

    def check_model(model: str | None, info: EngineStatus) -> str:
        """The served name; a 404 unless ``model`` names it or its path ("" or None: the served model)."""
        name = served_name(info)
        if model and model not in (name, info.model_path):
            raise ApiError(
                404,
                f"The model `{model[:200]}` does not exist (this server serves `{name}`).",
                "not_found_error",
                "model",
                "model_not_found",
            )
        return name

    @app.get("/health")
    @app.get("/ping")  # vLLM's alias (SageMaker's probe), GET and POST
    @app.post("/ping")
    async def health() -> Response:
        if client.down_reason is not None:
            error = ApiError(503, f"engine unavailable: {client.down_reason}", "server_error")
            return JSONResponse(error.body(), status_code=503)
        if tokenizers.tokenizer is None:  # new work is refused until then (`ready_info`)
            why = tokenizers.error or "loading the tokenizer"
            return JSONResponse(ApiError(503, f"gateway not ready: {why}", "server_error").body(), status_code=503)
        return JSONResponse({"status": "ok", "gateway_id": gateway_id})

    def model_card(info: EngineStatus) -> dict[str, Any]:
        return {
            "id": served_name(info),
            "object": "model",
            "created": 0,
            "owned_by": "conveyor",
            "root": info.model_path,
            "max_model_len": info.max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_key(request)
        info = client.model_info
        return JSONResponse({"object": "list", "data": [model_card(info)] if info is not None else []})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        check_key(request)
        info = client.model_info
        if info is None or model_id not in (served_name(info), info.model_path):
            raise ApiError(404, f"The model `{model_id[:200]}` does not exist.", "not_found_error", "model", "model_not_found")
        return JSONResponse(model_card(info))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus metrics of the whole deployment (`gateway.http.metrics`); no API key, as /health."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    version_body = {"version": package_version()}  # read once: each read parses the package metadata

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse(version_body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_key(request)
        header_id = header_request_id(request)
        body = await read_json(request, config.max_body_bytes, workers)
        client_id = request_id_of(request, header_id, body)  # (first: a 400 below echoes it too)
        return await complete(request, parse_completion(body), body, client_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        header_id = header_request_id(request)
        body = await read_json(request, config.max_body_bytes, workers)
        client_id = request_id_of(request, header_id, body)
        return await complete(request, parse_chat(body, config.chat_parsers), body, client_id)

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request) -> Response:
        """vLLM's ``/tokenize``: a prompt's, or chat messages', token ids as a request would carry them."""
        check_key(request)
        spec = parse_tokenize(await read_json(request, config.max_body_bytes, workers))
        info = ready_info()
        check_model(spec.model, info)
        tokenizer = await tokenizers.get(info)
        return JSONResponse(
            await workers.run(spec.input_size() > LARGE_INPUT_BYTES, tokenize_only, tokenizer, tokenizers.call_lock, spec, info)
        )

    @app.post("/detokenize")
    async def detokenize_endpoint(request: Request) -> Response:
        """vLLM's ``/detokenize``: the text of token ids."""
        check_key(request)
        model, tokens = parse_detokenize(await read_json(request, config.max_body_bytes, workers))
        info = ready_info()
        check_model(model, info)
        tokenizer = await tokenizers.get(info)
        text = await workers.run(BYTES_PER_TOKEN_ID * len(tokens) > LARGE_INPUT_BYTES, detokenize, tokenizer, tokens, info)
        return JSONResponse({"prompt": text})

    def context(info: EngineStatus, tokenizer: Any, model: str, tenant: Tenant = ANONYMOUS) -> ServeContext:
        limit, parsers = config.max_inflight, config.chat_parsers
        return ServeContext(client, tokenizer, tokenizers.call_lock, workers, metrics, info, model, limit, parsers, tenant)

    async def generate(
        request: Request, spec: GenerationSpec, body: Any, ids: tuple[str, str, bool]
    ) -> tuple[str, dict[str, Any] | AsyncIterator[str]]:
        """The one request path: the served name, and the response body or its SSE events."""
        arrival = time.monotonic()
        info = ready_info()
        name = check_model(spec.model, info)
        check_priority(spec.priority, client.engines.values())
        tokenizer = await tokenizers.get(info)
        apply_sampling_defaults(spec.sampling, body, tokenizers.sampling_defaults)
        return name, await serve(context(info, tokenizer, name, request_tenant(request)), request, spec, ids, body, arrival)

    async def complete(request: Request, spec: GenerationSpec, body: Any, client_id: str | None) -> Response:
        response_id, engine_id = response_ids(request, spec, client_id)
        _, out = await generate(request, spec, body, (response_id, engine_id, client_id is not None))
        if isinstance(out, dict):
            return JSONResponse(out, headers={"X-Request-Id": response_id})
        return event_stream(out, response_id)

    def response_ids(request: Request, spec: GenerationSpec, client_id: str | None) -> tuple[str, str]:
        """The response id and the engine id (vLLM's rule: a client's id gets a random suffix)."""
        if client_id is None:
            response_id = f"{'chatcmpl' if spec.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            request.state.response_id = response_id
            return response_id, response_id
        return client_id, f"{client_id}-{uuid.uuid4().hex[:8]}"

    @app.get("/v1/streams/{response_id:path}")  # a client's id may hold "/"
    async def resume_stream(request: Request, response_id: str) -> Response:
        """Resume a streaming response (on any gateway): the events after ``Last-Event-ID``."""
        tenant = check_key(request)
        last = request.headers.get("last-event-id", "").strip() or "0"  # empty: nothing yet, as for n > 1
        journal = await read_journal(client, tenant.scope(response_id))  # another tenant's: none (a 404)
        if not journal.headers:
            raise stream_not_found(response_id)
        # The journal holds what was streamed: a stream that ended resumes without a live engine
        # (one that did not waits for an engine, as any request whose engine is gone).
        info = client.model_info or ready_info()
        tokenizer = await tokenizers.get(info)
        ctx = context(info, tokenizer, journal.headers[0].served_model, tenant)
        return event_stream(await resume(ctx, response_id, journal, last), response_id)

    add_responses_routes(
        app,
        ResponsesDeps(
            check_key,
            lambda request: read_json(request, config.max_body_bytes, workers),
            lambda body: parse_chat(body, config.chat_parsers),
            lambda model: check_model(model, ready_info()),
            lambda request, spec, body, response_id: generate(request, spec, body, (response_id, response_id, False)),
            ResponseStore(client.transport, client.names, int(config.response_ttl_s * 1000)),
        ),
    )

    def event_stream(events: AsyncIterator[str], response_id: str) -> EventStreamResponse:
        # The id in a header too: a client whose gateway dies before the first event can still resume.
        return EventStreamResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": response_id},
        )

    return app


def package_version() -> str:
    """This build's version, as installed (pyproject.toml is its one source)."""
    try:
        return importlib.metadata.version("conveyor")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
