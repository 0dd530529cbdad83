"""Gateway settings (flags and CONVEYOR_* environment variables map onto these)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config import ServiceDefaults
from common.generation_config import GENERATION_CONFIG_MODES
from gateway.engine.client import DEFAULT_STREAM_INTERVAL_MS
from gateway.engine.routing import DEFAULT_OVERLAP_WEIGHT, DEFAULT_ROUTING, ROUTING_POLICIES
from gateway.openai.schema import ChatParsers
from gateway.output.reasoning_parsers import REASONING_PARSERS
from gateway.output.tool_parsers import TOOL_CALL_PARSERS

DEFAULT_RESPONSE_TTL_S = 3600.0


@dataclass(slots=True)
class GatewayConfig:
    redis_url: str = field(default=ServiceDefaults.redis_url, repr=False)  # may hold a password
    namespace: str = ServiceDefaults.namespace
    gateway_id: str = ""  # "" -> random per process (outputs stream and heartbeat key use it)
    host: str = "0.0.0.0"
    port: int = 8000
    model: str | None = None  # tokenizer directory; None -> the path the executor reported
    served_model_name: str | None = None  # None -> the name the executor reported
    max_body_bytes: int = 8 * 1024 * 1024
    max_inflight: int = 4096  # admission bound: beyond it, 429 with Retry-After
    heartbeat_ttl_ms: int = ServiceDefaults.heartbeat_ttl_ms
    migration_limit: int = ServiceDefaults.migration_limit
    recovery_timeout_s: float = ServiceDefaults.recovery_timeout_s
    resume_window_s: float = ServiceDefaults.resume_window_s
    stall_timeout_s: float = ServiceDefaults.stall_timeout_s
    # Outputs reach clients (and journals) at most this often: fewer, larger SSE chunks and Redis writes.
    stream_interval_ms: int = DEFAULT_STREAM_INTERVAL_MS
    routing: str = DEFAULT_ROUTING  # which engine a request goes to (`gateway.engine.routing`)
    routing_overlap_weight: float = DEFAULT_OVERLAP_WEIGHT  # cache_aware: a block to prefill against one in use
    response_ttl_s: float = DEFAULT_RESPONSE_TTL_S  # how long a stored Responses API response is kept (`gateway.responses.store`)
    # Each key is a tenant (`gateway.http.tenants`); none: one anonymous tenant, no key required.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # The HMAC key of tenant ids: the same on every replica ("" -> the namespace).
    tenant_secret: str = field(default="", repr=False)
    # vLLM's pair: "auto" tool choice reads the output with this parser (`gateway.output.tool_parsers`).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # vLLM's: a thinking model's reasoning apart from its content
    generation_config: str = "auto"  # vLLM's: "auto" takes the model's sampling defaults, "vllm" OpenAI's

    def __post_init__(self) -> None:
        for kind, name, known in (
            ("tool-call", self.tool_call_parser, TOOL_CALL_PARSERS),
            ("reasoning", self.reasoning_parser, REASONING_PARSERS),
        ):
            if name is not None and name not in known:
                raise ValueError(f"unknown {kind} parser {name!r} (known: {', '.join(sorted(known))})")
        if self.generation_config not in GENERATION_CONFIG_MODES:
            modes = ", ".join(GENERATION_CONFIG_MODES)
            raise ValueError(f"generation_config must be one of {modes}, got {self.generation_config!r}")
        if self.stream_interval_ms < 0:
            raise ValueError(f"--stream-interval-ms must be 0 or more, got {self.stream_interval_ms}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if not self.routing_overlap_weight >= 0:
            raise ValueError(f"routing_overlap_weight must be >= 0, got {self.routing_overlap_weight}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    @property
    def chat_parsers(self) -> ChatParsers:
        """The parsers chat output goes through: "auto" tool calls need both of vLLM's flags."""
        return ChatParsers(self.tool_call_parser if self.enable_auto_tool_choice else None, self.reasoning_parser)
