"""Generation's output: the answer row of a finished sequence (ours, or OpenAI's batch shape), a
window's answers as one table, and the parts store that assembles them."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from tokenizers import Tokenizer

from ...errors import ConfigError
from ...files.parts import PartStore, id_array
from .requests import Request
from .sequence import Sequence

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
    ]
)


class GenerationStore(PartStore):
    """Parts of generation rows: assembled with the answers' schema, not embeddings'."""

    def empty_schema(self) -> pa.Schema:
        return SCHEMA


def answer_row(seq: Sequence, request: Request, tokenizer: Tokenizer, model: str) -> dict[str, Any]:
    """The output row of a finished sequence: ours, or an OpenAI batch answer for an OpenAI request."""
    ids = seq.completion
    if seq.finish_reason == "stop" and seq.stop_text_cut is None:
        ids = ids[:-1]  # the EOS or stop token ends the answer; it is not part of the text
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if seq.stop_text_cut is not None:
        text = text[: seq.stop_text_cut]
    usage = {"prompt_tokens": seq.num_prompt, "completion_tokens": seq.num_completion}
    if not request.openai:  # NOTE: ids keep their kind, as embedding's do (text only where kinds mix)
        return {"id": request.id, "text": text, "finish_reason": seq.finish_reason, **usage}
    chat = request.kind == "chat"
    choice: dict[str, Any] = {"index": 0, "finish_reason": seq.finish_reason, "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request.row}",
        "object": "chat.completion" if chat else "text_completion",
        "model": model,
        "choices": [choice],
        "usage": {**usage, "total_tokens": seq.num_prompt + seq.num_completion},
    }
    return {
        "id": f"batch_req_{request.row}",
        "custom_id": request.id,
        "response": {"status_code": 200, "request_id": f"req_{request.row}", "body": body},
        "error": None,
    }


def answers_table(rows: list[dict[str, Any]], fmt: str) -> pa.Table:
    """One window's answer rows (input order) as the table of its part (OpenAI answers: by custom_id)."""
    if rows and "custom_id" in rows[0]:
        if fmt == "parquet":
            raise ConfigError("an OpenAI batch input is answered in JSONL: give a .jsonl output")
        return pa.Table.from_pylist(rows)
    columns = {"id": id_array([row["id"] for row in rows])}
    for f in SCHEMA:
        if f.name != "id":
            columns[f.name] = pa.array([row[f.name] for row in rows], f.type)
    return pa.table(columns)
