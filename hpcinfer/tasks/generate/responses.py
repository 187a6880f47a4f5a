"""OpenAI's Responses API in batch files (`"url": "/v1/responses"`): a body read as the chat it is,
and its answer written as a `Response` (the `openai` package's `openai.types.responses.Response`).

A Responses body's `input` (a string, or a list of messages whose content is a string or
`input_text` / `output_text` parts) and `instructions` (a system message before them) become the
chat the checkpoint's template renders; `max_output_tokens`, `temperature`, `top_p` and `text.format`
(`json_schema`, `json_object`: structured output) become the sampling parameters. What a local text
model cannot answer (tools, images, files, reasoning settings, a previous response) is that
request's error, named, never silently dropped.
"""

from __future__ import annotations

from typing import Any

RESPONSES_URL = "/v1/responses"
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
# NOTE: accepted and not acted on: they change nothing a batch job answers
IGNORED = {"model", "metadata", "user", "store", "service_tier", "truncation", "parallel_tool_calls",
           "prompt_cache_key", "safety_identifier", "stream_options"}  # fmt: skip
REFUSED = {
    "previous_response_id": "a previous response (each request of a batch stands alone)",
    "conversation": "conversations (each request of a batch stands alone)",
    "reasoning": "reasoning settings",
    "background": "background mode",
    "prompt": "prompt templates",
    "max_tool_calls": "tool calls",
}
# NOTE: the engine's own sampling fields, as vLLM takes them in a Responses body too
SAMPLING = {"top_k", "min_p", "seed", "stop", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "logit_bias", "min_tokens", "top_logprobs"}  # fmt: skip


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body a Responses body asks for; ValueError naming what it cannot be."""
    for name, what in REFUSED.items():
        if body.get(name) is not None:
            raise ValueError(f"/v1/responses: {what} are not answered here ({name!r})")
    if body.get("tools"):
        raise ValueError("/v1/responses: tools are not answered here (a text answer only)")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise ValueError("/v1/responses: tool_choice needs tools, which are not answered here")
    if body.get("stream"):
        raise ValueError("/v1/responses: stream is not for a batch")
    if body.get("include"):
        raise ValueError(f"/v1/responses: include {body['include']!r} is not answered here")
    unknown = set(body) - IGNORED - set(REFUSED) - SAMPLING - {"input", "instructions", "max_output_tokens",
                                                              "temperature", "top_p", "text", "tools",
                                                              "tool_choice", "stream", "include"}  # fmt: skip
    if unknown:
        raise ValueError(f"/v1/responses: unknown field {sorted(unknown)[0]!r}")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ValueError("/v1/responses: instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    messages += input_messages(body.get("input"))
    chat: dict[str, Any] = {"messages": messages}
    for name in ("temperature", "top_p", *sorted(SAMPLING - {"top_logprobs"})):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("top_logprobs") is not None:
        raise ValueError("/v1/responses: top_logprobs are answered for /v1/chat/completions only")
    if (fmt := response_format((body.get("text") or {}).get("format"))) is not None:
        chat["response_format"] = fmt
    return chat


def input_messages(given: Any) -> list[dict[str, Any]]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ValueError("/v1/responses: input must be a string or a non-empty list of messages")
    messages = []
    for item in given:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise ValueError(f"/v1/responses: input items of type {kind!r} are not answered here (messages only)")
        role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ValueError(f"/v1/responses: a message's role must be one of {', '.join(ROLES)}")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") not in TEXT_PARTS
                    or not isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"/v1/responses: content parts of type {kind!r} are not read here (text only)")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ValueError("/v1/responses: a message's content must be a string or a list of text parts")
        messages.append({"role": role, "content": content})
    return messages


def response_format(fmt: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (structured output), or None for plain text."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise ValueError(f"/v1/responses: text.format {fmt!r} is not one of text, json_object, json_schema")


def echoed(body: dict[str, Any]) -> dict[str, Any]:
    """What a `Response` repeats of its request."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "text": {"format": fmt},
    }


def response_body(
    row: int, created_at: int, model: str, text: str, finish_reason: str | None, usage: dict[str, int], echo: dict
) -> dict[str, Any]:
    """A finished request's `Response`: one assistant message of one `output_text` part."""
    cut = finish_reason == "length"
    status = "incomplete" if cut else "completed"
    message = {
        "type": "message",
        "id": f"msg_{row}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }
    return {
        "id": f"resp_{row}",
        "object": "response",
        "created_at": created_at,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": model,
        "output": [message],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        **echo,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        },
    }
