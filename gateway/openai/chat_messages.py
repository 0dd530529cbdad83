"""Chat ``messages``: validated, and shaped as Hugging Face chat templates read them.

Content parts are joined (text parts only). Tool use round-trips as vLLM passes it: an assistant
message's ``tool_calls`` (each function's ``arguments`` JSON string parsed into an object, the form
chat templates render), a tool message's ``tool_call_id``, and a message's ``name`` reach the
template; a template that does not use them leaves them out, as with vLLM. So does an assistant
message's reasoning, sent back as a response gave it (``reasoning`` or ``reasoning_content``: the
template gets both keys, templates read either; Qwen3's renders the thinking of the turns since
the last user message, as the model saw it while calling tools).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.http.errors import ApiError, bad
from gateway.openai.json_input import MAX_JSON_DEPTH, get_bool, get_field, parse_json, preview, typename

# Messages, content parts and tool calls are checked one by one on the event loop: their number is bounded.
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096
MAX_TOOL_CALLS = 128
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TEMPLATE_KWARGS = 64
_TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


@dataclass(frozen=True, slots=True)
class TemplateOptions:
    """How the chat template renders a request's messages (vLLM's fields, chat and ``/tokenize``
    alike): with the assistant's generation prompt, or continuing the final (assistant) message,
    the model writing on from its last character (a prefilled answer); ``kwargs`` are variables of
    the template's own (Qwen3's ``enable_thinking``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)


def parse_template_options(body: dict[str, Any], messages: list[dict[str, Any]]) -> TemplateOptions:
    """``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``; a 400
    for a combination the template cannot render. Names the renderer itself takes (``tokenize``
    would make it return ids) are checked where it is known (`gateway.openai.tokenization.chat_text`)."""
    generation_prompt = get_bool(body, "add_generation_prompt", True)
    continue_final = get_bool(body, "continue_final_message", False)
    if continue_final and generation_prompt:
        raise bad(
            "'continue_final_message' needs 'add_generation_prompt': false (the answer goes on, none starts)",
            "continue_final_message",
        )
    if continue_final and messages[-1]["role"] != "assistant":
        raise bad("'continue_final_message' needs the last message to be the assistant's", "continue_final_message")
    kwargs = get_field(
        body,
        "chat_template_kwargs",
        lambda v: isinstance(v, dict) and len(v) <= MAX_TEMPLATE_KWARGS and all(_TEMPLATE_VARIABLE.fullmatch(k) for k in v),
        f"an object of at most {MAX_TEMPLATE_KWARGS} template variables (names of letters, digits and '_')",
        {},
    )
    return TemplateOptions(generation_prompt, continue_final, dict(kwargs))


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``body["messages"]`` as template messages (see the module docstring); a 400 names the first fault."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad(f"'messages' may hold at most {MAX_MESSAGES} messages, got {len(messages)}", "messages")
    parsed: list[dict[str, Any]] = []
    num_parts = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object, got {typename(message)}", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {preview(role)}", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            num_parts += len(content)
            if num_parts > MAX_CONTENT_PARTS:
                raise bad(f"messages may hold at most {MAX_CONTENT_PARTS} content parts in all", "messages")
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"messages[{i}].content parts must be text parts", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string, got {typename(content)}", "messages")
        out: dict[str, Any] = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):
            value = message.get(key)
            if value is not None:
                if not isinstance(value, str) or (key == "tool_call_id" and role != "tool"):
                    where = " (on a tool message)" if key == "tool_call_id" else ""
                    raise bad(f"messages[{i}].{key} must be a string{where}", "messages")
                out[key] = value
        reasoning = next((message[k] for k in ("reasoning", "reasoning_content") if message.get(k) is not None), None)
        if reasoning is not None:
            if role != "assistant" or not isinstance(reasoning, str):
                raise bad(f"messages[{i}].reasoning must be a string, on an assistant message", "messages")
            out["reasoning"] = out["reasoning_content"] = reasoning
        calls = message.get("tool_calls")
        if calls is not None and calls != []:
            if role != "assistant":
                raise bad(f"messages[{i}].tool_calls belong on an assistant message", "messages")
            out["tool_calls"] = _tool_calls(calls, i)
        parsed.append(out)
    return parsed


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS:
        raise bad(f"{where} must be an array of at most {MAX_TOOL_CALLS} calls", "messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and call.get("type", "function") == "function"
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), (str, dict))
            and isinstance(call.get("id", ""), str)
        ):
            raise bad(f'{where}[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', "messages")
        arguments = function["arguments"]  # an object is taken as is (vLLM's leniency), "" as {}
        if isinstance(arguments, str):
            try:  # nesting bounded as the body's is: chat templates walk it recursively
                arguments = parse_json(arguments.encode()) if arguments else {}
            except ApiError:
                message = f"{where}[{j}].function.arguments must be JSON (at most {MAX_JSON_DEPTH} levels deep)"
                raise bad(message, "messages") from None
        out.append({"id": call.get("id", ""), "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


# The names transformers renders a chat template with besides the variables (`chat_text`).
RENDER_NAMES = frozenset({"messages", "conversations", "self"})


def chat_text(
    tokenizer: Any, messages: list[dict[str, Any]], template: TemplateOptions, tools: list[dict[str, Any]] | None = None
) -> str:
    """The prompt text of chat ``messages``: the tokenizer's chat template (a 400 when the
    template rejects them), or, for a checkpoint without one, a plain, documented fallback. The
    chat endpoint and ``/tokenize`` both render messages here, so they count the same tokens.
    ``tools`` and ``template``'s variables go to the template as transformers passes them (a
    template may ignore them)."""
    if getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError

        # A variable named as one of the renderer's own parameters would set it (``tokenize``:
        # ids instead of text), not the template's; as would one of the names it renders with.
        own = inspect.signature(tokenizer.apply_chat_template).parameters
        taken = [k for k in template.kwargs if k in own or k in RENDER_NAMES]
        if taken:
            raise ApiError(400, f"'chat_template_kwargs' may not set {taken[0]!r}", param="chat_template_kwargs")
        try:
            return str(
                tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=template.add_generation_prompt,
                    continue_final_message=template.continue_final_message,
                    **template.kwargs,
                )
            )
        # The template's own checks (that roles alternate), or a template that cannot render what a
        # client may send (tool call arguments it concatenates as strings, nesting past the
        # recursion limit, a variable it divides by that is 0): what the client sent, not a 500.
        except Exception as exc:
            if template.kwargs and not isinstance(exc, TemplateError):
                message = f"the model's chat template could not render the messages with 'chat_template_kwargs': {exc!r}"
                raise ApiError(400, message, param="chat_template_kwargs") from None
            raise ApiError(400, f"the model's chat template rejected the messages: {exc}", param="messages") from None
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    if template.continue_final_message:
        return text.removesuffix("\n")
    return text + "assistant:" if template.add_generation_prompt else text
