"""Request fields that would change an answer and that hpcinfer does not act on (OpenAI's and vLLM's
request fields, and llama.cpp's samplers): such a request is refused, naming the field, never
answered as if the field had not been asked for. A field that changes nothing a batch answers
(`user`, `metadata`, `store`, `service_tier`, ...) stays accepted; so does each field below at the
value that asks for nothing (`use_beam_search: false`, `skip_special_tokens: true`, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {} and value != ""


def _not_one(value: Any) -> bool:
    return value is not None and value != 1


# field -> (the values that ask for something, what is not done)
UNHONOURED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "early_stopping": (_set, "beam search here stops as transformers' default (early_stopping false)"),
    "include_stop_str_in_output": (_set, "the stop string is never kept in the answer here"),
    "skip_special_tokens": (lambda v: v is False, "answers are decoded without their special tokens here"),
    "spaces_between_special_tokens": (lambda v: v is False, "answers are decoded without their special tokens here"),
    "detokenize": (lambda v: v is False, "answers are always decoded here"),
    "truncate_prompt_tokens": (_set, "prompts are not truncated here (a long one is a too_long reject)"),
    "logits_processors": (_set, "custom logits processors are not run here"),
    "echo": (_set, "the prompt is not echoed in the answer here"),
    "suffix": (_set, "insertion (a suffix after the answer) is not answered here"),
    "prediction": (_set, "predicted outputs are not used here"),
    "audio": (_set, "audio answers are not made here"),
    "modalities": (lambda v: v is not None and v != ["text"], "only text answers are made here"),
    "web_search_options": (_set, "web search is not run here (the job runs offline)"),
    "functions": (_set, "functions are not called here (tools need --tool-call-parser)"),
    "function_call": (lambda v: v not in (None, "none", "auto"), "functions are not called here"),
    "tool_choice": (lambda v: v not in (None, "none", "auto"), "a required or named tool_choice is not enforced here"),
    "stream": (_set, "a batch answer is not streamed"),
    "typical_p": (_not_one, "typical sampling is not run here"),
    "tfs_z": (_not_one, "tail-free sampling is not run here"),
    "mirostat": (lambda v: v not in (None, 0), "mirostat sampling is not run here"),
    "dry_multiplier": (lambda v: v not in (None, 0, 0.0), "DRY repetition penalties are not run here"),
    "xtc_probability": (lambda v: v not in (None, 0, 0.0), "XTC sampling is not run here"),
}


def unhonoured(body: dict[str, Any], tools_read: bool) -> str | None:
    """Why a request asks for what is not done here (its first such field), or None. `tools_read`:
    the run parses tool calls (--tool-call-parser), so `tools` are honoured."""
    for name, (asks, why) in UNHONOURED.items():
        if name in body and asks(body[name]):
            return f"{name}: {why}"
    if _set(body.get("tools")) and not tools_read:
        return "tools: tool calls are not parsed without --tool-call-parser (the answer would be plain text)"
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1) and body.get("use_beam_search") is not True:
        return (
            "best_of: several sampled candidates with the best returned are not run here (beams are: use_beam_search)"
        )
    return None
