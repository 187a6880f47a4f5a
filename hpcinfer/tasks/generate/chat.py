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
    """A list of {role, content} objects with string roles and string (or null) content."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatError(f"message {i} needs a string 'role'")
        if not isinstance(m.get("content"), str | None):
            raise ChatError(f"message {i}: content must be a string")
