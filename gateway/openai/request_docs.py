"""The request bodies of the completion endpoints as the served ``/openapi.json`` describes them,
for client generators and schema-driven fuzzers.

Documentation only: the handlers read their bodies as JSON and check them with
`gateway.openai.schema` (whose messages name the field and what was wrong), so these models
validate nothing. They list the fields a client sets, OpenAI's and vLLM's; any other field is
allowed, as the parsers ignore unknown fields.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

TokenIds = list[int]


class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = Field(False, description="a last chunk carries the usage")
    continuous_usage_stats: bool = Field(False, description="vLLM's: every chunk carries the usage so far")


class SamplingFields(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="allow")
    model: str | None = Field(None, description="the served model's name or path; empty or absent: the served model")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, description="vLLM's; 0 or -1: off")
    min_p: float = Field(0.0, ge=0, le=1, description="vLLM's")
    min_tokens: int = Field(0, ge=0, description="vLLM's")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = Field(None, description="vLLM's")
    ignore_eos: bool = Field(False, description="vLLM's")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(1.0, gt=0, description="vLLM's")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias")
    allowed_token_ids: TokenIds | None = Field(None, description="vLLM's")
    bad_words: list[str] | None = Field(None, description="vLLM's")
    response_format: dict[str, Any] | None = Field(None, description="text, json_object or json_schema")
    structured_outputs: dict[str, Any] | None = Field(None, description="vLLM's: json, regex, choice or grammar")
    include_stop_str_in_output: bool = Field(False, description="vLLM's")
    skip_special_tokens: bool = Field(True, description="vLLM's")
    add_special_tokens: bool | None = Field(None, description="vLLM's; default: true for a prompt, false for chat")
    truncate_prompt_tokens: int | None = Field(None, description="vLLM's: keep the prompt's last tokens")
    return_tokens_as_token_ids: bool = Field(False, description="vLLM's")
    return_token_ids: bool = Field(False, description="vLLM's")
    priority: int = Field(0, description="vLLM's; with the priority scheduling policy")
    cache_salt: str | None = Field(None, description="vLLM's: prefix cache entries shared only under one salt")
    request_id: str | None = Field(None, description="vLLM's; the X-Request-Id header wins")


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(description="one prompt or several, as text or token ids")
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, description="top logprobs per token")
    prompt_logprobs: int | None = Field(None, ge=-1, description="vLLM's: the prompt's logprobs (-1: the whole vocabulary)")
    best_of: int | None = Field(None, ge=1)


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(description="system, developer, user, assistant or tool")
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    prompt_logprobs: int | None = Field(None, ge=-1, description="vLLM's: the prompt's logprobs (-1: the whole vocabulary)")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's")
    add_generation_prompt: bool = Field(True, description="vLLM's")
    continue_final_message: bool = Field(False, description="vLLM's")
    include_reasoning: bool = Field(True, description="vLLM's")


# The documented body of each path that takes one.
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def publish_request_schemas(app: FastAPI, bodies: dict[str, type[BaseModel]] = REQUEST_BODIES) -> None:
    """Make ``app``'s OpenAPI document describe the POST body of each path of ``bodies`` (its
    model's JSON schema under ``components/schemas``), leaving how the handlers read bodies as it is."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            refs, defs = models_json_schema(
                [(model, "validation") for model in bodies.values()], ref_template="#/components/schemas/{model}"
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            for path, model in bodies.items():
                operation = doc.get("paths", {}).get(path, {}).get("post")
                if operation is not None:
                    content = {"application/json": {"schema": refs[(model, "validation")]}}
                    operation["requestBody"] = {"required": True, "content": content}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
