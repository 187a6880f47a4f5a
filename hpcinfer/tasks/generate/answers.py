"""Generation's output: the answer row of a finished sequence (ours, or OpenAI's batch shape), a
window's answers as one table, and the parts store that assembles them.

What a checkpoint keeps of windows not yet committed (`answers_chunk`, `held_answers`): every
`--commit-every` seconds the job checkpoints the answers finished since the last time in windows
still open (files/parts.py: one chunk per window): a table of the input `row` and its `answer`,
the output row as JSON exactly as the window's part would hold it. A resumed run re-reads those
windows, books a held row as answered without running it again (its answer depends only on its
prompt and its seed, not on its neighbours), and commits the window whole as before.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from itertools import accumulate
from typing import Any

import pyarrow as pa
from tokenizers import Tokenizer

from ...engine.sequence import Sequence
from ...errors import ConfigError
from ...files.part_format import RAW_LINE, id_array
from ...files.parts import PartStore
from .parsers import parse_answer
from .requests import Request
from .responses import response_body


def schema(listed: bool = False) -> pa.Schema:
    """The answers' columns; `listed` (a run with --n > 1): each row's samples as lists, in sample
    order, and the completion tokens of all of them."""
    text = pa.list_(pa.string()) if listed else pa.string()
    return pa.schema(
        [
            ("id", pa.string()),
            ("text", text),
            ("finish_reason", text),
            ("prompt_tokens", pa.int64()),
            ("completion_tokens", pa.int64()),
        ]
    )


class GenerationStore(PartStore):
    """Parts of generation rows: assembled with the answers' schema, not embeddings'."""

    def __init__(self, output: str, fmt: str, fp: dict[str, Any], listed: bool = False) -> None:
        super().__init__(output, fmt, 0, fp)
        self.listed = listed  # a run with --n > 1: text and finish_reason are lists

    def empty_schema(self) -> pa.Schema:
        return schema(self.listed)


def answer_text(seq: Sequence, tokenizer: Tokenizer) -> tuple[list[int], str]:
    """One sample's answer: its token ids and text, without the token or string that stopped it."""
    ids = seq.completion
    if seq.stop_token:
        ids = ids[:-1]  # the EOS or stop token ends the answer; it is not part of the text
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if seq.stop_text_cut is not None:
        text = text[: seq.stop_text_cut]
    return ids, text


def answer_row(seq: Sequence, request: Request, tokenizer: Tokenizer, model: str) -> dict[str, Any]:
    """The output row of a finished request (its n samples, with n > 1): ours, or an OpenAI batch
    answer for an OpenAI request (`model`: the --model given, for a body that names none)."""
    samples = seq.samples or [seq]
    answers = [answer_text(s, tokenizer) for s in samples]
    completion = sum(s.num_completion for s in samples)
    usage = {"prompt_tokens": seq.num_prompt, "completion_tokens": completion}
    if not request.openai:  # NOTE: ids keep their kind, as embedding's do (text only where kinds mix)
        texts, reasons = [text for _, text in answers], [s.finish_reason for s in samples]
        if request.listed:
            return {"id": request.id, "text": texts, "finish_reason": reasons, **usage}
        return {"id": request.id, "text": texts[0], "finish_reason": reasons[0], **usage}
    if request.kind == "response":
        body = response_body(request.row, created(request.source), request.model or model, answers[0][1],
                             samples[0].finish_reason, usage, request.echo or {})  # fmt: skip
    else:
        body = completion_body(seq, request, answers, usage, tokenizer, model)
    return {
        "id": f"batch_req_{request.row}",
        "custom_id": request.id,
        "response": {"status_code": 200, "request_id": f"req_{request.row}", "body": body},
        "error": None,
    }


def chat_message(
    sample: Sequence, ids: list[int], text: str, request: Request, tokenizer: Tokenizer, index: int
) -> dict[str, Any]:
    """A chat answer's message: its text, or (--reasoning-parser, --tool-call-parser) its reasoning,
    content and tool calls split out of the text as the model wrote it, special tokens included."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if request.parse is None or sample.stop_text_cut is not None:
        return message  # NOTE: an answer cut by a stop string is what the client asked to see, as text
    reasoning_parser, tool_parser, tools_given = request.parse
    raw = tokenizer.decode(ids, skip_special_tokens=False)
    try:
        parsed = parse_answer(raw, reasoning_parser, tool_parser, tools_given, f"{request.row}/{index}")
    except Exception:  # noqa: BLE001 - whatever a model writes, its answer is kept: as text at worst
        return message
    if parsed.reasoning is None and not parsed.tool_calls:
        return message  # NOTE: nothing split out: the text as ever (without special tokens)
    message["content"] = parsed.content
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message


def completion_body(
    seq: Sequence,
    request: Request,
    answers: list[tuple[list[int], str]],
    usage: dict[str, int],
    tokenizer: Tokenizer,
    model: str,
) -> dict[str, Any]:
    """A chat completion's or a completion's body, one choice per sample of `seq`."""
    samples = seq.samples or [seq]
    chat = request.kind == "chat"
    prompt = vllm_prompt_logprobs(seq, tokenizer) if seq.params.prompt_logprobs is not None else None
    choices = []
    for index, (sample, (ids, text)) in enumerate(zip(samples, answers, strict=True)):
        logprobs = openai_logprobs(sample, ids, tokenizer, chat) if sample.params.logprobs is not None else None
        choice: dict[str, Any] = {"index": index, "finish_reason": sample.finish_reason, "logprobs": logprobs}
        if chat:
            choice["message"] = chat_message(sample, ids, text, request, tokenizer, index)
            if choice["message"].get("tool_calls"):
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = text
        if prompt is not None and not chat:
            choice["prompt_logprobs"] = prompt  # NOTE: where vLLM puts them: a completion's choices
        choices.append(choice)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request.row}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created(request.source),
        "model": request.model or model,  # NOTE: the request's name for it, as an API answers
        "choices": choices,
        "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
    }
    if prompt is not None and chat:
        body["prompt_logprobs"] = prompt  # NOTE: and a chat completion's body
    return body


@lru_cache(maxsize=64)
def created(source: str) -> int:
    """An answer's `created`: its input file's modification time, in whole seconds. NOTE: not the
    clock, so a resumed run, a Ray replica and an uninterrupted run write the same bytes."""
    try:
        return int(os.path.getmtime(source))
    except OSError:
        return 0


def vllm_prompt_logprobs(seq: Sequence, tokenizer: Tokenizer) -> list[dict[str, Any] | None]:
    """The prompt's log-probabilities in vLLM's shape: per prompt token, None for the first, else
    {token id: {logprob, rank, decoded_token}} for the token itself and the best alternatives."""

    def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token], skip_special_tokens=False)}

    out: list[dict[str, Any] | None] = []
    for position, item in enumerate(seq.prompt_logprobs[: seq.num_prompt]):
        if item is None:
            out.append(None)
            continue
        logprob, rank, top = item
        alternatives = {str(t): entry(t, v, r) for r, (t, v) in enumerate(top, start=1)}
        out.append({str(seq.tokens[position]): entry(seq.tokens[position], logprob, rank), **alternatives})
    return out


def openai_logprobs(seq: Sequence, ids: list[int], tokenizer: Tokenizer, chat: bool) -> dict[str, Any]:
    """The answer tokens' log-probabilities in OpenAI's shape: chat's `content` list, or
    completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

    def piece(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    entries = list(zip(ids, seq.logprobs[: len(ids)], strict=True))
    # NOTE: an answer token's text is what it adds to the decoded answer, so the pieces join into
    # the answer's text with any tokenizer (a WordPiece token alone decodes without its space)
    prefixes = [tokenizer.decode(ids[: k + 1], skip_special_tokens=True) for k in range(len(entries))]
    pieces = [text[len(before) :] for before, text in zip(["", *prefixes], prefixes, strict=False)]
    if chat:

        def item(text: str, logprob: float) -> dict[str, Any]:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = [
            {**item(text, lp), "top_logprobs": [item(piece(i), v) for i, v in top]}
            for text, (_, (lp, top)) in zip(pieces, entries, strict=True)
        ]
        return {"content": content, "refusal": None}
    offsets = [0, *accumulate(len(p) for p in pieces)][: len(pieces)]
    return {
        "tokens": pieces,
        "token_logprobs": [lp for _, (lp, _) in entries],
        "top_logprobs": [{piece(i): v for i, v in top} for _, (_, top) in entries] if seq.params.logprobs else None,
        "text_offset": offsets,
    }


def error_answer(reject: dict[str, Any]) -> dict[str, Any]:
    """A rejected OpenAI batch request's output line, in the batch API's error format (the row is
    in the rejects file too)."""
    row = reject["row"]
    error = {"code": reject["reason"], "message": reject["message"]}
    return {"id": f"batch_req_{row}", "custom_id": reject["id"], "response": None, "error": error}


def with_errors(
    answers: list[tuple[int, dict[str, Any]]], rejects: list[dict[str, Any]], openai_sources: set[str]
) -> list[dict[str, Any]]:
    """A window's answer rows in input order, with an error line for each rejected request of an
    OpenAI batch file: such a file gets one output line per request, answered or not."""
    errors = [(r["row"], error_answer(r)) for r in rejects if r["source"] in openai_sources]
    return [answer for _, answer in sorted([*answers, *errors], key=lambda item: item[0])]


def answers_table(rows: list[dict[str, Any]], fmt: str, listed: bool = False) -> pa.Table:
    """One window's answer rows (input order) as the table of its part (OpenAI answers: by custom_id)."""
    if rows and "custom_id" in rows[0]:
        if fmt == "parquet":
            raise ConfigError("an OpenAI batch input is answered in JSONL: give a .jsonl output")
        # NOTE: each answer as its own JSON line: an Arrow struct would give every row the union of
        # all rows' keys (a chat choice a null `text`, a token's top_logprobs every token's)
        lines = [json.dumps(row, default=str) for row in rows]
        return pa.table({"custom_id": pa.array([row["custom_id"] for row in rows]), RAW_LINE: lines})
    columns = {"id": id_array([row["id"] for row in rows])}
    for f in schema(listed):
        if f.name != "id":
            columns[f.name] = pa.array([row[f.name] for row in rows], f.type)
    return pa.table(columns)


def answers_chunk(results: list[tuple[int, dict[str, Any]]]) -> pa.Table:
    """(input row, answer row) pairs -> a checkpoint chunk."""
    return pa.table(
        {
            "row": pa.array([row for row, _ in results], pa.int64()),
            "answer": pa.array([json.dumps(answer, default=str) for _, answer in results], pa.string()),
        }
    )


def held_answers(store: Any) -> dict[int, dict[str, Any]]:
    """Every answer the checkpoints of a resumed output hold, by input row."""
    held: dict[int, dict[str, Any]] = {}
    for window_id in sorted(store.partial):
        found = store.checkpointed(window_id)
        if found is None:
            continue
        table, _ = found
        for row, answer in zip(table.column("row").to_pylist(), table.column("answer").to_pylist(), strict=True):
            held[row] = json.loads(answer)
    return held
