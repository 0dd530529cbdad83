"""`conveyor gateway`: run the OpenAI-compatible HTTP gateway (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from common.config import ServiceDefaults
from common.generation_config import GENERATION_CONFIG_MODES
from common.protocol import Names
from common.redact import redact_url
from common.redis_errors import REDIS_FAILURES, RedisAuthFailed
from common.service_cli import add_recovery_flags, env_flag, service_parser, setup_logging
from common.transport import SyncTransport
from gateway.engine.client import DEFAULT_STREAM_INTERVAL_MS
from gateway.engine.routing import DEFAULT_OVERLAP_WEIGHT, DEFAULT_ROUTING, ROUTING_POLICIES
from gateway.http.config import DEFAULT_RESPONSE_TTL_S, GatewayConfig
from gateway.http.tenants import read_key_file, split_keys
from gateway.output.reasoning_parsers import REASONING_PARSERS
from gateway.output.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("conveyor.gateway")


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = service_parser(
        "conveyor gateway",
        "Run the OpenAI-compatible HTTP gateway.",
        "tokenizer directory (default: the model path the executor reported)",
    )
    p.add_argument("--host", default=env("CONVEYOR_HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(env("CONVEYOR_PORT", "8000")))
    p.add_argument("--served-model-name", default=env("CONVEYOR_SERVED_MODEL_NAME"))
    p.add_argument("--gateway-id", default=env("CONVEYOR_GATEWAY_ID", ""), help="default: random per process")
    p.add_argument("--max-body-bytes", type=int, default=int(env("CONVEYOR_MAX_BODY_BYTES", str(8 * 1024 * 1024))))
    p.add_argument("--max-inflight", type=int, default=int(env("CONVEYOR_MAX_INFLIGHT", "4096")))
    p.add_argument(
        "--migration-limit",
        type=int,
        default=int(env("CONVEYOR_MIGRATION_LIMIT", ServiceDefaults.migration_limit)),
        help="times one request may move to another engine when its engine dies",
    )
    p.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default=env("CONVEYOR_ROUTING") or DEFAULT_ROUTING,
        help="which engine a request goes to: cache_aware (the longest cached prefix of its prompt against each "
        "engine's load, Dynamo's KV router cost), first_block (a hash of its first KV block, bounded by load) "
        "or least_loaded",
    )
    p.add_argument(
        "--routing-overlap-weight",
        type=float,
        default=float(env("CONVEYOR_ROUTING_OVERLAP_WEIGHT") or DEFAULT_OVERLAP_WEIGHT),
        help="cache_aware: how much a prompt block an engine must prefill weighs against a block it has in use",
    )
    add_recovery_flags(
        p,
        "seconds a request waits for a live engine before failing",
        "seconds a stream's journal is kept for resuming it on another gateway",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=int,
        default=int(env("CONVEYOR_STREAM_INTERVAL_MS") or DEFAULT_STREAM_INTERVAL_MS),
        help="deliver each request's new tokens at most this often (one SSE chunk and one journal entry per "
        "interval instead of per engine step: less Redis and CPU per token, coarser streaming); 0: as they come",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accept this bearer token, a tenant of its own; repeatable (prefer CONVEYOR_API_KEY, comma-separated, "
        "or --api-key-file: a flag shows in the process list)",
    )
    p.add_argument(
        "--api-key-file",
        default=env("CONVEYOR_API_KEY_FILE"),
        help="accept the keys of this file too, one a line (blank lines and # comments ignored): a mounted secret",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=env_flag("CONVEYOR_ENABLE_AUTO_TOOL_CHOICE"),
        help='serve tool_choice "auto" (the default with tools), reading calls with --tool-call-parser',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=env("CONVEYOR_TOOL_CALL_PARSER") or None,  # (set but empty: none)
        help="how the model writes tool calls: hermes (Qwen2.5/3, Hermes), llama3_json (Llama 3.1), mistral, "
        "pythonic (Llama 3.2/4), qwen3_coder (Qwen3-Coder)",
    )
    p.add_argument(
        "--generation-config",
        choices=GENERATION_CONFIG_MODES,
        default=env("CONVEYOR_GENERATION_CONFIG") or "auto",
        help="auto: a request's sampling defaults are the model's (its generation_config.json), as vLLM's; "
        "vllm: OpenAI's (temperature 1, no top-p or top-k)",
    )
    p.add_argument(
        "--response-ttl",
        type=float,
        default=float(env("CONVEYOR_RESPONSE_TTL") or DEFAULT_RESPONSE_TTL_S),
        help="seconds a stored Responses API response is kept (GET /v1/responses/{id}, previous_response_id)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=env("CONVEYOR_REASONING_PARSER") or None,
        help="return a thinking model's reasoning apart from its content: deepseek_r1 (R1, QwQ, Qwen3 2507 "
        "thinking) or qwen3 (Qwen3 hybrid)",
    )
    return p


def configured_keys(args: argparse.Namespace) -> list[str]:
    """The API keys: every ``--api-key``, ``CONVEYOR_API_KEY``'s (comma-separated) and the key file's."""
    keys = split_keys([*args.api_key, os.environ.get("CONVEYOR_API_KEY")])
    return keys + (read_key_file(args.api_key_file) if args.api_key_file else [])


def tenant_secret() -> str:
    """The tenant secret: ``CONVEYOR_TENANT_SECRET``, or the file ``CONVEYOR_TENANT_SECRET_FILE`` names
    (a mounted secret); "" when neither is set."""
    path = os.environ.get("CONVEYOR_TENANT_SECRET_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get("CONVEYOR_TENANT_SECRET", "")


def check_credentials(config: GatewayConfig) -> None:
    """Raise `RedisAuthFailed` if Redis rejects the credentials, before the server starts: from the
    app's start-up uvicorn would report it as a traceback and exit code 3, not the promised 2 and
    one line. An unreachable Redis is no error here: the gateway answers 503 until it is reachable."""
    transport = SyncTransport(config.redis_url, Names(config.namespace), owner="gateway")
    try:
        transport.ping(deadline_s=2)
    except REDIS_FAILURES:
        pass
    finally:
        transport.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        keys, secret = configured_keys(args), tenant_secret()
    except OSError as exc:
        parser.error(f"cannot read a key file: {exc}")
    try:
        config = GatewayConfig(
            redis_url=args.redis_url,
            namespace=args.namespace,
            gateway_id=args.gateway_id,
            host=args.host,
            port=args.port,
            model=args.model,
            served_model_name=args.served_model_name,
            max_body_bytes=args.max_body_bytes,
            max_inflight=args.max_inflight,
            api_keys=tuple(keys),
            tenant_secret=secret,
            heartbeat_ttl_ms=args.heartbeat_ttl_ms,
            migration_limit=args.migration_limit,
            recovery_timeout_s=args.recovery_timeout,
            resume_window_s=args.resume_window,
            response_ttl_s=args.response_ttl,
            stall_timeout_s=args.stall_timeout,
            stream_interval_ms=args.stream_interval_ms,
            routing=args.routing,
            routing_overlap_weight=args.routing_overlap_weight,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            generation_config=args.generation_config,
        )
    except ValueError as exc:  # settings that do not go together
        parser.error(str(exc))
    # The key never reaches a log, whoever logs it.
    setup_logging(args.log_level, secrets=[*keys, config.tenant_secret], log_format=args.log_format)
    logger.info(
        "gateway: Redis %s, namespace %r, %s",
        redact_url(args.redis_url),
        args.namespace,
        f"{len(set(keys))} API key(s), one tenant each" if keys else "no API key required",
    )
    try:
        check_credentials(config)
    except RedisAuthFailed as exc:
        logger.error("%s", exc)
        return 2
    import uvicorn

    from gateway.http.routes import create_app

    # log_config=None: uvicorn's records go to the root handler too, through its redaction filter.
    uvicorn.run(
        create_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=3,
    )
    return 0
