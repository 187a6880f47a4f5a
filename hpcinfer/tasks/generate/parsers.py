"""A chat answer's reasoning and tool calls, split out of its text as OpenAI bodies carry them.

`--reasoning-parser` names how the model writes its reasoning before the answer:
- `deepseek_r1`: `<think>…</think>` (the template may open it in the prompt): the text before
  `</think>` is the reasoning, the rest the answer; an answer cut before `</think>` is all reasoning;
- `qwen3`: `<think>…</think>` when the model wrote both tags, else no reasoning;
- `gpt_oss`: harmony channels: `analysis` is the reasoning, `final` the answer.

`--tool-call-parser` names how a model writes its calls, read only for a request that gave `tools`:
- `hermes` (Qwen 2.5 / 3, Hermes): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, repeatable;
- `llama3_json` (Llama 3.1+): the answer is a JSON object `{"name": …, "parameters": {…}}` (or
  several separated by `;`), after an optional `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name": …, "arguments": {…}}`.
A call that does not parse leaves the whole answer as text, with its finish reason: never a failure.
What is split out goes to the message's `reasoning_content` (vLLM's field) and `tool_calls`
(OpenAI's, `finish_reason` `tool_calls`); the text around it stays the `content`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
HARMONY_END = r"(?=<\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>|$)"
HARMONY_PART = re.compile(r"<\|channel\|>(\w+)(?:[^<]*)<\|message\|>(.*?)" + HARMONY_END, re.DOTALL)


@dataclass(slots=True)
class Parsed:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def parse_answer(raw: str, reasoning_parser: str, tool_parser: str, tools_given: bool, salt: str) -> Parsed:
    """`raw`: the answer decoded with its special tokens (the markers some models write are special
    tokens). `salt` makes the calls' ids unique (the request's row)."""
    reasoning, content = split_reasoning(raw, reasoning_parser)
    parsed = Parsed(content, reasoning)
    if tools_given and tool_parser != "none" and content is not None:
        calls = find_calls(content, tool_parser)
        if calls is not None:
            before, found = calls
            parsed.content = before.strip() or None
            parsed.tool_calls = [
                {
                    "id": "call_" + hashlib.sha256(f"{salt}/{k}".encode()).hexdigest()[:24],
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
                }
                for k, (name, arguments) in enumerate(found)
            ]
    return parsed


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of an answer's text."""
    if parser == "deepseek_r1":
        body = text.split("<think>", 1)[1] if text.lstrip().startswith("<think>") else text
        if "</think>" not in body:
            return body.strip() or None, None  # NOTE: cut while thinking: all of it is reasoning
        thought, answer = body.split("</think>", 1)
        return thought.strip() or None, answer.strip() or None
    if parser == "qwen3":
        start = text.find("<think>")
        end = text.find("</think>", start + len("<think>")) if start >= 0 else -1
        if end < 0:
            return None, text  # NOTE: both tags, in order, or no reasoning
        thought = text[start + len("<think>") : end]
        return thought.strip() or None, (text[:start] + text[end + len("</think>") :]).strip() or None
    if parser == "gpt_oss":
        parts = HARMONY_PART.findall(text)
        if not parts:
            return None, text
        thought = "".join(t for channel, t in parts if channel == "analysis").strip()
        answer = "".join(t for channel, t in parts if channel == "final").strip()
        return thought or None, answer or None
    return None, text


def find_calls(text: str, parser: str) -> tuple[str, list[tuple[str, Any]]] | None:
    """(the text before the calls, [(name, arguments)]) or None: no call, or one that does not parse."""
    try:
        if parser == "hermes":
            bodies = HERMES_CALL.findall(text)
            if not bodies:
                return None
            return text[: text.index("<tool_call>")], [_call(json.loads(b)) for b in bodies]
        if parser == "llama3_json":
            stripped = text.strip().removeprefix("<|python_tag|>").strip()
            if not stripped.startswith("{"):
                return None
            return "", [_call(json.loads(part)) for part in _json_objects(stripped)]
        if parser == "mistral":
            if "[TOOL_CALLS]" not in text:
                return None
            before, after = text.split("[TOOL_CALLS]", 1)
            listed = json.loads(after.strip())
            listed = listed if isinstance(listed, list) else [listed]
            return before, [_call(item) for item in listed]
    except (ValueError, TypeError, KeyError, RecursionError):
        return None  # NOTE: a malformed call (or one nested past JSON's depth) stays text
    return None


def _call(obj: Any) -> tuple[str, Any]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call names its function")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("a tool call's arguments are an object")
    return obj["name"], arguments


def _json_objects(text: str) -> list[str]:
    """`{…}; {…}`: each JSON object of a llama3_json answer (a single one needs no separator)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text):
        _, end = decoder.raw_decode(text, at)
        found.append(text[at:end])
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return found
