"""Chat prompts: `messages` rendered with the checkpoint's own template, in jinja2's sandbox.

NOTE: a chat template is data from the model directory, never code: it runs in an immutable
sandboxed environment (no attribute access to Python internals, no mutation of the messages),
with the same few helpers transformers gives templates (`raise_exception`, `tojson`,
`strftime_now`), so a template renders here exactly as `apply_chat_template` renders it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ...files.image_urls import image_bytes


class ChatError(ValueError):
    """A row's messages cannot be rendered (a reject, not a failed run)."""


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatRenderer:
    """Compiles the template once; `render(messages)` -> the prompt text."""

    def __init__(self, template: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(template)
        self.special_tokens = dict(special_tokens)

    def render(self, messages: Any, add_generation_prompt: bool = True, tools: Any = None, extra: Any = None) -> str:
        """`tools`: a request's tools, as templates that write tool calls read them; `extra`: its
        `chat_template_kwargs` (Qwen3's enable_thinking, gpt-oss's reasoning_effort, ...)."""
        check_messages(messages)
        if extra is not None and (not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra)):
            raise ChatError("chat_template_kwargs must be an object")
        given = {k: v for k, v in (extra or {}).items() if k not in ("messages", "add_generation_prompt", "tools")}
        if tools is not None:
            given["tools"] = tools
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **given
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatError(f"chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def check_messages(messages: Any) -> None:
    """A list of {role, content} objects with string roles and string (or null) content, or (an
    image chat's, `content_parts`) a list of typed parts."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatError(f"message {i} needs a string 'role'")
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content):
            continue
        if not isinstance(content, str | None):
            raise ChatError(f"message {i}: content must be a string")


def content_parts(messages: Any, source: str, images: bool, files: bool = True) -> tuple[Any, list[bytes]]:
    """OpenAI content parts made what a chat template reads: with a vision-language model (`images`)
    an `image_url` part becomes the template's `{"type": "image"}` and its image's bytes are
    returned in order; without one, text parts join into the message's text (and an image is
    refused). `source`: the input file, whose folder a relative image path is in."""
    if not isinstance(messages, list):
        return messages, []
    found: list[bytes] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                if not images:
                    raise ChatError(f"message {i} holds an image; this model takes text only")
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                try:
                    found.append(image_bytes(url, source, files))
                except ValueError as exc:
                    raise ChatError(f"message {i}: {exc}") from None
                parts.append({"type": "image"})
            else:
                raise ChatError(f"message {i}: a content part of type {kind!r} (text and image_url are read)")
        if images:
            out.append({**message, "content": parts})
        else:
            out.append({**message, "content": "\n".join(p["text"] for p in parts)})
    return out, found
