"""Reasoning and tool calls split out of chat answers (--reasoning-parser, --tool-call-parser).

The answers are forced: a tiny random model with a byte-level vocabulary writes exactly the text a
request's `choice` allows (structured output), so each format a real model writes (Qwen3 and
DeepSeek-R1 `<think>`, gpt-oss channels, Hermes, Llama 3 JSON and Mistral calls, malformed calls)
reaches the parsers through the engine and the answer writer. The bodies are checked with the
`openai` package's `ChatCompletion`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion

from tests.fixtures.tiny_gguf import build_tiny_gguf

from ..conftest import generate_config, read_output, run_job, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gguf(tmp_path_factory.mktemp("parsers") / "tiny.gguf", seed=11)


def forced(custom_id: str, text: str, **body: object) -> dict:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 300,
            "structured_outputs": {"choice": [text]}, **body}  # fmt: skip
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": chat}


def answers(tiny: Path, tmp_path: Path, lines: list[dict], **parsers: str) -> dict[str, ChatCompletion]:
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    run_job(generate_config(src, tmp_path / "out.jsonl", tiny, **parsers))
    rows = read_output(tmp_path / "out.jsonl").to_pylist()
    return {r["custom_id"]: ChatCompletion.model_validate(r["response"]["body"]) for r in rows}


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>the sky</think>\nIt is blue.", "the sky", "It is blue."),
        ("qwen3", "No thinking here.", None, "No thinking here."),
        ("deepseek_r1", "weighing it</think>Yes.", "weighing it", "Yes."),
        ("deepseek_r1", "<think>cut while thinking", "cut while thinking", None),
        ("gpt_oss", "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>Done.",
         "hmm", "Done."),
    ],
)  # fmt: skip
def test_reasoning_goes_to_reasoning_content(tiny, tmp_path, parser, text, reasoning, content):
    got = answers(tiny, tmp_path, [forced("a", text)], reasoning_parser=parser)["a"]
    message = got.choices[0].message
    assert getattr(message, "reasoning_content", None) == reasoning and message.content == content
    assert got.choices[0].finish_reason == "stop"


def test_tool_calls_for_requests_with_tools(tiny, tmp_path):
    call = '{"name": "weather", "arguments": {"city": "Paris"}}'
    lines = [
        forced("hermes", f"Let me look.<tool_call>{call}</tool_call>", tools=TOOLS),
        forced("two", f"<tool_call>{call}</tool_call><tool_call>{call.replace('Paris', 'Oslo')}</tool_call>",
               tools=TOOLS),
        forced("malformed", '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>', tools=TOOLS),
        forced("no_tools", f"<tool_call>{call}</tool_call>"),  # NOTE: no tools given: the text as it is
    ]  # fmt: skip
    got = answers(tiny, tmp_path, lines, tool_call_parser="hermes", reasoning_parser="qwen3")
    first = got["hermes"].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.message.tool_calls] == [
        ("weather", {"city": "Paris"})]  # fmt: skip
    two = got["two"].choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in two] == ["Paris", "Oslo"]
    assert len({c.id for c in two}) == 2 and two[0].id != first.message.tool_calls[0].id
    for key in ("malformed", "no_tools"):  # kept as text, a plain stop: never a failure
        choice = got[key].choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content.startswith("<tool_call>")


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("llama3_json", '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}'),
        ("mistral", '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}]'),
    ],
)
def test_other_call_formats(tiny, tmp_path, parser, text):
    got = answers(tiny, tmp_path, [forced("a", text, tools=TOOLS)], tool_call_parser=parser)["a"].choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content is None
    assert json.loads(got.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_the_template_receives_the_tools_and_template_kwargs(tiny, tmp_path):
    """The fixture's template lists the tools it is given, as Qwen's does: the prompt grows by them."""
    kwargs = {"tools": TOOLS, "enable_thinking": False}
    lines = [forced("with", "ok", tools=TOOLS, max_tokens=4), forced("without", "ok", max_tokens=4),
             forced("kwargs", "ok", max_tokens=4, chat_template_kwargs=kwargs)]  # fmt: skip
    got = answers(tiny, tmp_path, lines, tool_call_parser="hermes")
    with_tools, without = got["with"].usage.prompt_tokens, got["without"].usage.prompt_tokens
    assert with_tools > without + 3
    assert got["kwargs"].usage.prompt_tokens == without  # NOTE: tools come from the request's own field only


def test_odd_model_output_never_fails_the_parsers():
    from hpcinfer.tasks.generate.parsers import parse_answer

    reversed_tags = parse_answer("a</think>b<think>c", "qwen3", "none", False, "x")
    assert reversed_tags.reasoning is None and reversed_tags.content == "a</think>b<think>c"
    nested = parse_answer("[TOOL_CALLS]" + "[" * 100_000, "none", "mistral", True, "x")  # past JSON's depth
    assert nested.tool_calls == [] and nested.content.startswith("[TOOL_CALLS]")
    for parser in ("hermes", "llama3_json", "mistral"):
        for text in ("", "{", "<tool_call></tool_call>", '[TOOL_CALLS] "x"', '{"name": 3}', "<|python_tag|>{}"):
            assert parse_answer(text, "gpt_oss", parser, True, "x").tool_calls == []
